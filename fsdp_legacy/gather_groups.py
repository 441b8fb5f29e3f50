"""One all-gather for several consecutive small units.

Each collective has a fixed cost besides its bytes (on gloo a round trip through its threads and the network stack,
on NCCL a kernel launch and a synchronisation), so a model of many small units is bound by the number of its
collectives. When the runtime must all-gather a unit, the units expected to need theirs right after it join the same
collective, as long as their unsharded parameters together stay within a byte budget:

- in forward, the units that followed it in the previous iteration's forward (what forward prefetch reads);
- in backward, the units that preceded it in this iteration's forward and still have their backward to come.

A group stops at the first unit that cannot join (resharded after forward under another process group or dtype,
already unsharded, several flat parameters); a unit alone over the budget is gathered alone, as before.

The budget: `FSDP_LEGACY_GATHER_BUCKET_MB` in the environment (MiB of unsharded parameters, in the dtype they are
gathered in; read at the root's first forward), default `DEFAULT_BUCKET_MB`; 0 gathers every unit on its own.
Memory: the units of a group are unsharded together, so at most the budget is held ahead of what one unit at a time
holds, plus, while the collective is in flight, one buffer of the same size that receives it and is copied into each
unit's own unsharded buffer (they stay separate: each unit frees its storage when it reshards). The values gathered
are the same bytes, so numerics do not change.
"""

import os
from collections.abc import Iterable, Iterator, Sequence

import torch

from . import _collectives as comm
from .handle import FlatParamHandle
from .unit import FSDPUnit

ENV_VAR = "FSDP_LEGACY_GATHER_BUCKET_MB"
# Units of up to a few hundred KiB (the latency-bound ones) group; a transformer block of a few MiB is gathered
# alone, as before; and the memory held ahead stays small next to any model it matters for.
DEFAULT_BUCKET_MB = 1.0


def bucket_bytes_from_env() -> int:
    value = os.environ.get(ENV_VAR)
    if value is None:
        return int(DEFAULT_BUCKET_MB * 2**20)
    try:
        mib = float(value)
    except ValueError:
        mib = -1.0
    if not mib >= 0:  # (NaN too)
        raise ValueError(f"{ENV_VAR}={value!r}: expected a number of MiB >= 0 (0 gathers each unit alone).")
    return int(mib * 2**20)


def upcoming(order: Sequence[FSDPUnit], unit: FSDPUnit, backward: bool) -> Iterator[FlatParamHandle]:
    """The flat parameters of the units expected to run after `unit`, nearest first: the next ones in forward order
    (`backward=False`) or the previous ones whose backward is still to come. Stops at a unit with several."""
    try:
        index = order.index(unit)
    except ValueError:
        return
    step = -1 if backward else 1
    index += step
    while 0 <= index < len(order):
        handles = order[index]._handles
        if len(handles) != 1 or (backward and not handles[0].needs_pre_backward):
            return
        yield handles[0]
        index += step


def gather_group(first: FlatParamHandle, candidates: Iterable[FlatParamHandle], budget: int) -> list[FlatParamHandle]:
    """`first` and the candidates that may join its all-gather, in order, within `budget` unsharded bytes."""
    group, total = [first], _unsharded_bytes(first)
    if not _can_gather(first) or total > budget:
        return group
    for handle in candidates:
        total += _unsharded_bytes(handle)
        if total > budget or not _can_gather(handle) or not _compatible(handle, first):
            break
        group.append(handle)
    return group


def unshard_together(handles: Sequence[FlatParamHandle]) -> None:
    """Issue one all-gather for all of `handles`; each one's `wait_unshard` completes it (the first to wait fills
    every handle's unsharded buffer)."""
    for handle in handles:
        handle.prepare_unshard()
    work = _GroupGather(handles)
    for handle in handles:
        handle.unshard_work = work


def _can_gather(handle: FlatParamHandle) -> bool:
    return handle.sharded and handle.needs_unshard and handle.world_size > 1


def _compatible(handle: FlatParamHandle, first: FlatParamHandle) -> bool:
    return (
        handle.group is first.group
        and handle.full_padded.dtype == first.full_padded.dtype
        and handle.compute_device == first.compute_device
    )


def _unsharded_bytes(handle: FlatParamHandle) -> int:
    return handle.layout.padded_numel * handle.full_padded.element_size()


class _GroupGather:
    """The shards of several handles side by side, gathered at once: rank r's block of the output holds rank r's
    shards in the same order, and each handle's unsharded buffer is its column of those blocks."""

    def __init__(self, handles: Sequence[FlatParamHandle]):
        first = handles[0]
        self._handles = list(handles)
        self._sizes = [handle.layout.shard_numel for handle in handles]
        self._world_size = first.world_size
        dtype, device = first.full_padded.dtype, first.compute_device
        self._input: torch.Tensor | None = torch.empty(sum(self._sizes), dtype=dtype, device=device)
        for piece, handle in zip(self._input.split(self._sizes), handles, strict=True):
            piece.copy_(handle.local_shard, non_blocking=True)  # (casts to the gather dtype, as unshard's .to())
        self._output: torch.Tensor | None = torch.empty(self._world_size * self._input.numel(), dtype=dtype, device=device)
        self._work: comm.Waitable | None = comm.all_gather(self._output, self._input, first.group)

    def wait(self) -> bool:
        if self._work is None:
            return True
        self._work.wait()
        self._work = None
        assert self._output is not None and self._input is not None
        gathered = self._output.view(self._world_size, -1)
        for columns, handle in zip(gathered.split(self._sizes, dim=1), self._handles, strict=True):
            handle.full_padded.view(self._world_size, -1).copy_(columns)
        if self._output.device.type == "cpu":
            # Free both now rather than whenever the backend's work object, which keeps them, is released.
            for tensor in (self._input, self._output):
                tensor.untyped_storage().resize_(0)
        self._input = self._output = None
        self._handles = []
        return True
