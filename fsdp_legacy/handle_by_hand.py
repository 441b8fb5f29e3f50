"""A FlatParamHandle built by hand, with torch FSDP1's constructor call, and torch's shard-metadata methods.

torch's own tests (test_fsdp_flatten_params) and code that flattens parameters without an FSDP unit call
`FlatParamHandle(params, fully_sharded_module, device, sharding_strategy, offload_params, mp_param_dtype,
mp_reduce_dtype, keep_low_precision_grads, process_group, use_orig_params)`, then `shard()`, and read
`_get_shard_metadata(first, last)` and `shard_metadata()`. Under the switch that class is ours, whose own constructor
takes a unit's parameter references and groups (FSDP's construction calls it so): the class's metaclass tells torch's
call from ours by its first argument (a module for ours, the parameters for torch's) and translates it.

A handle built by hand starts as torch's does, unsharded: its flat parameter holds all the listed parameters
flattened (no world-size padding unless use_orig_params aligns them), and the modules show views of it. `shard()`
then leaves it holding this rank's padded shard, as after FSDP's construction (which shards ours as it flattens: for
those `shard()` has nothing left to do). The flat parameter's data lives where the parameters do (torch's does too),
whatever compute device is named.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .flat_param import FlatParameter, FlatParamLayout, ParamRef, flatten
from .flat_param_metadata import FlatParamShardMetadata, _ShardParamInfo, shard_param_infos
from .handle_torch_names import HandleShardingStrategy
from .tensor_parallel import local_tensor

_Handle = TypeVar("_Handle")

# torch's strategy name -> (sharded, reshards after forward); a handle knows no replicate group (the unit does).
_STRATEGIES = {
    "FULL_SHARD": (True, True),
    "SHARD_GRAD_OP": (True, False),
    "NO_SHARD": (False, False),
    "HYBRID_SHARD": (True, True),
    "_HYBRID_SHARD_ZERO2": (True, False),
}


class TorchConstructorCall(type):
    """The metaclass of FlatParamHandle: a call with torch's arguments builds the handle by hand (`by_hand`); ours
    (a module first, as FSDP's construction passes it) goes straight to the constructor."""

    def __call__(cls: type[_Handle], *args: Any, **kwargs: Any) -> _Handle:
        if (args and isinstance(args[0], nn.Module)) or "references" in kwargs:
            return type.__call__(cls, *args, **kwargs)
        return by_hand(cls, *args, **kwargs)


def by_hand(
    cls: type[_Handle],
    params: Iterable[nn.Parameter | torch.Tensor],
    fully_sharded_module: nn.Module,
    device: torch.device,
    sharding_strategy: Any,
    offload_params: bool,
    mp_param_dtype: torch.dtype | None,
    mp_reduce_dtype: torch.dtype | None,
    keep_low_precision_grads: bool,
    process_group: dist.ProcessGroup,
    use_orig_params: bool,
    *,
    fsdp_extension: Any = None,
) -> _Handle:
    """torch's constructor call, translated into ours: the listed parameters in `fully_sharded_module`'s tree, in
    its module order (tied references once, as torch flattens them), on `process_group`. Left unsharded."""
    params = list(params)
    if not params:
        raise ValueError(f"Cannot construct a {cls.__name__} with an empty parameter list")
    if fsdp_extension is not None:
        raise NotImplementedError(
            "fsdp_legacy's FlatParamHandle takes no `fsdp_extension`: it flattens DTensor parameters itself"
        )
    name = getattr(sharding_strategy, "name", None)
    if name not in _STRATEGIES:
        raise ValueError(f"Unknown sharding strategy {sharding_strategy!r}")
    for param in params:
        if isinstance(param, FlatParameter):
            raise ValueError("Cannot flatten a `FlatParameter`")
        if not param.is_floating_point():
            raise ValueError("Cannot flatten integer dtype tensors")
    references = _references(params, fully_sharded_module)
    if not references:
        raise ValueError(f"`params` were not found in `module`'s tree: {len(params)} parameters")
    # Aliases of the parameters' data, which the constructor releases (or turns into views of the shard).
    data = {id(ref.param): local_tensor(ref.param).detach() for ref in references}
    sharded, reshard_after_forward = _STRATEGIES[name]
    where = data[id(references[0].param)].device
    handle: Any = type.__call__(
        cls,
        fully_sharded_module,
        references,
        process_group,
        sharded=sharded,
        reshard_after_forward=reshard_after_forward,
        use_orig_params=use_orig_params,
        device=where,
        param_dtype=mp_param_dtype,
        reduce_dtype=mp_reduce_dtype,
        offload_params=offload_params,
        keep_low_precision_grads=keep_low_precision_grads,
    )
    handle.compute_device = torch.device(device)
    handle._fully_sharded_module = fully_sharded_module
    handle._strategy_given = HandleShardingStrategy[name]
    layout: FlatParamLayout = handle.layout
    if sharded:
        by_place = {(id(ref.module), ref.param_name): ref.param for ref in references}
        tensors = {info: data[id(by_place[(id(info.module), info.param_name)])] for info in layout.params}
        unsharded = flatten(layout, tensors, where, handle.local_shard.dtype, 0, layout.numel)
    else:  # NO_SHARD's local shard is the whole flat parameter already
        unsharded = handle.local_shard
    del data
    handle._unsharded_as_built = unsharded
    handle.flat_param.data = unsharded
    handle.use_unsharded_views()
    return handle


def _references(params: list[Any], root: nn.Module) -> list[ParamRef]:
    """Every reference to one of `params` below `root`, in module order, duplicates kept (tied weights)."""
    wanted = {id(param) for param in params}
    return [
        ParamRef(module_name, module, param_name, param)
        for module_name, module in root.named_modules(remove_duplicate=False)
        for param_name, param in module._parameters.items()
        if param is not None and id(param) in wanted
    ]


class HandleByHand(metaclass=TorchConstructorCall):
    """torch's `shard()`, `_get_shard_metadata()` and `shard_metadata()` on FlatParamHandle (mixed in last)."""

    flat_param: FlatParameter
    layout: FlatParamLayout
    local_shard: torch.Tensor
    # A handle built by hand, until its `shard()`: the unsharded flat tensor its flat parameter holds (None after, and
    # for every handle FSDP builds).
    _unsharded_as_built: torch.Tensor | None = None

    def drop_unsharded_views(self) -> None:
        raise NotImplementedError  # (FlatParamHandle)

    @torch.no_grad()
    def shard(self) -> None:
        """A handle built by hand: from the unsharded flat parameter to this rank's padded shard, the modules showing
        the original parameters as after FSDP's construction. Nothing to do for a handle FSDP built (already
        sharded). The shard's metadata is computed again (`_shard_param_infos` assigned since is dropped)."""
        self.flat_param._assigned_shard_param_infos = None
        if self._unsharded_as_built is None:
            return
        self._unsharded_as_built = None
        self.flat_param.data = self.local_shard
        self.drop_unsharded_views()

    def _get_flat_param_offsets(self) -> list[tuple[int, int]]:
        """The first and last (inclusive) element of each segment of the unsharded flat parameter, alignment padding
        included."""
        offsets, start = [], 0
        for numel, _ in self.layout.segments:
            offsets.append((start, start + numel - 1))
            start += numel
        return offsets

    def _get_shard_metadata(self, unsharded_start_idx: int, unsharded_end_idx: int) -> tuple[_ShardParamInfo, ...]:
        """Where each original parameter lies in a shard holding the unsharded flat elements
        [unsharded_start_idx, unsharded_end_idx] (both included), one entry per parameter (torch's names)."""
        return shard_param_infos(self.layout, unsharded_start_idx, unsharded_end_idx)

    def shard_metadata(self) -> FlatParamShardMetadata:
        """The parameters the flat parameter's shard holds (as `_shard_param_infos` says, assigned or not): names,
        shapes, strides, contiguities, numels, and the first and last of their elements in it."""
        flat = self.flat_param
        rows = [
            (fqn, shape, stride, contiguous, numel, (info.intra_param_start_idx, info.intra_param_end_idx))
            for fqn, shape, stride, contiguous, numel, info in zip(
                flat._fqns,
                flat._shapes,
                flat._strides,
                flat._contiguities,
                flat._numels,
                flat._shard_param_infos,
                strict=False,  # (as torch's: assigned infos may be fewer)
            )
            if info.in_shard
        ]
        columns = tuple(zip(*rows, strict=True)) if rows else ((),) * 6
        return FlatParamShardMetadata(*(tuple(column) for column in columns))
