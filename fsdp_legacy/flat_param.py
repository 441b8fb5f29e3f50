"""The flat parameter of one FSDP unit and its layout: which original parameters it holds, where, and with what padding.

The layout is torch FSDP1's, element for element, so that local shards (and LOCAL_STATE_DICT checkpoints) are
interchangeable with torch's:

* parameters in `named_modules(remove_duplicate=False)` order, each module's own parameters in registration order,
  a parameter reached twice (tied weights) stored once;
* with use_orig_params=True, padding before each parameter so it starts at a 16-byte boundary of the compute dtype,
  and padding after the last one so the total divides by the world size (both filled with 42.0, as torch does);
* the flat tensor is right-padded with zeros to `world_size * ceil(numel / world_size)` and rank r keeps chunk r;
* a parameter that is not row-major contiguous but dense (a transpose, a channels_last convolution weight) is held in
  its memory order and viewed with its strides, as torch holds it (`_contiguities`, `_strides`), so its layout in a
  local shard is torch's and its views keep their memory format.
"""

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .flat_param_metadata import TorchFlatParamMetadata
from .naming import join_fqn
from .tensor_parallel import local_tensor

# torch fills alignment padding with this value, which makes stray reads of padding easy to spot.
PADDING_VALUE = 42.0
ALIGNMENT_BYTES = 16


@dataclass(frozen=True)
class ParamRef:
    """One reference to a parameter as a unit's walk finds it (a tied parameter has several)."""

    module_name: str  # clean, relative to the unit's wrapped module
    module: nn.Module
    param_name: str
    param: nn.Parameter

    @property
    def fqn(self) -> str:
        return join_fqn(self.module_name, self.param_name)


@dataclass(frozen=True, eq=False)
class ParamInfo:
    """One original parameter stored in a flat parameter. Compared and hashed by identity: each is made once per
    parameter, and the runtime looks its views up by it several times per unit and step."""

    fqn: str  # relative to the unit's wrapped module
    module: nn.Module  # the module that owns it
    module_name: str
    param_name: str
    shape: torch.Size
    offset: int  # first element in the unsharded flat parameter
    stride: tuple[int, ...] | None = None  # held in memory order with these strides (None: row-major)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameter as a view of its `numel` elements at the start of `flat`."""
        return view_flat(flat, self.shape, self.stride)

    def view_in(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameter as a view of its elements in a whole (unsharded) flat tensor, from its offset."""
        return self.view_of(flat[self.offset : self.offset + self.numel])

    def flatten(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (a value of the parameter's shape) as its elements lie in the flat parameter."""
        return flatten_in_order(tensor, self.stride)


@dataclass(frozen=True)
class SharedParamInfo:
    """A later reference to a parameter already stored (tied weights): the view is shared, the storage is not."""

    module: nn.Module
    module_name: str
    param_name: str
    primary: ParamInfo


@dataclass(frozen=True)
class ShardPiece:
    """The part of one original parameter that lies in this rank's shard."""

    info: ParamInfo
    offset_in_shard: int
    numel_in_shard: int
    start_in_param: int  # first element of the piece within the flattened parameter


@dataclass(frozen=True)
class FlatParamLayout:
    params: tuple[ParamInfo, ...]
    shared: tuple[SharedParamInfo, ...]
    segments: tuple[tuple[int, bool], ...]  # (numel, is_padding) covering [0, numel) in order
    numel: int  # unsharded numel, alignment padding included, world padding not
    world_size: int
    aligned_numel: int = 0  # parameters start at multiples of this (0: no alignment padding)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_pieces(self, rank: int) -> tuple[ShardPiece, ...]:
        """The pieces of original parameters that rank `rank`'s shard holds, in flat order."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        pieces = []
        for info in self.params:
            start, end = max(lo, info.offset), min(hi, info.offset + info.numel)
            if start < end:
                pieces.append(ShardPiece(info, start - lo, end - start, start - info.offset))
        return tuple(pieces)


class FlatParameter(TorchFlatParamMetadata, nn.Parameter):
    """The parameter the optimizer sees for one FSDP unit: the local shard of the concatenated original parameters.

    Its `.data` is the local shard outside forward/backward and the whole unsharded flat tensor inside them. torch's
    metadata attributes (`_fqns`, `_shard_param_infos`, ...) come from flat_param_metadata.py."""

    _is_flat_param = True  # torch's marker, kept for code that tests for it
    _fsdp_flattened = True  # torch's `_is_fsdp_flattened(tensor)` reads it (Lightning finds FSDP params by it)
    flat_layout: FlatParamLayout
    _local_shard: torch.Tensor  # torch's name for the local shard (set by the handle)
    _handle_ref: Callable[[], Any]  # the handle (weakly: the handle holds the flat parameter)

    @classmethod
    def create(cls, data: torch.Tensor, layout: FlatParamLayout, requires_grad: bool) -> "FlatParameter":
        flat = cls(data, requires_grad=requires_grad)
        flat.flat_layout = layout
        return flat

    def _metadata_source(self) -> Any:
        return self._handle_ref()


def iter_unit_modules(root: nn.Module, is_boundary: Callable[[nn.Module], bool]) -> Iterator[tuple[str, nn.Module]]:
    """Pre-order (clean name, module) pairs below `root`, duplicates kept, not descending into boundary modules."""
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        name, module = stack.pop()
        yield name, module
        children = [
            (join_fqn(name, child_name), child)
            for child_name, child in module._modules.items()
            if child is not None and not is_boundary(child)
        ]
        stack.extend(reversed(children))


def plan_segments(
    numels: Sequence[int], aligned_numel: int, world_size: int
) -> tuple[tuple[int, ...], tuple[tuple[int, bool], ...], int]:
    """(offset of each parameter, (numel, is_padding) segments, total numel) of a flat parameter holding parameters of
    these sizes in this order: torch's rules, also used offline to re-plan a layout for another world size.

    `aligned_numel` is 0 for no alignment (use_orig_params=False), else 16 bytes / itemsize of the compute dtype."""
    offsets: list[int] = []
    segments: list[tuple[int, bool]] = []
    total = 0

    def pad(multiple: int) -> None:
        nonlocal total
        gap = -total % multiple
        if gap:
            segments.append((gap, True))
            total += gap

    for numel in numels:
        if aligned_numel and total:
            pad(aligned_numel)
        offsets.append(total)
        segments.append((numel, False))
        total += numel
    if aligned_numel:
        pad(world_size)
    return tuple(offsets), tuple(segments), total


def build_layout(references: Sequence[ParamRef], world_size: int, aligned_numel: int) -> FlatParamLayout:
    """Lay out the referenced parameters, given in nn.Module order, the way torch FSDP1 does (see `plan_segments`);
    a parameter referenced again (tied weights) is stored at its first reference."""
    found: list[ParamRef] = []
    shared: list[ParamRef] = []
    seen: set[nn.Parameter] = set()
    for ref in references:
        if ref.param in seen:
            shared.append(ref)
        else:
            seen.add(ref.param)
            found.append(ref)
    # A DTensor parameter contributes its local piece (tensor_parallel.py).
    offsets, segments, total = plan_segments(
        [local_tensor(ref.param).numel() for ref in found], aligned_numel, world_size
    )
    params: dict[nn.Parameter, ParamInfo] = {}
    for ref, offset in zip(found, offsets, strict=True):
        tensor = local_tensor(ref.param)
        params[ref.param] = ParamInfo(
            ref.fqn, ref.module, ref.module_name, ref.param_name, tensor.shape, offset, memory_order_strides(tensor)
        )
    return FlatParamLayout(
        tuple(params.values()),
        tuple(SharedParamInfo(ref.module, ref.module_name, ref.param_name, params[ref.param]) for ref in shared),
        segments,
        total,
        world_size,
        aligned_numel,
    )


def flatten(
    layout: FlatParamLayout,
    tensors: dict[ParamInfo, torch.Tensor],
    device,
    dtype,
    start: int = 0,
    end: int | None = None,
) -> torch.Tensor:
    """Concatenate the original parameters into one padded flat tensor of `layout.padded_numel` elements, or only its
    elements [start, end) (one rank's shard: the whole tensor is never made, so wrapping a unit holds its original
    parameters and this rank's shard, not a second copy of the unit)."""
    end = layout.padded_numel if end is None else end
    flat = torch.empty(end - start, device=device, dtype=dtype)
    flat[max(layout.numel, start) - start :].zero_()  # world padding is zeros, alignment padding is PADDING_VALUE
    info_at = {info.offset: info for info in layout.params}
    offset = 0
    for numel, is_padding in layout.segments:
        lo, hi = max(offset, start), min(offset + numel, end)
        if lo < hi:
            target = flat[lo - start : hi - start]
            if is_padding:
                target.fill_(PADDING_VALUE)
            else:
                info = info_at[offset]
                target.copy_(info.flatten(tensors[info])[lo - offset : hi - offset])
        offset += numel
    return flat


def aligned_numel_for(dtype: torch.dtype) -> int:
    return ALIGNMENT_BYTES // torch.empty((), dtype=dtype).element_size()


def memory_order_strides(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The strides a parameter is held with in memory order: None for a row-major contiguous one (torch's "truly
    contiguous": also the last stride 1, which a tensor of size-1 dimensions can lack), else its own, when it covers
    its storage without gaps or overlaps (a transpose, channels_last). A parameter with gaps (a slice of a larger
    tensor) is held in row-major order, since memory order would take in elements that are not its own."""
    if tensor.dim() == 0 or (tensor.is_contiguous() and tensor.stride(-1) == 1):
        return None
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return tuple(tensor.stride())


def view_flat(flat: torch.Tensor, shape: Sequence[int], stride: Sequence[int] | None) -> torch.Tensor:
    """A parameter of `shape` as a view of its elements at the start of the flat tensor `flat` (memory order with
    `stride`, or row-major when None)."""
    if stride is None:
        return flat.view(shape)
    return flat.as_strided(tuple(shape), tuple(stride))


def flatten_in_order(tensor: torch.Tensor, stride: Sequence[int] | None) -> torch.Tensor:
    """The elements of `tensor` (any memory format) in the order a parameter held with `stride` keeps them: 1-D."""
    if stride is None:
        return tensor.reshape(-1)
    if tuple(tensor.stride()) != tuple(stride):  # (equal strides: as dense as the parameter was)
        strided = torch.empty_strided(tensor.shape, tuple(stride), dtype=tensor.dtype, device=tensor.device)
        tensor = strided.copy_(tensor)
    return tensor.as_strided((tensor.numel(),), (1,))
