"""torch FSDP1's metadata attributes of a FlatParameter, read from our layout: code written against torch's FSDP1
reads them (checkpointers copy a full tensor into the local shard through `_shard_param_infos`, compare a saved
`_fqns` list, walk `_params`), and torch's own tests do.

Names, types and values are torch's for the same model: lists where torch keeps lists (`_fqns`, `_shapes`, ...),
tuples where it keeps tuples, and its record types by its names (`ParamInfo`, `SharedParamInfo`, `_ShardParamInfo`:
named tuples, defined here; our own layout records are the dataclasses of flat_param.py). They are computed on each
read from the layout and the handle, so they can never disagree with what the runtime does.
"""

from typing import Any, NamedTuple

import torch
from torch import nn

from .storage import freed_tensor


class ParamInfo(NamedTuple):
    param_name: str
    module: nn.Module
    module_name: str


class SharedParamInfo(NamedTuple):
    param_name: str
    module: nn.Module
    module_name: str
    prim_param_name: str
    prim_module: nn.Module
    prim_module_name: str


class _ShardParamInfo(NamedTuple):
    in_shard: bool
    offset_in_shard: int | None
    numel_in_shard: int | None
    intra_param_start_idx: int | None
    intra_param_end_idx: int | None  # inclusive


_NOT_IN_SHARD = _ShardParamInfo(False, None, None, None, None)


class FlatParamShardMetadata(NamedTuple):
    """What one shard of a flat parameter holds of each original parameter that reaches into it (torch's record,
    `FlatParamHandle.shard_metadata()`): names, shapes, strides, contiguities and numels of those parameters, and the
    first and last (inclusive) of each one's flattened elements in the shard."""

    param_names: tuple[str, ...]
    param_shapes: tuple[torch.Size, ...]
    param_strides: tuple[tuple[int, ...], ...]
    param_contiguities: tuple[bool, ...]
    param_numels: tuple[int, ...]
    param_offsets: tuple[tuple[int, int], ...]


def shard_param_infos(layout: Any, first: int, last: int) -> tuple[_ShardParamInfo, ...]:
    """Where each original parameter of `layout` lies in the shard that holds the unsharded flat elements
    [first, last] (both included), by torch's rules: a parameter is in the shard when its elements [offset,
    offset + numel - 1] meet that interval (so a parameter without elements only when the interval reaches across its
    offset), and then its `offset_in_shard`, its `numel_in_shard` and the first and last of its own elements there."""
    infos = []
    for info in layout.params:
        start, end = info.offset, info.offset + info.numel - 1
        if first > end or last < start:
            infos.append(_NOT_IN_SHARD)
            continue
        lo, hi = max(first, start), min(last, end)
        if lo > last:  # (an interval that ends before it starts, yet meets a parameter: torch's assertion)
            raise AssertionError(
                f"Invalid `offset_in_shard` of {lo - first} for sharded flat parameter with {last - first + 1} numel"
            )
        infos.append(_ShardParamInfo(True, lo - first, hi - lo + 1, lo - start, hi - start))
    return tuple(infos)


class TorchFlatParamMetadata:
    """Mixed into FlatParameter: the metadata torch's FSDP1 sets on its flat parameters, as read-only properties.

    `flat_layout` is the layout (flat_param.py); `_metadata_source()` the handle's facts a property needs (whether
    the flat parameter is sharded, this rank, the original parameters), see FlatParamHandle."""

    flat_layout: Any
    dtype: torch.dtype
    _freed_mp_shard: torch.Tensor | None = None  # what `_mp_shard` shows, made at its first read
    # `_shard_param_infos` as code assigned it (torch's tests set it from `_get_shard_metadata`), until the handle's
    # `shard()`: what `shard_metadata()` then reads.
    _assigned_shard_param_infos: tuple[_ShardParamInfo, ...] | None = None

    def _metadata_source(self) -> Any:
        raise NotImplementedError

    @property
    def _num_params(self) -> int:
        return len(self.flat_layout.params)

    @property
    def _param_infos(self) -> list[ParamInfo]:
        return [ParamInfo(i.param_name, i.module, i.module_name) for i in self.flat_layout.params]

    @property
    def _shared_param_infos(self) -> tuple[SharedParamInfo, ...]:
        return tuple(
            SharedParamInfo(
                s.param_name, s.module, s.module_name, s.primary.param_name, s.primary.module, s.primary.module_name
            )
            for s in self.flat_layout.shared
        )

    @property
    def _fqns(self) -> list[str]:
        return [info.fqn for info in self.flat_layout.params]

    @property
    def _shapes(self) -> list[torch.Size]:
        return [info.shape for info in self.flat_layout.params]

    @property
    def _strides(self) -> list[tuple[int, ...]]:
        """A parameter held in memory order (a transpose, channels_last) has its own strides, as in torch; one held
        row-major has contiguous strides (also a parameter with gaps, which torch would read past: flat_param.py)."""
        return [info.stride or _contiguous_strides(info.shape) for info in self.flat_layout.params]

    @property
    def _contiguities(self) -> list[bool]:
        return [info.stride is None for info in self.flat_layout.params]

    @property
    def _numels(self) -> tuple[int, ...]:
        return tuple(info.numel for info in self.flat_layout.params)

    @property
    def _numels_with_padding(self) -> tuple[int, ...]:
        return tuple(numel for numel, _ in self.flat_layout.segments)

    @property
    def _is_padding_mask(self) -> list[bool]:
        return [is_padding for _, is_padding in self.flat_layout.segments]

    @property
    def _param_extensions(self) -> list[Any]:
        """torch keeps a DTensor parameter's spec here (what turns the local view back into the DTensor)."""
        dtensors = self._metadata_source().dtensors
        params = self.flat_layout.params
        return [_dtensor_spec(dtensors[info], self.dtype) if info in dtensors else None for info in params]

    @property
    def _modules(self) -> set[nn.Module]:
        layout = self.flat_layout
        return {info.module for info in layout.params} | {shared.module for shared in layout.shared}

    @property
    def _unpadded_unsharded_size(self) -> torch.Size:
        return torch.Size([self.flat_layout.numel])

    @property
    def _padded_unsharded_size(self) -> torch.Size:
        layout = self.flat_layout
        return torch.Size([layout.padded_numel if self._metadata_source().sharded else layout.numel])

    @property
    def _sharded_size(self) -> torch.Size:
        layout = self.flat_layout
        return torch.Size([layout.shard_numel if self._metadata_source().sharded else layout.numel])

    @property
    def _shard_numel_padded(self) -> int:
        """The zeros that pad this rank's shard to the shard size (none with use_orig_params=True, whose alignment
        padding makes the flat parameter divide evenly)."""
        layout, handle = self.flat_layout, self._metadata_source()
        if not handle.sharded:
            return 0
        start = handle.rank * layout.shard_numel
        return layout.shard_numel - max(0, min(layout.numel - start, layout.shard_numel))

    @property
    def _shard_param_infos(self) -> tuple[_ShardParamInfo, ...]:
        if self._assigned_shard_param_infos is not None:
            return self._assigned_shard_param_infos
        layout, handle = self.flat_layout, self._metadata_source()
        if not handle.sharded:  # the whole flat parameter is the rank's
            return shard_param_infos(layout, 0, layout.numel - 1)
        n = layout.shard_numel
        return shard_param_infos(layout, handle.rank * n, (handle.rank + 1) * n - 1)

    @_shard_param_infos.setter
    def _shard_param_infos(self, infos: tuple[_ShardParamInfo, ...]) -> None:
        self._assigned_shard_param_infos = tuple(infos)

    # ----------------------------------------------------------------------------------------------------------------
    # use_orig_params=True's lists of original parameters (None otherwise, as torch)

    @property
    def _params(self) -> list[nn.Parameter] | None:
        handle = self._metadata_source()
        return [handle.orig_params[info] for info in self.flat_layout.params] if handle.use_orig_params else None

    @property
    def _shared_params(self) -> list[nn.Parameter] | None:
        handle = self._metadata_source()
        if not handle.use_orig_params:
            return None
        return [handle.orig_params[shared.primary] for shared in self.flat_layout.shared]

    @property
    def _tensors(self) -> list[torch.Tensor | None] | None:
        """The views of the unsharded flat parameter the last forward used, until the unit reshards (torch keeps views
        of the freed storage after that; ours lets go of them)."""
        handle = self._metadata_source()
        if not handle.use_orig_params:
            return None
        return [handle.forward_views.get(info) for info in self.flat_layout.params]

    @property
    def _is_grad_none_mask(self) -> list[bool] | None:
        return [False] * len(self.flat_layout.params) if self._metadata_source().use_orig_params else None

    # ----------------------------------------------------------------------------------------------------------------
    # Runtime tensors, where torch has them: the unsharded buffers of sharded strategies, mixed precision's shard

    @property
    def _full_param_padded(self) -> torch.Tensor:
        """The unsharded flat parameter in the compute dtype (storage freed while sharded); NO_SHARD has none."""
        handle = self._metadata_source()
        if not handle.sharded:
            raise AttributeError("_full_param_padded")
        return handle.unsharded_buffer(handle.compute_dtype)

    @property
    def _full_prec_full_param_padded(self) -> torch.Tensor:
        """Mixed precision: the unsharded flat parameter in full precision (summon_full_params, full-precision eval)."""
        handle = self._metadata_source()
        if not (handle.sharded and handle.mixed):
            raise AttributeError("_full_prec_full_param_padded")
        return handle.unsharded_buffer(handle.local_shard.dtype)

    @property
    def _mp_shard(self) -> torch.Tensor:
        """Mixed precision: the local shard in the compute dtype, which torch all-gathers from and frees at once (ours
        casts into the gather's input): its storage freed."""
        handle = self._metadata_source()
        if not handle.mixed:
            raise AttributeError("_mp_shard")
        if self._freed_mp_shard is None:  # (one tensor, as torch's, whatever the number of reads)
            self._freed_mp_shard = freed_tensor(handle.local_shard.numel(), handle.compute_dtype, handle.compute_device)
        return self._freed_mp_shard

    @property
    def _cpu_grad(self) -> torch.Tensor:
        """CPU offload: the sharded gradient on the CPU, the flat parameter's `.grad` after backward (zeros before
        one). With use_orig_params=True ours keeps the gradients on the original parameters: this is a copy."""
        handle = self._metadata_source()
        if not handle.offload:
            raise AttributeError("_cpu_grad")
        grad = handle.local_sharded_grad()
        return grad if grad is not None else torch.zeros_like(handle.local_shard)


def _dtensor_spec(record: Any, dtype: torch.dtype) -> Any:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    return DTensorSpec(record.mesh, record.placements, tensor_meta=TensorMeta(record.shape, record.stride, dtype))


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
