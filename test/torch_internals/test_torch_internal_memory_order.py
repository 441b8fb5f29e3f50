"""Parameters that are not row-major contiguous (a transposed weight, a channels_last convolution), held in the flat
parameter in their memory order as torch's FSDP1 holds them: `_contiguities` and `_strides` as torch's, the local
shards element for element (so LOCAL checkpoints and flat-parameter readers interchange), the views in forward with
the parameter's strides (the memory format the model chose), and training, summon_full_params' writeback, FULL and
SHARDED state dicts and the FULL optimizer state equal to torch's. On ours next to torch's FSDP1 through the switch
(the very same code), and against the oracle of the same model trained without FSDP; SHARDED state dicts (where torch's
raises) and full weights saved to safetensors, loaded back, against the model's own values."""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

import fsdp_legacy
from fsdp_legacy.checkpoint import load_full_model, save_full_model  # (imported before any switch is on)
from fsdp_legacy.convert import convert_checkpoint, open_checkpoint
from fsdp_legacy.state import dcp_checkpoint
from harness import run_on_ranks
from torch_side_by_side import _FSDP, _flat, _fsdp, _full_params, _run_both, _run_ours, _same


class _Conv(nn.Conv2d):
    """Records the strides its weight has in its forward (inside its FSDP unit)."""

    strides: dict[str, tuple[int, ...]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.strides["conv"] = tuple(self.weight.stride())
        return super().forward(x)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.strides: dict[str, tuple[int, ...]] = {}
        self.conv = _Conv(3, 4, 3, padding=1).to(memory_format=torch.channels_last)
        self.conv.strides = self.strides
        self.proj = nn.Linear(4, 6)
        self.proj.weight = nn.Parameter(torch.randn(4, 6).t())  # a transpose: strides (1, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.strides["proj"] = tuple(self.proj.weight.stride())
        return self.proj(self.conv(x).mean((2, 3)))


def _batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, 5, 5, generator=generator) for _ in range(steps)]


def _train(model: nn.Module, optim: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for batch in batches:
        loss = model(batch).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _everything(strategy: str, uop: bool) -> dict[str, Any]:
    fsdp = _fsdp()
    FSDP = fsdp.FullyShardedDataParallel
    torch.manual_seed(0)
    plain = _Model()
    reference = copy.deepcopy(plain)
    model = _FSDP(
        plain,
        auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Conv2d}),
        sharding_strategy=getattr(fsdp.ShardingStrategy, strategy),
        use_orig_params=uop,
    )
    flats = [unit._handle.flat_param for unit in FSDP.fsdp_modules(model) if unit._handle is not None]
    seen: dict[str, Any] = {
        "contiguities": [list(flat._contiguities) for flat in flats],
        "strides": [[list(s) for s in flat._strides] for flat in flats],
        "shards": [_flat(flat) for flat in flats],
    }
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    seen["losses"] = _train(model, optim, _batches(2))
    seen["forward strides"] = {name: list(stride) for name, stride in plain.strides.items()}
    reference_optim = torch.optim.Adam(reference.parameters(), lr=0.01)
    seen["reference losses"] = _train(reference, reference_optim, _batches(2))
    seen["reference optim"] = {
        name: {key: _flat(v) for key, v in reference_optim.state[param].items() if key != "step"}
        for name, param in reference.named_parameters()
    }
    with FSDP.summon_full_params(model):
        with torch.no_grad():
            plain.proj.weight.mul_(0.5)
            plain.conv.weight.add_(0.25)
    seen["params"] = _full_params(model)
    with FSDP.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT):
        state = model.state_dict()
        osd = FSDP.optim_state_dict(model, optim)
    seen["state"] = {key: _flat(value) for key, value in state.items()}
    seen["optim"] = {
        key: {name: _flat(v) if isinstance(v, torch.Tensor) else v for name, v in values.items()}
        for key, values in osd["state"].items()
    }
    # Both loaded into a fresh model and optimizer, which trains on as the first would.
    torch.manual_seed(5)
    fresh = _FSDP(
        _Model(),
        auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Conv2d}),
        sharding_strategy=getattr(fsdp.ShardingStrategy, strategy),
        use_orig_params=uop,
    )
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.01)
    with FSDP.state_dict_type(fresh, fsdp.StateDictType.FULL_STATE_DICT):
        fresh.load_state_dict(state)
        fresh_optim.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_optim, osd))
    seen["resumed"] = _train(fresh, fresh_optim, _batches(1))
    seen["continued"] = _train(model, optim, _batches(1))
    return seen


_SAME_AS_TORCH = ("contiguities", "strides", "shards", "forward strides")
_SAME_AS_TORCH_FLAT = ("losses", "params", "state", "optim", "resumed", "continued")


@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_parameters_in_memory_order_as_torch(strategy: str, uop: bool) -> None:
    """With use_orig_params=True torch's FSDP1 goes wrong on such parameters (its FULL optimizer state dict gives
    another parameter's moments, and under NO_SHARD its training departs from the model's own); ours keeps to the
    oracle there, and to torch's layout everywhere."""
    for rank, result in enumerate(_run_both(_everything, strategy, uop)):
        ours, theirs = result["ours"], result["torch"]
        for key in _SAME_AS_TORCH + (() if uop else _SAME_AS_TORCH_FLAT):
            _same(ours[key], theirs[key], f"rank {rank} {key}")
        assert ours["contiguities"] == [[False, True], [False, True]]  # (each unit's weight, then bias)
        assert ours["forward strides"] == {"proj": [1, 6], "conv": [27, 1, 9, 3]}  # a transpose, channels_last
        torch.testing.assert_close(ours["losses"], ours["reference losses"], rtol=1e-5, atol=1e-6)
        for name, moments in ours["reference optim"].items():
            for key, values in moments.items():
                torch.testing.assert_close(ours["optim"][name][key], values, rtol=1e-4, atol=1e-7, msg=name)
        torch.testing.assert_close(ours["resumed"], ours["continued"], rtol=1e-5, atol=1e-6)


def _sharded_round_trip() -> dict[str, Any]:
    fsdp = _fsdp()
    FSDP = fsdp.FullyShardedDataParallel
    torch.manual_seed(0)
    model = _FSDP(_Model(), auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Conv2d}))
    with FSDP.state_dict_type(model, fsdp.StateDictType.SHARDED_STATE_DICT):
        state = model.state_dict()
    torch.manual_seed(7)
    other = _FSDP(_Model(), auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Conv2d}))
    with FSDP.state_dict_type(other, fsdp.StateDictType.SHARDED_STATE_DICT):
        other.load_state_dict(state)
    return {"expected": _full_params(model), "loaded": _full_params(other)}


def test_sharded_state_dict_of_parameters_in_memory_order() -> None:
    """Beyond torch: its SHARDED state dict raises "Only torch.contiguous_format memory_format is currently
    supported" for such a parameter (its dim-0 chunks keep the strides); ours gives row-major chunks, which load
    back."""
    for observed in _run_ours(_sharded_round_trip):
        assert observed["loaded"] == observed["expected"]


def _weights_round_trip() -> dict[str, Any]:
    fsdp = _fsdp()
    torch.manual_seed(0)
    model = _FSDP(_Model(), auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Conv2d}))
    expected = _full_params(model)
    directory = tempfile.mkdtemp() if dist.get_rank() == 0 else ""
    holder = [directory]
    dist.broadcast_object_list(holder)
    path = os.path.join(holder[0], "weights")
    save_full_model(model, path)
    saved = {k: _flat(v) for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    torch.manual_seed(7)
    other = _FSDP(_Model(), auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Conv2d}))
    load_full_model(other, path)
    return {"expected": expected, "saved": saved, "loaded": _full_params(other)}


def test_full_weights_of_parameters_in_memory_order_round_trip() -> None:
    """The file holds each tensor row-major (what transformers and safetensors read); loading reorders it back."""
    for observed in _run_ours(_weights_round_trip):
        for name, values in observed["expected"].items():
            assert observed["saved"][name] == values, name
            assert observed["loaded"][name] == values, name


def _save_local_checkpoint(path: str) -> dict[str, Any]:
    FSDP = fsdp_legacy.FullyShardedDataParallel
    torch.manual_seed(0)
    model = FSDP(_Model(), auto_wrap_policy=fsdp_legacy.wrap.ModuleWrapPolicy({nn.Conv2d}))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, optim, _batches(1))
    with FSDP.state_dict_type(model, fsdp_legacy.StateDictType.LOCAL_STATE_DICT):
        dcp_checkpoint.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}, path)
    with FSDP.state_dict_type(model, fsdp_legacy.StateDictType.FULL_STATE_DICT):
        return {
            "model": {k: _flat(v) for k, v in model.state_dict().items()},
            "optim": {
                fqn: {name: _flat(v) for name, v in values.items() if name != "step"}
                for fqn, values in FSDP.optim_state_dict(model, optim)["state"].items()
            },
        }


def _load_local_checkpoint(path: str) -> dict[str, Any]:
    FSDP = fsdp_legacy.FullyShardedDataParallel
    torch.manual_seed(3)
    model = FSDP(_Model(), auto_wrap_policy=fsdp_legacy.wrap.ModuleWrapPolicy({nn.Conv2d}))
    with FSDP.state_dict_type(model, fsdp_legacy.StateDictType.LOCAL_STATE_DICT):
        state = {"model": model.state_dict()}
        dcp_checkpoint.load(state, path)
        model.load_state_dict(state["model"])
    with FSDP.state_dict_type(model, fsdp_legacy.StateDictType.FULL_STATE_DICT):
        return {k: _flat(v) for k, v in model.state_dict().items()}


def test_local_checkpoints_of_parameters_in_memory_order_convert_offline(tmp_path: Any) -> None:
    """The layout record carries each such parameter's strides (version 2, which readers before it refuse rather than
    read row-major): a LOCAL checkpoint converts to one full file holding the model's values and Adam state, and back to
    LOCAL at 4 ranks, which loads into the model there."""
    local, full, local4 = str(tmp_path / "local"), str(tmp_path / "full.pt"), str(tmp_path / "local4")
    expected = run_on_ranks(_save_local_checkpoint, 2, local)[0]
    with open_checkpoint(local) as checkpoint:
        strides = {r.prefix + p.fqn: p.stride for r in checkpoint.side_records.values() for p in r.params}
    assert strides == {"proj.weight": (1, 6), "proj.bias": None, "conv.weight": (27, 1, 9, 3), "conv.bias": None}
    convert_checkpoint(local, full, to="full")
    stored = torch.load(full, weights_only=True)
    for key, values in expected["model"].items():
        assert _flat(stored["model"][key]) == values, key
    for fqn, moments in expected["optim"].items():
        for name, values in moments.items():
            assert _flat(stored["optim"]["state"][fqn][name]) == values, (fqn, name)
    convert_checkpoint(full, local4, to="local", world_size=4)
    for loaded in run_on_ranks(_load_local_checkpoint, 4, local4):
        assert loaded == expected["model"]
