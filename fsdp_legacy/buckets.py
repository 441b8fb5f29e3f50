"""One collective for several consecutive small units: their all-gathers, and their gradient reductions.

Each collective has a fixed cost besides its bytes (on gloo a round trip through its threads and the network stack,
on NCCL a kernel launch and a synchronisation), so a model of many small units is bound by the number of its
collectives. Consecutive units therefore share one collective while their unsharded sizes together stay within a
byte budget:

- all-gather: when the runtime must gather a unit, the units expected to need theirs right after it join: in forward
  those that followed it in the previous iteration's forward (what forward prefetch reads), in backward those that
  preceded it in this iteration's forward and still have their backward to come. A group stops at the first unit
  that cannot join (another process group or dtype, already unsharded, several flat parameters).
- reduce-scatter: a sharded unit's unsharded gradient waits, pre-divided, in a bucket that the next units' gradients
  join; the bucket is reduced at once when the next gradient would overflow it or cannot join it, and at the end of
  backward. Each unit's shard of the result then goes the usual way (post-divide, hybrid all-reduce, `.grad`).

A unit alone over the budget is gathered and reduced alone, as before. The budget: `FSDP_LEGACY_BUCKET_MB` in the
environment (MiB of unsharded parameters or gradients, in the dtype they are communicated in; read at the root's
first forward), default `DEFAULT_BUCKET_MB`; 0 turns grouping off. Memory: a group's parameters are unsharded
together, and up to a budget of unsharded gradients waits for its reduction, so each adds at most the budget to
what one unit at a time holds. The collectives' own buffers add little on top: a group's gather writes into one
buffer, and each unit's unsharded storage (its own, freed when it reshards) is allocated only once the gather has
completed; the bucket's gradients are let go one by one as they are copied for their reduction. Measured, the peak
grows by 0.8x to 1.6x the budget against grouping off. Each element is communicated and reduced
as it would be alone, with the same pre- and post-division, so the results are the same up to the order in which a
backend sums more than two ranks' values.
"""

import os
from collections.abc import Iterable, Iterator, Sequence

import torch

from . import collectives as comm
from .flat_param_grads import PendingReduction
from .handle import FlatParamHandle
from .storage import alloc_storage, free_storage
from .unit import FSDPUnit

ENV_VAR = "FSDP_LEGACY_BUCKET_MB"
# Units of up to a few hundred KiB (the latency-bound ones) group; a transformer block of a few MiB is communicated
# alone, as before; and the extra memory (at most about 1.6x the budget, measured) is small next to any real model.
# On the benchmark's deep MLP (129 KB units, 2 ranks) 0.5 MiB gave 0.52x torch FSDP1's step time, 1 MiB 0.41x.
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
        raise ValueError(f"{ENV_VAR}={value!r}: expected a number of MiB >= 0 (0 turns grouping off).")
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
    every handle's unsharded buffer, allocated only then: while the gather is in flight its output holds the data)."""
    for handle in handles:
        handle.writeback_orig_params()
    work = _GroupGather(handles)
    for handle in handles:
        handle.unshard_work = work


def _can_gather(handle: FlatParamHandle) -> bool:
    return handle.sharded and handle.must_gather and handle.world_size > 1


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
        total = self._world_size * self._input.numel()
        self._output: torch.Tensor | None = torch.empty(total, dtype=dtype, device=device)
        self._work: comm.Waitable | None = comm.all_gather(self._output, self._input, first.group)

    def wait(self) -> bool:
        if self._work is None:
            return True
        self._work.wait()
        self._work = None
        assert self._output is not None and self._input is not None
        on_cpu = self._output.device.type == "cpu"
        if on_cpu:  # free now rather than whenever the backend's work object, which keeps it, is released
            free_storage(self._input)
        gathered = self._output.view(self._world_size, -1)
        for columns, handle in zip(gathered.split(self._sizes, dim=1), self._handles, strict=True):
            alloc_storage(handle.full_padded)
            handle.full_padded.view(self._world_size, -1).copy_(columns)
        if on_cpu:
            free_storage(self._output)
        self._input = self._output = None
        self._handles = []
        return True


class ReduceBucket:
    """Unsharded gradients of consecutive sharded units waiting to be reduce-scattered together."""

    def __init__(self, budget: int):
        self.budget = budget
        self._entries: list[tuple[FlatParamHandle, torch.Tensor]] = []
        self._bytes = 0

    @staticmethod
    def accepts(handle: FlatParamHandle) -> bool:
        """Whether `handle`'s gradients may be grouped at all: the default reduction of a sharded unit over two
        ranks. Over more, the backend's order of summing the ranks' values may depend on where an element lies in
        the buffer (gloo's ring splits it into segments by size), which would change the last bits of the sums
        against reducing the unit alone, as torch's FSDP1 does; the sum of two values does not depend on order."""
        return handle.sharded and handle.comm_hook is None and handle.world_size == 2

    def fits(self, handle: FlatParamHandle) -> bool:
        """Whether `handle`'s gradient may join the waiting ones without overflowing the budget."""
        nbytes = _grad_bytes(handle)
        if not self._entries:
            return nbytes <= self.budget
        first = self._entries[0][0]
        return (
            self._bytes + nbytes <= self.budget
            and handle.group is first.group
            and handle.replicate_group is first.replicate_group
            and handle.reduce_dtype == first.reduce_dtype
            and (handle.pre_divide, handle.post_divide) == (first.pre_divide, first.post_divide)
            and handle.compute_device == first.compute_device
        )

    def waiting(self) -> list[tuple[FlatParamHandle, torch.Tensor]]:
        """The units whose gradients wait in the bucket, and those gradients."""
        return list(self._entries)

    def add(self, handle: FlatParamHandle, grad: torch.Tensor) -> None:
        self._entries.append((handle, grad))
        self._bytes += _grad_bytes(handle)

    def discard(self) -> None:
        """Drop the waiting gradients unreduced (their backward was interrupted)."""
        self._entries, self._bytes = [], 0

    def flush(self) -> list[PendingReduction]:
        """Issue one reduce-scatter for the waiting gradients: one pending reduction per unit, sharing the work."""
        entries, self._entries, self._bytes = self._entries, [], 0
        if len(entries) == 1:  # alone: the unit's own reduction, no copies
            handle, grad = entries.pop()
            pending = handle.reduce_grad(grad)
            return [pending] if pending is not None else []
        if not entries:
            return []
        first = entries[0][0]
        handles = [handle for handle, _ in entries]
        full = _side_by_side(entries, first.reduce_dtype, first.compute_device)  # (empties `entries`)
        if first.pre_divide > 1:  # (the units of a bucket share their divisors: fits())
            full.div_(first.pre_divide)
        outputs = [torch.empty(handle.layout.shard_numel, dtype=full.dtype, device=full.device) for handle in handles]
        # Each unit's shard of the sum goes into its own tensor: a unit's `.grad` must not share storage with another's.
        work = comm.reduce_scatter_pieces(outputs, full, first.group)
        held = full if comm.input_read_at_wait(first.group) else None
        return [
            PendingReduction(handle, work, output, held, handle.post_divide)
            for handle, output in zip(handles, outputs, strict=True)
        ]


def _side_by_side(
    entries: list[tuple[FlatParamHandle, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The gradients laid out for one reduce-scatter: rank r's chunk holds every unit's chunk r, in order, so the
    reduced chunk r is rank r's shards side by side. Each unsharded gradient is let go as soon as it is copied, so
    the copy adds one unit's gradient to the bucket's size, not the bucket's size again."""
    world_size = entries[0][0].world_size
    sizes = [handle.layout.shard_numel for handle, _ in entries]
    full = torch.empty(world_size * sum(sizes), dtype=dtype, device=device)
    entries.reverse()
    for columns in full.view(world_size, -1).split(sizes, dim=1):
        _, grad = entries.pop()
        columns.copy_(grad.view(world_size, -1))  # (casts to the reduce dtype, as reduce_grad's .to())
        del grad
    return full


def _grad_bytes(handle: FlatParamHandle) -> int:
    return handle.layout.padded_numel * handle.reduce_dtype.itemsize
