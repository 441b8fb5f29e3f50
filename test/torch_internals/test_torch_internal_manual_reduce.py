"""Gradients reduced by hand through FSDP1's private runtime helpers, as Galvatron's pipeline-parallel training does:
micro-batches accumulate under no_sync(), then for each unit `_runtime_utils._unshard(state, handle,
state._unshard_stream, state._pre_unshard_stream)` and `_post_backward_hook(state, handle, None)`, then the root's
`_post_backward_final_callback(root, root)`. On ours next to torch's FSDP1 (through the switch, the very same code,
which takes torch 2.0's `_handles` / `_streams` where it finds them, as Galvatron's does), and against the oracle of
plain accumulation (each micro-batch's backward reduced as usual)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from torch import nn

from torch_side_by_side import _FSDP, _fsdp, _full_params, _run, _run_ours


def _reduce_by_hand(model: nn.Module) -> None:
    """Galvatron's fsdp_reduce_gradients, in torch's names."""
    fsdp = _fsdp()
    runtime_utils = importlib.import_module("torch.distributed.fsdp._runtime_utils")
    common_utils = importlib.import_module("torch.distributed.fsdp._common_utils")
    backward_pre = importlib.import_module("torch.distributed.fsdp._flat_param").HandleTrainingState.BACKWARD_PRE
    for m in model.modules():
        if not isinstance(m, fsdp.FullyShardedDataParallel):
            continue
        m.training_state = common_utils.TrainingState.FORWARD_BACKWARD
        if hasattr(m, "_handles"):  # torch 2.0's form
            for handle in m._handles:
                handle._training_state = backward_pre
                runtime_utils._unshard(m, m._handles, m._streams["unshard"], m._streams["pre_unshard"])
                runtime_utils._post_backward_hook(m, handle, None)
        elif m._handle is not None:
            m._handle._training_state = backward_pre
            runtime_utils._unshard(m, m._handle, m._unshard_stream, m._pre_unshard_stream)
            runtime_utils._post_backward_hook(m, m._handle, None)
    for m in model.modules():
        if isinstance(m, fsdp.FullyShardedDataParallel) and m._is_root:
            runtime_utils._post_backward_final_callback(m, m)


def _train(strategy: str, uop: bool, by_hand: bool) -> dict[str, Any]:
    fsdp = _fsdp()
    torch.manual_seed(0)
    model = _FSDP(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)),
        auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Linear}),
        sharding_strategy=getattr(fsdp.ShardingStrategy, strategy),
        use_orig_params=uop,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        batches = [torch.randn(4, 8, generator=generator) for _ in range(2)]
        if by_hand:
            with model.no_sync():
                for batch in batches:
                    loss = model(batch).square().mean()
                    loss.backward()
                    losses.append(loss.item())
            _reduce_by_hand(model)
        else:
            for batch in batches:
                loss = model(batch).square().mean()
                loss.backward()
                losses.append(loss.item())
        optim.step()
        optim.zero_grad()
    return {"losses": losses, "params": _full_params(model)}


def _both(strategy: str, uop: bool) -> dict[str, Any]:
    return {"by_hand": _train(strategy, uop, True), "accumulated": _train(strategy, uop, False)}


def _same_training(observed: dict[str, Any]) -> None:
    by_hand, accumulated = observed["by_hand"], observed["accumulated"]
    torch.testing.assert_close(by_hand["losses"], accumulated["losses"], rtol=1e-5, atol=1e-6)
    for name, values in accumulated["params"].items():
        torch.testing.assert_close(by_hand["params"][name], values, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_gradients_reduced_by_hand_after_no_sync_as_in_torch(strategy: str) -> None:
    for observed in _run(_both, strategy, False):
        _same_training(observed)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_gradients_reduced_by_hand_with_use_orig_params(strategy: str) -> None:
    """Beyond torch: its `_unshard` in BACKWARD_PRE raises AttributeError with use_orig_params=True (no forward
    tensors to reuse); ours reduces as plain accumulation does."""
    for observed in _run_ours(_both, strategy, True):
        _same_training(observed)
