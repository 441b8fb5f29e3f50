"""The older optimizer-state API that torch is removing upstream (full_optim_state_dict, shard_full_optim_state_dict,
scatter_full_optim_state_dict, with `optim_input` instead of `optim`): several parameter groups, the order given by a
parameter list, by param-group dicts or by the model, a state without `param_groups`, halving and doubling the world
size, and torch's errors for inconsistent inputs. Oracle: torch's FSDP1, key order included."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import fsdp_legacy
from fsdp_utils import Config, batch, build_ours, build_torch_fsdp, loss_of
from harness import run_on_ranks


def _two_groups(model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    return torch.optim.Adam([{"params": params[:1], "lr": 0.1}, {"params": params[1:], "lr": 0.01}])


def _trained(model: nn.Module) -> torch.optim.Optimizer:
    optim = _two_groups(model)
    for step in range(2):
        loss_of(model(batch(Config("net"), step))).backward()
        optim.step()
        optim.zero_grad()
    return optim


def _full(model: nn.Module, optim: torch.optim.Optimizer, lib: Any) -> dict:
    """A correct FULL dict (torch's default offload_to_cpu aliases values on CPU with use_orig_params=True)."""
    fsdp = lib.FullyShardedDataParallel
    with fsdp.state_dict_type(
        model, lib.StateDictType.FULL_STATE_DICT, None, lib.FullOptimStateDictConfig(offload_to_cpu=False)
    ):
        return fsdp.optim_state_dict(model, optim)


def _call(lib: Any, case: str, model: nn.Module, optim: torch.optim.Optimizer, full: dict) -> Any:
    fsdp = lib.FullyShardedDataParallel
    params = list(model.parameters())
    groups = [{"params": params[:1]}, {"params": params[1:]}]
    rank0 = full if dist.get_rank() == 0 else None
    calls = {
        "optim_input parameters": lambda: fsdp.shard_full_optim_state_dict(full, model, optim_input=params),
        "optim_input groups": lambda: fsdp.shard_full_optim_state_dict(full, model, optim_input=groups),
        "the model's order": lambda: fsdp.shard_full_optim_state_dict(full, model),
        "optim and optim_input": lambda: fsdp.shard_full_optim_state_dict(full, model, optim_input=params, optim=optim),
        "scatter with optim_input": lambda: fsdp.scatter_full_optim_state_dict(rank0, model, optim_input=params),
        "scatter with optim": lambda: fsdp.scatter_full_optim_state_dict(rank0, model, optim=optim),
        "no param_groups": lambda: fsdp.shard_full_optim_state_dict({"state": full["state"]}, model, optim=optim),
        "empty optim_input": lambda: fsdp.shard_full_optim_state_dict(full, model, optim_input=[]),
        "mixed optim_input": lambda: fsdp.shard_full_optim_state_dict(
            full, model, optim_input=[params[0], {"params": params[1:]}]
        ),
        "no state": lambda: fsdp.shard_full_optim_state_dict(
            {"param_groups": full["param_groups"]}, model, optim=optim
        ),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return calls[case]()
        except (ValueError, TypeError) as error:
            return f"{type(error).__name__}: {error}"


CASES = [
    "optim_input parameters",
    "optim_input groups",
    "the model's order",
    "optim and optim_input",
    "scatter with optim_input",
    "scatter with optim",
    "no param_groups",
    "empty optim_input",
    "mixed optim_input",
    "no state",
]


def _same(ours: Any, theirs: Any, what: str) -> None:
    assert type(ours) is type(theirs), (what, ours, theirs)
    if isinstance(ours, str):
        assert ours == theirs, what
    elif isinstance(ours, dict):
        # Key order too, except among one parameter's states, which torch builds from a set of names for flat
        # parameters (so its order changes from process to process).
        inner = what.count(".") >= 2 and ".state." in what
        assert (sorted(ours) == sorted(theirs)) if inner else (list(ours) == list(theirs)), what
        for key, value in ours.items():
            _same(value, theirs[key], f"{what}.{key}")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), what
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _same(a, b, f"{what}[{index}]")
    elif isinstance(ours, torch.Tensor):
        torch.testing.assert_close(ours, theirs, msg=what)
    else:
        assert ours == theirs, what


def _as_torch(use_orig_params: bool) -> None:
    config = Config("net", use_orig_params=use_orig_params)
    ours, theirs = build_ours(config)[1], build_torch_fsdp(config)
    our_optim, their_optim = _trained(ours), _trained(theirs)
    our_full, their_full = _full(ours, our_optim, fsdp_legacy), _full(theirs, their_optim, torch_fsdp)
    _same(our_full, their_full, "full")
    for case in CASES:
        _same(
            _call(fsdp_legacy, case, ours, our_optim, our_full),
            _call(torch_fsdp, case, theirs, their_optim, their_full),
            case,
        )


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_older_api_with_optim_input_matches_torch(use_orig_params: bool) -> None:
    run_on_ranks(_as_torch, 2, use_orig_params)


@pytest.mark.parametrize("world_size", [1, 4])
def test_older_api_at_one_and_four_ranks_matches_torch(world_size: int) -> None:
    run_on_ranks(_as_torch, world_size, True)


def _save(path: str, use_orig_params: bool) -> None:
    model = build_ours(Config("net", use_orig_params=use_orig_params))[1]
    full = _full(model, _trained(model), fsdp_legacy)
    if dist.get_rank() == 0:
        torch.save(full, path)
    dist.barrier()


def _load(path: str, use_orig_params: bool) -> None:
    full = torch.load(path, weights_only=True)
    config = Config("net", use_orig_params=use_orig_params)
    results = []
    for model, lib in ((build_ours(config, seed=1)[1], fsdp_legacy), (build_torch_fsdp(config, seed=1), torch_fsdp)):
        params = list(model.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results.append(lib.FullyShardedDataParallel.shard_full_optim_state_dict(full, model, optim_input=params))
    _same(results[0], results[1], f"loaded at world size {dist.get_world_size()}")


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_full_dict_saved_at_two_ranks_shards_at_one_and_four_as_torch(
    tmp_path, use_orig_params: bool, world_size: int
) -> None:
    path = str(tmp_path / "full.pt")
    run_on_ranks(_save, 2, path, use_orig_params)
    run_on_ranks(_load, world_size, path, use_orig_params)
