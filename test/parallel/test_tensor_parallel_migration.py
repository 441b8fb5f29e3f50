"""FSDP1 + TP checkpoints (ours and torch's) move to FSDP2 + TP (`fully_shard` over mesh["dp"] of the same
TP-parallelised model, torch's 2-D recipe) and back, online through DCP and offline through the converter, model and
Adam state, at the same and at other mesh shapes.

Oracle: an unsharded plain model trained on every data-parallel rank's batch, stepped alongside; after each move the
moved-to model trains on and must stay equal to it (losses and every parameter).
"""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
from test_tensor_parallel import Model, _batch, _build, _close, _full, _loss, _mesh
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_legacy.checkpoint as our_dsd
from fsdp_legacy import FullyShardedDataParallel as FSDP
from harness import run_on_ranks

LR = 0.01


def _fsdp2(mesh, seed: int) -> nn.Module:
    """FSDP2 + TP: the same TP plan, then fully_shard over mesh["dp"] per block and at the root."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Model()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


class Reference:
    """The plain model and its Adam, trained on the global batch (every dp rank's) of the current dp size."""

    def __init__(self, mesh) -> None:
        self.model = _build("plain", mesh)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=LR)

    def step(self, step: int, dp: int) -> list[torch.Tensor]:
        losses = [_loss(self.model, _batch(step, r)) for r in range(dp)]
        (sum(losses) / dp).backward()
        self.optim.step()
        self.optim.zero_grad()
        return [loss.detach() for loss in losses]

    def check(self, full: dict[str, torch.Tensor], what: str) -> None:
        expected = dict(self.model.named_parameters())
        assert full.keys() == expected.keys(), f"{what}: {sorted(full)} != {sorted(expected)}"
        for name, value in full.items():
            _close(value, expected[name].detach(), f"{what}: {name}")


def _train(model: nn.Module, optim: torch.optim.Optimizer, mesh, steps: range, ref: Reference, what: str) -> None:
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    for step in steps:
        loss = _loss(model, _batch(step, dp_rank))
        loss.backward()
        optim.step()
        optim.zero_grad()
        _close(loss.detach(), ref.step(step, dp)[dp_rank], f"{what}: loss at step {step}")


def _fsdp2_full(model: nn.Module) -> dict[str, torch.Tensor]:
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: (v.full_tensor() if isinstance(v, DTensor) else v) for name, v in full.items()}


def _save_fsdp1(which: str, mesh, path: str, ref: Reference, uop: bool) -> None:
    """FSDP1 + TP (ours or torch's) trains 2 steps and saves {"model", "optim"} SHARDED with DCP."""
    model = _build(which, mesh, uop=uop)
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    _train(model, optim, mesh, range(2), ref, f"{which}'s FSDP1 + TP")
    api = FSDP if which == "ours" else torch_fsdp.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with api.state_dict_type(model, torch_fsdp.StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": api.optim_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=path)


def _into_fsdp2(mesh, path: str, ref: Reference, steps: range) -> None:
    """FSDP2 + TP loads {"model", "optim"} with torch's DSD helpers, trains `steps`, saves to `path`/fsdp2."""
    model = _fsdp2(mesh, seed=7)  # another initialisation: everything must come from the checkpoint
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    ref.check(_fsdp2_full(model), "FSDP2 + TP after loading")
    _train(model, optim, mesh, steps, ref, "FSDP2 + TP")
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=f"{path}/fsdp2")


def _into_ours(mesh, path: str, ref: Reference, steps: range, uop: bool) -> None:
    """Ours loads {"model", "optim"} with fsdp_legacy.checkpoint's helpers (torch's signatures) and trains on."""
    model = _build("ours", mesh, uop=uop, seed=9)
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    model_sd, optim_sd = our_dsd.get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (dp = 1: NO_SHARD, whose SHARDED state dicts are FULL)
        dcp.load(state, checkpoint_id=path)
        our_dsd.set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    ref.check(_full(model), "ours after loading")
    _train(model, optim, mesh, steps, ref, "ours")


def _online(source: str, uop: bool, fsdp2_shape: tuple[int, int], back_shape: tuple[int, int], path: str) -> None:
    ref = Reference(_mesh(2, 2))
    _save_fsdp1(source, _mesh(2, 2), path, ref, uop)
    _into_fsdp2(_mesh(*fsdp2_shape), path, ref, range(2, 4))
    _into_ours(_mesh(*back_shape), f"{path}/fsdp2", ref, range(4, 6), uop)


ONLINE = [
    ("ours", True, (2, 2), (2, 2)),
    ("ours", False, (1, 4), (4, 1)),
    ("torch", False, (4, 1), (1, 4)),
    ("torch", True, (2, 2), (2, 2)),
]


@pytest.mark.parametrize(
    "source,uop,fsdp2_shape,back_shape",
    ONLINE,
    ids=[f"{s}-{'uop' if u else 'flat'}-fsdp2@{a[0]}x{a[1]}-back@{b[0]}x{b[1]}" for s, u, a, b in ONLINE],
)
def test_fsdp1_tp_checkpoint_moves_to_fsdp2_tp_and_back(tmp_path, source, uop, fsdp2_shape, back_shape) -> None:
    run_on_ranks(_online, 4, source, uop, fsdp2_shape, back_shape, str(tmp_path), timeout=240)


# --------------------------------------------------------------------------------------------------------------------
# Offline: the converter


def _trained_reference() -> Reference:
    ref = Reference(None)
    for step in range(2):
        ref.step(step, 2)
    return ref


def _save_for_offline(source: str, uop: bool, path: str) -> dict:
    ref = Reference(_mesh(2, 2))
    _save_fsdp1(source, _mesh(2, 2), path, ref, uop)
    names = {p: n for n, p in ref.model.named_parameters()}
    return {
        "model": {n: p.detach().clone() for n, p in ref.model.named_parameters()},
        "optim": {names[p]: {k: v.clone() for k, v in s.items()} for p, s in ref.optim.state.items()},
    }


def _offline_into_fsdp2(path: str, shape: tuple[int, int]) -> None:
    _into_fsdp2(_mesh(*shape), path, _trained_reference(), range(2, 4))


def _offline_full_into_ours(path: str, shape: tuple[int, int], uop: bool, fsdp2_dp: int) -> None:
    """Ours loads a full torch.save file {"model", "optim"} with fsdp_legacy.checkpoint's helpers (full_state_dict)."""
    ref = _trained_reference()
    for step in range(2, 4):  # (as FSDP2 trained them)
        ref.step(step, fsdp2_dp)
    mesh = _mesh(*shape)
    model = _build("ours", mesh, uop=uop, seed=9)
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    full = torch.load(path, weights_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        our_dsd.set_state_dict(
            model,
            optim,
            model_state_dict=full["model"],
            optim_state_dict=full["optim"],
            options=StateDictOptions(full_state_dict=True),
        )
    ref.check(_full(model), "ours after loading the full file")
    _train(model, optim, mesh, range(4, 6), ref, "ours from the full file")


OFFLINE = [("ours", True, (1, 4)), ("torch", False, (4, 1))]


@pytest.mark.parametrize(
    "source,uop,shape", OFFLINE, ids=[f"{s}-{'uop' if u else 'flat'}-at{a[0]}x{a[1]}" for s, u, a in OFFLINE]
)
def test_fsdp1_tp_checkpoint_converts_offline_for_fsdp2_tp(tmp_path, source: str, uop: bool, shape) -> None:
    """No mesh needs to be given: DCP stores each DTensor's pieces as chunks of the global tensor (the dp x tp
    placement is in its metadata), so DCP -> full and DCP -> FSDP2's DCP read them as any sharded checkpoint."""
    from fsdp_legacy.cli.main import main
    from fsdp_legacy.convert import convert_checkpoint, open_checkpoint

    saved = str(tmp_path / "fsdp1")
    expected = run_on_ranks(_save_for_offline, 4, source, uop, saved, timeout=240)[0]
    with open_checkpoint(saved) as stored:  # down: Shard(0) over dp x Shard(1) over tp; norm: replicated over tp
        assert sorted(stored.chunks(("model", "blocks.0.down.weight"))) == [
            ((r, c), (4, 6)) for r in (0, 4) for c in (0, 6)
        ]
        assert sorted(stored.chunks(("model", "blocks.0.norm.weight"))) == [((0,), (4,)), ((4,), (4,))]
    full, fsdp2 = str(tmp_path / "full.pt"), str(tmp_path / "fsdp2")
    convert_checkpoint(saved, full, to="full")
    assert main(["convert", saved, fsdp2, "--to", "dcp"]) == 0  # (the command line, in this process)
    written = torch.load(full, weights_only=True)
    assert written["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        _close(written["model"][name], value, f"full file: {name}")
        for key, state in expected["optim"][name].items():
            _close(written["optim"]["state"][name][key], state, f"full file: {key} of {name}")
    run_on_ranks(_offline_into_fsdp2, 4, fsdp2, shape, timeout=240)
    back = str(tmp_path / "back.pt")
    convert_checkpoint(f"{fsdp2}/fsdp2", back, to="full")
    run_on_ranks(_offline_full_into_ours, 4, back, (2, 2), uop, shape[0], timeout=240)
