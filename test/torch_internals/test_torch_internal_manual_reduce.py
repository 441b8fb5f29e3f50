"""Gradients reduced by hand through FSDP1's private runtime helpers, as Galvatron's pipeline-parallel training does:
micro-batches accumulate under no_sync(), then for each unit `_runtime_utils._unshard(state, handle,
state._unshard_stream, state._pre_unshard_stream)` and a post-backward hook called by hand, then the root's
`_post_backward_final_callback(root, root)`. The hook is torch's `_post_backward_hook`, or (current Galvatron) the
code's own copy of it, which calls torch's pieces: `_post_backward_reshard`, `_reduce_grad` / `_reduce_grad_no_shard`,
`_low_precision_hook_enabled`, `_common_utils._log_post_backward_hook`, the handle's `_force_full_precision` and
`_reduce_dtype`, the unit's streams and device handle, and edits the unsharded gradient in place between them. On ours
next to torch's FSDP1 (through the switch, the very same code, which takes torch 2.0's `_handles` / `_streams` where it
finds them, as Galvatron's does), and against the oracle of plain accumulation (each micro-batch's backward reduced as
usual)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from torch_side_by_side import _FSDP, _fsdp, _full_params, _run, _run_ours


def _runtime_utils() -> Any:
    return importlib.import_module("torch.distributed.fsdp._runtime_utils")


def _handle_states() -> Any:
    return importlib.import_module("torch.distributed.fsdp._flat_param").HandleTrainingState


def _own_post_backward_hook(state: Any, handle: Any, edit: Callable[[torch.Tensor], None] | None) -> None:
    """A post-backward hook of the code's own, built from torch's pieces in torch's order as Galvatron's
    `_post_backward_hook_sp` is; `edit` stands for its sequence-parallel step, which changes slices of the unsharded
    gradient in place before the reduction."""
    runtime_utils = _runtime_utils()
    common_utils = importlib.import_module("torch.distributed.fsdp._common_utils")
    states = _handle_states()
    flat_param = handle.flat_param
    common_utils._log_post_backward_hook(state, handle, logging.getLogger(__name__))
    flat_param._post_backward_called = True
    common_utils._assert_in_training_states(state, [common_utils.TrainingState.FORWARD_BACKWARD])
    assert handle._training_state in (states.BACKWARD_PRE, states.BACKWARD_POST), handle._training_state
    handle._training_state = states.BACKWARD_POST
    if flat_param.grad is None:
        return
    runtime_utils._post_backward_reshard(state, handle)
    assert state._sync_gradients
    state._post_backward_stream.wait_stream(state._device_handle.current_stream())
    with state._device_handle.stream(state._post_backward_stream):
        computed = flat_param.grad.data
        cast = flat_param.grad.dtype != handle._reduce_dtype and not handle._force_full_precision
        if cast and not runtime_utils._low_precision_hook_enabled(state):
            flat_param.grad.data = flat_param.grad.to(handle._reduce_dtype)
        if edit is not None:
            edit(flat_param.grad.data)
        if handle.uses_sharded_strategy:
            runtime_utils._reduce_grad(state, handle)
        else:
            runtime_utils._reduce_grad_no_shard(state, handle)
        common_utils._no_dispatch_record_stream(computed, state._post_backward_stream)


def _double_the_first_elements(grad: torch.Tensor) -> None:
    grad[:5].mul_(2.0)


def _reduce_by_hand(model: nn.Module, own_hook: bool = False, edit: Callable | None = None) -> None:
    """Galvatron's fsdp_reduce_gradients, in torch's names."""
    fsdp = _fsdp()
    runtime_utils = _runtime_utils()
    hook = runtime_utils._post_backward_hook
    if own_hook:

        def hook(state: Any, handle: Any, _: Any) -> None:
            _own_post_backward_hook(state, handle, edit)

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
                hook(m, handle, None)
        elif m._handle is not None:
            m._handle._training_state = backward_pre
            runtime_utils._unshard(m, m._handle, m._unshard_stream, m._pre_unshard_stream)
            hook(m, m._handle, None)
    for m in model.modules():
        if isinstance(m, fsdp.FullyShardedDataParallel) and m._is_root:
            runtime_utils._post_backward_final_callback(m, m)


def _train(
    strategy: str, uop: bool, by_hand: bool, own_hook: bool = False, edit: Callable | None = None, bf16: bool = False
) -> dict[str, Any]:
    fsdp = _fsdp()
    torch.manual_seed(0)
    model = _FSDP(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)),
        auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Linear}),
        sharding_strategy=getattr(fsdp.ShardingStrategy, strategy),
        use_orig_params=uop,
        mixed_precision=fsdp.MixedPrecision(reduce_dtype=torch.bfloat16) if bf16 else None,
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
            _reduce_by_hand(model, own_hook, edit)
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


def _own_hook_cases(strategy: str, bf16: bool) -> dict[str, Any]:
    return {
        "own_hook": _train(strategy, False, True, own_hook=True, bf16=bf16),
        "torch_hook": _train(strategy, False, True, bf16=bf16),
        "accumulated": _train(strategy, False, False, bf16=bf16),
        "edited": _train(strategy, False, True, own_hook=True, edit=_double_the_first_elements, bf16=bf16),
    }


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16_reduce"])
def test_the_codes_own_post_backward_hook_reduces_as_torch(strategy: str, bf16: bool) -> None:
    """Galvatron's own copy of the hook (torch's pieces in torch's order, an in-place edit of the unsharded gradient
    between them, a cast to the reduce dtype): the same training as torch's FSDP1, equal to its own hook's and, without
    the edit, to plain accumulation; the edit changes the training, on both alike."""
    for observed in _run(_own_hook_cases, strategy, bf16):
        _same_training({"by_hand": observed["own_hook"], "accumulated": observed["torch_hook"]})
        if not bf16:  # (a bf16 reduction of the summed micro-batches rounds otherwise than two of them)
            _same_training({"by_hand": observed["own_hook"], "accumulated": observed["accumulated"]})
        assert observed["edited"]["params"] != observed["own_hook"]["params"]


def _own_hook_with_use_orig_params() -> str:
    try:
        _train("FULL_SHARD", True, True, own_hook=True)
    except RuntimeError as error:
        return str(error)
    return "trained"


def test_the_codes_own_hook_with_use_orig_params_is_refused_not_lost() -> None:
    """torch's `_unshard` raises here (AttributeError with use_orig_params=True); ours shows no unsharded gradient on
    the flat parameter, so such a hook finds none to reduce: the final callback says so on every rank, rather than
    training on gradients nothing reduced."""
    for message in _run_ours(_own_hook_with_use_orig_params):
        assert "no_sync() accumulated and nothing reduced" in message, message
        assert "_post_backward_hook" in message


def _own_hook_after_a_synchronised_backward() -> str:
    fsdp = _fsdp()
    model = _FSDP(
        nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)), auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Linear})
    )
    model(torch.randn(4, 8)).sum().backward()  # reduced already: `flat_param.grad` is this rank's shard
    try:
        _reduce_by_hand(model, own_hook=True)
    except RuntimeError as error:
        return str(error)
    return "reduced again"


def test_reducing_an_already_reduced_gradient_is_refused() -> None:
    """torch's `_reduce_grad` would reduce-scatter the shard as if it were the whole gradient; ours names the misuse."""
    for message in _run_ours(_own_hook_after_a_synchronised_backward):
        assert "only after backwards run under no_sync()" in message, message
