"""torch FSDP1's module-level helpers that code imports from torch's private FSDP1 files, for fsdp_legacy's units and
handles. The switch (compat.py) puts each under torch's name; called with anything that is not ours (torch's FSDP1,
FSDP2, a plain module), a helper answers NOT_OURS and the switch calls torch's own instead.

    _runtime_utils._lazy_init(state, root_module)          set up the root (verl, trainers' clip_grad_norm_)
    _runtime_utils._unshard(state, handle, stream, stream) gather one unit's parameters outside forward
    _runtime_utils._reshard(state, handle, free)           reshard it again (DINOv2, audiocraft, EMA swaps)
    _runtime_utils._post_backward_hook(state, handle, ...) reduce a unit's gradient by hand (Galvatron, after no_sync)
    _runtime_utils._post_backward_final_callback(state, m) and end that backward: reductions done, units resharded
    _runtime_utils._register_pre_backward_hooks(...)       the runtime's steps, which it calls through torch's names
    _runtime_utils._register_post_backward_hook(s, handle) when code wraps them (runtime_names.py), and
    _runtime_utils._post_backward_reshard(state, handle)   the pieces of torch's hook, for code that runs its own copy
    _runtime_utils._reduce_grad / _reduce_grad_no_shard    of it (Galvatron): reshard, then reduce `flat_param.grad`
    _runtime_utils._low_precision_hook_enabled(state)      whether the unit's comm hook reduces in fp16 / bf16
    _traversal_utils._get_fsdp_states / _get_fsdp_handles  the units / handles of a model (EMA updates, grad norms)
    _common_utils._get_module_fsdp_state(...)              a module's FSDP state: the unit itself, as torch's wrapper
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.distributed.algorithms._comm_hooks import default_hooks

from .fully_sharded_data_parallel import FullyShardedDataParallel
from .handle import FlatParamHandle
from .runtime import Runtime
from .unit import FSDPUnit, fsdp_modules


class _NotOurs:
    """What a helper answers for objects that are not fsdp_legacy's (torch's own helper then answers)."""

    def __repr__(self) -> str:
        return "NOT_OURS"


NOT_OURS: Any = _NotOurs()


def _get_module_fsdp_state(module: nn.Module) -> Any:
    """The FSDP state of `module`: a unit is its own state, as torch's wrapper is."""
    return module if isinstance(module, FSDPUnit) else NOT_OURS


def _get_module_fsdp_state_if_fully_sharded_module(module: nn.Module) -> Any:
    return _get_module_fsdp_state(module)


def _lazy_init(state: Any, root_module: nn.Module) -> Any:
    """Make `state` the root of the units below it, once. As torch's: returns the state when it initialised it, None
    when it was initialised already (`_is_root` set)."""
    if not isinstance(state, FullyShardedDataParallel):
        return NOT_OURS
    if state._is_root is not None:
        return None
    state._lazy_init()
    return state


def _unshard(state: Any, handle: Any, unshard_stream: Any = None, pre_unshard_stream: Any = None) -> Any:
    """Gather the handle's flat parameter and show the unit's parameters full until `_reshard` (handle_torch_names.py
    says how). torch before 2.1 took a list of handles; our units list theirs in `_handles`, which such code reads."""
    handles = _ours(state, handle)
    if handles is None:
        return NOT_OURS
    for one in handles:
        one.pre_unshard()
        one.unshard()
        one.post_unshard()
    return None


def _reshard(state: Any, handle: Any, free_unsharded_flat_param: bool | Sequence[bool]) -> Any:
    """Back to the shard; the gathered storage is freed if `free_unsharded_flat_param` (else it is gathered afresh at
    the next unshard, where torch's reuses it). torch before 2.1 took lists of handles and of flags."""
    handles = _ours(state, handle)
    if handles is None:
        return NOT_OURS
    flags = free_unsharded_flat_param
    frees = flags if isinstance(flags, Sequence) else [flags]
    for one, free in zip(handles, frees, strict=True):
        one.reshard(bool(free))
        one.post_reshard()
    return None


def _get_fsdp_states(module: nn.Module) -> Any:
    """The units in `module`'s tree, itself included, in pre-order (torch's traversal order)."""
    return fsdp_modules(module) if _has_units(module) else NOT_OURS


def _get_fsdp_handles(module: nn.Module) -> Any:
    """Every handle of every unit in `module`'s tree, in pre-order: a unit mixing dtypes has one per dtype (torch's
    units have one), so code walking them meets every flat parameter, as `FSDP._all_handles` lists them."""
    if not _has_units(module):
        return NOT_OURS
    return [handle for unit in fsdp_modules(module) for handle in unit._handles]


def _has_units(module: nn.Module) -> bool:
    return isinstance(module, nn.Module) and any(isinstance(m, FSDPUnit) for m in module.modules())


def _ours(state: Any, handle: Any) -> list[FlatParamHandle] | None:
    """`handle` (or torch 2.0's list of handles, empty for a unit without parameters) as a list of our handles, or
    None when it is not ours."""
    if isinstance(handle, (list, tuple)):
        handles = list(handle)
        if isinstance(state, FSDPUnit) and all(isinstance(one, FlatParamHandle) for one in handles):
            return handles
        return None
    return [handle] if isinstance(handle, FlatParamHandle) else None


def _by_hand(state: Any, handle: Any, step: Callable[[Runtime, FlatParamHandle], None]) -> Any:
    """One step of torch's post-backward work, run by code outside a backward, on each of our handles given."""
    handles = _ours(state, handle)
    if handles is None:
        return NOT_OURS
    runtime = state._lazy_init()
    for one in handles:
        step(runtime, one)
    return None


def _post_backward_hook(state: Any, handle: Any, flat_param: Any = None, *unused: Any) -> Any:
    """Reduce the unit's unsharded gradient (what no_sync() accumulated, or this backward's) into its sharded one,
    as torch's hook does when code calls it by hand after gathering the unit with `_unshard`."""
    return _by_hand(state, handle, lambda runtime, one: runtime.post_backward_by_hand(state, one))


def _post_backward_final_callback(state: Any, module: nn.Module) -> Any:
    """End the backward that `_post_backward_hook` calls made by hand: every reduction completes, every unit of the
    root's tree reshards and goes back to idle."""
    if not isinstance(state, FullyShardedDataParallel):
        return NOT_OURS
    state._lazy_init().end_backward_by_hand()
    return None


def _post_backward_reshard(state: Any, handle: Any, *unused: Any) -> Any:
    """Reshard a unit whose gradient is complete, leaving the unsharded gradient on the flat parameter for the
    `_reduce_grad` that follows (the order of torch's post-backward hook, which Galvatron copies)."""
    return _by_hand(state, handle, lambda runtime, one: runtime.reshard_after_backward(one))


def _register_pre_backward_hooks(state: Any, module: nn.Module, outputs: Any, handle: Any) -> Any:
    """The unit's pre-backward hooks on the forward outputs that require grad; returns the outputs. The runtime calls
    it through torch's name when code has wrapped that (runtime_names.py)."""
    if not isinstance(state, FullyShardedDataParallel):
        return NOT_OURS
    return state._lazy_init().register_pre_backward_hooks(state, outputs)


def _register_post_backward_hook(state: Any, handle: Any) -> Any:
    """The hook that reduces the handle's gradient once it has accumulated (once: ours stays registered across
    forwards, where torch's re-registers it each forward). Called through torch's name like the one above."""
    if not isinstance(state, FullyShardedDataParallel) or not (handle is None or isinstance(handle, FlatParamHandle)):
        return NOT_OURS
    if handle is not None:
        state._hook_post_backward(handle)
    return None


def _reduce_grad(state: Any, handle: Any) -> Any:
    """Reduce the unsharded gradient the flat parameter holds (what no_sync() accumulated, as the calling code left it:
    changed in place, or cast to the reduce dtype) into the unit's sharded gradient; the final callback completes it."""
    return _by_hand(state, handle, lambda runtime, one: runtime.reduce_by_hand(one))


def _reduce_grad_no_shard(state: Any, handle: Any) -> Any:
    """torch's NO_SHARD twin of `_reduce_grad` (all-reduce); ours tells the two apart by the handle."""
    return _reduce_grad(state, handle)


_LOW_PRECISION_HOOKS = (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook)


def _low_precision_hook_enabled(state: Any) -> Any:
    """Whether the unit's registered communication hook is torch's fp16 or bf16 compression, which casts by itself."""
    if not isinstance(state, FSDPUnit):
        return NOT_OURS
    return state._comm_hook in _LOW_PRECISION_HOOKS
