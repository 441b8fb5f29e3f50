"""What verl does to FSDP1 models besides training them (verl/utils/fsdp_utils.py, FSDP1 workers), made the same way
on ours and on torch's FSDP1, side by side:

- parameter offload between steps (`offload_fsdp_model_to_cpu` / `load_fsdp_model_to_gpu`): `_lazy_init(model,
  model)`, then for every handle of `model._all_handles` not already offloaded, `handle.flat_param_to(device)` and
  `flat_param._local_shard = flat_param.data`. On a CPU-only machine the move is made with `copy=True`, which gives the
  shard new storage as a move between devices does;
- layered summon of LoRA weights (`layered_summon_lora_params`): an inner unit is marked `_is_root = True`, summoned
  with `writeback=False`, its parameters read by name, and unmarked.

Oracles: torch's FSDP1 under the same calls (local shards and names) and DDP (parameters after training).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fsdp_legacy
import models
from fsdp_utils import Config, assert_close, batch, build_ours, build_torch_fsdp, full_params, loss_of, optimizer
from harness import run_on_ranks

STEPS = 3


@torch.no_grad()
def _move_parameters(model: torch.nn.Module, lazy_init) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """verl's round trip of the shards to another device and back, each move giving them new storage; returns the
    storage addresses (before, after) of each handle's shard."""
    lazy_init(model, model)
    assert model._is_root
    addresses = []
    for _ in ("offload", "load"):
        for handle in model._all_handles:
            if handle._offload_params:
                continue
            flat_param = handle.flat_param
            assert flat_param.data.data_ptr() == flat_param._local_shard.data_ptr()
            assert flat_param.data.size() == flat_param._local_shard.size()
            before = flat_param.data_ptr()
            handle.flat_param_to(torch.device("cpu"), non_blocking=True, copy=True)
            flat_param._local_shard = flat_param.data
            addresses.append((before, flat_param.data_ptr()))
    return addresses


def _local_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    return [handle.flat_param.detach().clone() for handle in model._all_handles]


def _side_by_side(strategy: str, use_orig_params: bool, between_steps) -> None:  # type: ignore[no-untyped-def]
    """Ours, torch's FSDP1 and DDP trained alike, `between_steps(step, ours, theirs)` after each step; then ours must
    equal DDP."""
    config = Config("transformer", strategy, "block", use_orig_params, steps=STEPS)
    reference, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    optimizers = [optimizer(model) for model in (ours, theirs, ddp)]
    for step in range(STEPS):
        for model, opt in zip((ours, theirs, ddp), optimizers, strict=True):
            loss_of(model(batch(config, step))).backward()
            opt.step()
            opt.zero_grad()
        between_steps(step, ours, theirs)
    full = full_params(ours)
    for name, param in reference.named_parameters():
        assert_close(full[name], param.detach(), f"{name} vs DDP")


def _offload_between_steps(strategy: str, use_orig_params: bool) -> None:
    _side_by_side(strategy, use_orig_params, _offload_and_load)


def _offload_and_load(step: int, ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    from torch.distributed.fsdp._runtime_utils import _lazy_init as torch_lazy_init

    moved = _move_parameters(ours, _our_lazy_init)
    assert all(before != after for before, after in moved), "each move gives the shard new storage"
    for handle in ours._all_handles:  # nothing of ours keeps the storage the shard left
        assert handle.local_shard.data_ptr() == handle.flat_param.data_ptr()
        for info, param in handle.orig_params.items():  # (use_orig_params: views of the new shard)
            assert param.numel() == 0 or handle.local_shard.data_ptr() <= param.data_ptr(), info.fqn
    _move_parameters(theirs, torch_lazy_init)
    for unit, (mine, expected) in enumerate(zip(_local_shards(ours), _local_shards(theirs), strict=True)):
        assert_close(mine, expected, f"step {step}, unit {unit}: local shard vs torch FSDP1")


def _our_lazy_init(state, root):  # type: ignore[no-untyped-def]
    """verl imports `_lazy_init` from torch's `_runtime_utils`, which the switch points at ours; the same call."""
    from fsdp_legacy.torch_helpers import _lazy_init

    return _lazy_init(state, root)


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_parameters_moved_between_steps_train_as_torch_fsdp1_and_ddp(strategy: str, use_orig_params: bool) -> None:
    run_on_ranks(_offload_between_steps, 2, strategy, use_orig_params)


def _moving_while_unsharded_raises() -> None:
    _, ours = build_ours(Config("transformer", "FULL_SHARD", "block", False))
    with fsdp_legacy.FullyShardedDataParallel.summon_full_params(ours):
        with pytest.raises(RuntimeError, match="flat_param_to.*while it is unsharded"):
            ours._all_handles[0].flat_param_to(torch.device("cpu"), copy=True)


def test_moving_parameters_while_unsharded_raises() -> None:
    run_on_ranks(_moving_while_unsharded_raises, 2)


def _layered_summon(use_orig_params: bool) -> None:
    _side_by_side("FULL_SHARD", use_orig_params, _summon_blocks_as_roots)


def _summon_blocks_as_roots(step: int, ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    summoned = []
    for model in (ours, theirs):
        fsdp = type(model)
        found = {}
        for name, unit in model.named_modules():
            if name == "" or not isinstance(unit, fsdp) or not isinstance(unit.module, models.TransformerBlock):
                continue
            unit._is_root = True
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with fsdp.summon_full_params(unit, writeback=False):
                    found |= {f"{name}.{n}": p.detach().clone() for n, p in unit.named_parameters()}
            unit._is_root = False
        summoned.append(found)
    assert list(summoned[0]) == list(summoned[1]) and summoned[0]
    for key, value in summoned[0].items():
        assert_close(value, summoned[1][key], f"step {step}: summoned {key} vs torch FSDP1")


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_inner_units_summoned_as_roots_between_steps(use_orig_params: bool) -> None:
    run_on_ranks(_layered_summon, 2, use_orig_params)
