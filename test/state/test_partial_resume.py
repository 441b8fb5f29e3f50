"""No silent partial resume (issue 32, item 4). Tried as a new user would: `dcp.load` into
`{"optim": FSDP.optim_state_dict(model, fresh_optimizer)}` and then `optim_state_dict_to_load` (Accelerate's resume
for SHARDED_STATE_DICT). Oracle: torch's FSDP1 running the same code restores no optimizer state and says nothing;
ours restores every state the checkpoint holds and resumes exactly as an uninterrupted run (and as torch's own fix,
load_sharded_optimizer_state_dict); a load fsdp_legacy cannot see into raises on every rank naming the fix; our DCP
loader refuses a target that would take fewer tensors than the checkpoint holds; and an optimizer that truly never
stepped still saves and loads as with torch's."""

from __future__ import annotations

import contextlib
import os
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as torch_dsd
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

import fsdp_legacy
import fsdp_legacy.checkpoint as ours_dsd
from fsdp_legacy import dcp_checkpoint
from fsdp_legacy.convert import CheckpointError
from fsdp_legacy.state import dcp_load_hook
from fsdp_utils import Config, batch, build_ours, build_torch_fsdp, full_params, loss_of
from harness import run_on_ranks

CONFIG = Config("net", "FULL_SHARD")


def _build(lib: str, seed: int = 0, config: Config = CONFIG) -> torch.nn.Module:
    return build_torch_fsdp(config, seed) if lib == "torch" else build_ours(config, seed)[1]


def _fsdp(lib: str) -> Any:
    return torch_fsdp if lib == "torch" else fsdp_legacy


def _steps(model: torch.nn.Module, optim: torch.optim.Optimizer, first: int, count: int) -> None:
    for step in range(first, first + count):
        loss_of(model(batch(CONFIG, step))).backward()
        optim.step()
        optim.zero_grad()


def _sharded(model: torch.nn.Module, lib: str) -> Any:
    lib_ = _fsdp(lib)
    return lib_.FullyShardedDataParallel.state_dict_type(model, lib_.StateDictType.SHARDED_STATE_DICT)


def _save_trained(lib: str, path: str, config: Config = CONFIG) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _build(lib, config=config)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, optim, 0, 2)
    fsdp = _fsdp(lib).FullyShardedDataParallel
    with _sharded(model, lib):
        dcp.save({"model": model.state_dict(), "optim": fsdp.optim_state_dict(model, optim)}, checkpoint_id=path)
    return model, optim


def _naive_resume(lib: str, path: str, loader: str = "dcp.load") -> dict[str, Any]:
    """The new user's resume: a fresh optimizer's state dict as the DCP load target."""
    trained = _save_trained(lib, path)[1]
    model = _build(lib, seed=1)
    fresh = torch.optim.Adam(model.parameters(), lr=0.5)
    fsdp = _fsdp(lib).FullyShardedDataParallel
    # torch's load as bound before fsdp_legacy was imported (what `from torch.distributed.checkpoint import load` at
    # the top of a script gets when it comes first): ours cannot see into it
    load = getattr(dcp.load, "__wrapped__", dcp.load) if loader == "bound early" else dcp.load
    with _sharded(model, lib):
        state = {"model": model.state_dict(), "optim": fsdp.optim_state_dict(model, fresh)}
        load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        try:
            fresh.load_state_dict(fsdp.optim_state_dict_to_load(model, fresh, state["optim"]))
            error = None
        except RuntimeError as failure:
            error = str(failure)
    saved, restored = trained.state_dict()["state"], fresh.state_dict()["state"]
    return {
        "error": error,
        "saved_states": len(saved),
        "restored_states": len(restored),
        "identical": saved.keys() == restored.keys()
        and all(torch.equal(saved[k][n], restored[k][n]) for k in saved for n in saved[k] if n in restored[k]),
        "lr": fresh.param_groups[0]["lr"],
    }


@pytest.mark.parametrize("lib", ["torch", "ours"])
def test_a_fresh_optimizer_as_load_target(tmp_path, lib: str) -> None:
    """torch's FSDP1 (the oracle of the problem): the param_groups come back (lr 0.01) but no state, nothing said.
    Ours: every state the saved optimizer held, bit for bit."""
    results = run_on_ranks(_naive_resume, 2, lib, str(tmp_path / "ckpt"))
    for result in results:
        assert result["saved_states"] > 0 and result["error"] is None and result["lr"] == 0.01
        if lib == "torch":
            assert result["restored_states"] == 0
        else:
            assert result["restored_states"] == result["saved_states"] and result["identical"]


def test_a_load_fsdp_legacy_cannot_see_into_is_refused_on_every_rank(tmp_path) -> None:
    results = run_on_ranks(_naive_resume, 2, "ours", str(tmp_path / "ckpt"), "bound early")
    for result in results:
        assert result["error"] is not None, "ours must not resume from zeroed optimizer state silently"
        assert "load_sharded_optimizer_state_dict" in result["error"] and "dcp.load" in result["error"]
        assert result["restored_states"] == 0


def _resumes_exactly(path: str, how: str, uop: bool) -> dict[str, torch.Tensor]:
    """Saved after 2 steps, resumed by `how` into a fresh model and optimizer, 2 more steps; minus the parameters of
    the uninterrupted run of 4 steps."""
    config = Config("net", "FULL_SHARD", use_orig_params=uop)
    model, optim = _save_trained("ours", path, config)
    _steps(model, optim, 2, 2)
    uninterrupted = full_params(model)
    resumed = _build("ours", seed=1, config=config)
    fresh = torch.optim.Adam(resumed.parameters(), lr=0.5)
    fsdp = fsdp_legacy.FullyShardedDataParallel
    if how == "load_sharded_optimizer_state_dict":
        with _sharded(resumed, "ours"):
            state = {"model": resumed.state_dict()}
            dcp.load(state, checkpoint_id=path)
            resumed.load_state_dict(state["model"])
            reader = dcp.FileSystemReader(path)
            osd = load_sharded_optimizer_state_dict(state["model"], "optim", reader)["optim"]
            fresh.load_state_dict(fsdp.optim_state_dict_to_load(resumed, fresh, osd))
    elif how in ("dcp.load", "dcp.load, metadata on rank 0 only", "dcp_checkpoint.load"):  # as Accelerate does
        with _sharded(resumed, "ours"):
            state = {"model": resumed.state_dict(), "optim": fsdp.optim_state_dict(resumed, fresh)}
            if how == "dcp_checkpoint.load":
                dcp_checkpoint.load(state, path)
            else:  # (a rank that cannot read the metadata is told it by rank 0, as DCP's own load tells it)
                hidden = how.endswith("only") and dist.get_rank() != 0
                refused = mock.patch.object(dcp_load_hook, "read_metadata", side_effect=AssertionError("unseen"))
                with refused if hidden else contextlib.nullcontext():
                    dcp.load(state, checkpoint_id=path)
            resumed.load_state_dict(state["model"])
            fresh.load_state_dict(fsdp.optim_state_dict_to_load(resumed, fresh, state["optim"]))
    else:  # our DSD helpers create the state of the target first, and our loader checks the checkpoint
        model_sd, optim_sd = ours_dsd.get_state_dict(resumed, fresh)
        state = {"model": model_sd, "optim": optim_sd}
        dcp_checkpoint.load(state, path)
        ours_dsd.set_state_dict(resumed, fresh, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _steps(resumed, fresh, 2, 2)
    return {name: value - uninterrupted[name] for name, value in full_params(resumed).items()}


@pytest.mark.parametrize("uop", [False, True])
@pytest.mark.parametrize(
    "how",
    [
        "dcp.load",
        "dcp.load, metadata on rank 0 only",
        "dcp_checkpoint.load",
        "load_sharded_optimizer_state_dict",
        "fsdp_legacy.checkpoint",
    ],
)
def test_a_resume_into_a_fresh_optimizer_is_exact(tmp_path, how: str, uop: bool) -> None:
    """Every way, use_orig_params both ways: the resumed run equals the uninterrupted one, bit for bit."""
    for differences in run_on_ranks(_resumes_exactly, 2, str(tmp_path / "ckpt"), how, uop):
        for name, difference in differences.items():
            assert difference.abs().max().item() == 0.0, name


def _our_loader(path: str) -> dict[str, Any]:
    model = _save_trained("ours", path)[0]
    fresh = torch.optim.Adam(model.parameters(), lr=0.5)
    fsdp = fsdp_legacy.FullyShardedDataParallel
    out: dict[str, Any] = {}
    with _sharded(model, "ours"):
        # a target with no place for the state: a copy of a fresh optimizer's dict (not the dict returned, which the
        # load would fill), as a deep copy or a dict rebuilt by hand would be
        returned = fsdp.optim_state_dict(model, fresh)
        target = {"model": model.state_dict(), "optim": {"state": {}, "param_groups": returned["param_groups"]}}
        try:
            dcp_checkpoint.load(target, path)
        except CheckpointError as error:
            out["partial"] = str(error)
        dcp_checkpoint.load({"model": model.state_dict()}, path)  # a section left out is not loaded: fine
        dcp_checkpoint.load(target, path, strict=False)  # the caller accepts a partial load
        out["partial_states"] = len(target["optim"]["state"])
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out["held"] = sorted(k for k in metadata if k.startswith("optim.state."))  # the oracle: what the checkpoint holds
    return out


def test_our_dcp_loader_refuses_fewer_tensors_than_the_checkpoint_holds(tmp_path) -> None:
    results = run_on_ranks(_our_loader, 2, str(tmp_path / "ckpt"))
    for result in results:
        held = result["held"]
        assert len(held) == 3 * 7  # Net's 7 parameters, each with Adam's exp_avg, exp_avg_sq and step
        assert f"{len(held)} tensor(s) that the state to load has no place for" in result["partial"]
        assert f": {held[0]}, {held[1]}," in result["partial"]
        assert "get_optimizer_state_dict" in result["partial"]
        assert result["partial_states"] == 0
    assert results[0]["partial"] == results[1]["partial"]


def _never_stepped(lib: str, path: str, flow: str) -> dict[str, Any]:
    """An optimizer that never stepped, saved, loaded into another fresh one by `flow`."""
    model = _build(lib)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    fsdp = _fsdp(lib).FullyShardedDataParallel
    fresh = torch.optim.Adam(model.parameters(), lr=0.5)
    with _sharded(model, lib):
        saved = fsdp.optim_state_dict(model, optim)
        if flow == "direct":
            osd = saved
        elif flow == "torch.save":
            file = os.path.join(path, f"optim{dist.get_rank()}.pt")
            os.makedirs(path, exist_ok=True)
            torch.save(saved, file)
            osd = torch.load(file, weights_only=False)
        else:
            dcp.save({"optim": saved}, checkpoint_id=path)
            osd = fsdp.optim_state_dict(model, fresh)
            if flow == "dcp_checkpoint.load":
                dcp_checkpoint.load({"optim": osd}, path)
            else:
                dcp.load({"optim": osd}, checkpoint_id=path)
        fresh.load_state_dict(fsdp.optim_state_dict_to_load(model, fresh, osd))
    return {"states": len(fresh.state), "lr": fresh.param_groups[0]["lr"]}


@pytest.mark.parametrize("flow", ["direct", "torch.save", "dcp_checkpoint.load", "dcp.load"])
def test_an_optimizer_that_never_stepped_saves_and_loads_as_with_torch(tmp_path, flow: str) -> None:
    """A legitimate fresh start: nothing to restore, the param_groups (lr 0.01) loaded, nothing said, as torch's FSDP1
    does (the loads read the checkpoint and find no state for it)."""
    torch_flow = "dcp.load" if flow == "dcp_checkpoint.load" else flow  # (torch has no dcp_checkpoint)
    torch_side = run_on_ranks(_never_stepped, 2, "torch", str(tmp_path / "torch"), torch_flow)
    ours = run_on_ranks(_never_stepped, 2, "ours", str(tmp_path / "ours"), flow)
    assert torch_side == ours == [{"states": 0, "lr": 0.01}] * 2


def _dsd_empty_state(lib: str) -> dict[str, Any]:
    model = _build(lib)
    fresh = torch.optim.Adam(model.parameters(), lr=0.5)
    fsdp = _fsdp(lib).FullyShardedDataParallel
    with _sharded(model, lib):
        osd = fsdp.optim_state_dict(model, fresh)
    helpers = torch_dsd if lib == "torch" else ours_dsd
    try:
        helpers.set_optimizer_state_dict(model, fresh, osd)
        return {"error": None, "states": len(fresh.state)}
    except RuntimeError as error:
        return {"error": str(error), "states": len(fresh.state)}


def test_set_optimizer_state_dict_refuses_a_state_with_no_entries() -> None:
    """torch's DSD helper loads nothing from a state with no entries and says nothing; ours raises on every rank."""
    assert run_on_ranks(_dsd_empty_state, 2, "torch") == [{"error": None, "states": 0}] * 2
    for result in run_on_ranks(_dsd_empty_state, 2, "ours"):
        assert result["error"] is not None and "Missing optimizer state for parameter" in result["error"]
