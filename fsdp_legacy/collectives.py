"""Collectives over c10d process groups: the one place that knows torch version differences.

All collectives are issued with async_op=True and return a c10d Work. On gloo the work runs on gloo's own threads,
so communication overlaps compute; on NCCL it runs on NCCL's internal stream, and Work.wait() makes the current
stream wait for it (tensors handed to an async NCCL op are kept alive by c10d until it completes).
"""

from typing import Protocol

import torch
import torch.distributed as dist

from .storage import free_storage

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Waitable(Protocol):
    """What a collective returns: a c10d Work, or one of the stand-ins below."""

    def wait(self) -> bool: ...


class _Done:
    """A completed piece of work, for steps that turn out to need no communication."""

    def wait(self) -> bool:
        return True


DONE = _Done()


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> Waitable:
    """Gather equal 1-D shards of every rank into `output` (world_size * shard.numel() elements)."""
    if output.dtype == torch.bool:  # not every backend gathers bool: move the same bytes as uint8
        output, shard = output.view(torch.uint8), shard.view(torch.uint8)
    if _pair_on_gloo(shard, group):
        return _exchange_gather(output, shard, group)
    return _all_gather_single(output, shard, group=group, async_op=True)


def _pair_on_gloo(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Two ranks of gloo on CPU tensors: there a gather or a reduce-scatter is one exchange of halves between the two
    (an all_to_all_single that sends nothing to itself), which gloo runs in 0.6x-0.8x the time of its own all-gather
    and 0.3x-0.6x that of its reduce-scatter, an all-reduce of the whole buffer (measured at 4 KiB to 16 MiB). With
    more ranks gloo's ring algorithms stay: they bound what each rank sends, and a sum of more than two values
    depends on the order the ring takes."""
    return group.size() == 2 and tensor.device.type == "cpu" and dist.get_backend(group) == "gloo"


def _halves_split(group: dist.ProcessGroup, numel: int) -> tuple[int, list[int]]:
    """The other rank of the pair, and all_to_all_single's split sizes: `numel` elements to (or from) it, none to
    this rank itself."""
    other = 1 - group.rank()
    splits = [0, 0]
    splits[other] = numel
    return other, splits


def _exchange_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> Waitable:
    numel = shard.numel()
    other, splits = _halves_split(group, numel)
    rank = 1 - other
    output[rank * numel : (rank + 1) * numel].copy_(shard)
    received = output[other * numel : (other + 1) * numel]
    return dist.all_to_all_single(received, shard, splits, splits, group=group, async_op=True)


def all_to_all(
    output: torch.Tensor, input: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group: dist.ProcessGroup
) -> Waitable:
    """Send `input_sizes[r]` elements of 1-D `input` (in order) to each rank r; receive `output_sizes[s]` from each rank
    s into `output`, in rank order."""
    return dist.all_to_all_single(output, input, output_sizes, input_sizes, group=group, async_op=True)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> Waitable:
    """Sum `full` (world_size * output.numel() elements) across ranks; rank r keeps chunk r in `output`.

    `full` is consumed: its contents are undefined afterwards.
    """
    if dist.get_backend(group) == "gloo":
        return _gloo_reduce_scatter([output], full, group)
    return _reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group, async_op=True)


def input_read_at_wait(group: dist.ProcessGroup) -> bool:
    """Whether a reduction's input must outlive the collective's issue: gloo's reduce-scatter reads it back at wait()
    (`_AllReduceThenSlice`). Elsewhere c10d keeps an async collective's input alive until it completes, so the caller
    drops it at once and its memory returns as soon as the collective is done, not when the caller next waits."""
    return dist.get_backend(group) == "gloo"


def reduce_scatter_pieces(outputs: list[torch.Tensor], full: torch.Tensor, group: dist.ProcessGroup) -> Waitable:
    """`reduce_scatter` whose chunk is written, in order, into several 1-D `outputs` (their sizes add up to a chunk):
    the reduced gradients of several units reduced together, each in its own tensor."""
    if dist.get_backend(group) == "gloo":
        return _gloo_reduce_scatter(outputs, full, group)
    return _ScatterThenSplit(outputs, full, group)


def _gloo_reduce_scatter(outputs: list[torch.Tensor], full: torch.Tensor, group: dist.ProcessGroup) -> Waitable:
    # (in float32 and float64 only: the sum of two values is then the same bits whichever rank adds them, as
    # x + y == y + x; gloo's own sum of low-precision values is left to gloo)
    if _pair_on_gloo(full, group) and full.dtype in (torch.float32, torch.float64):
        return _ExchangeThenAdd(outputs, full, group)
    return _AllReduceThenSlice(outputs, full, group)


class _AllReduceThenSlice:
    """gloo runs a reduce-scatter as an all-reduce on a temporary copy of its input. Reducing the input in place and
    keeping our chunk moves the same bytes without that full-size copy."""

    def __init__(self, outputs: list[torch.Tensor], full: torch.Tensor, group: dist.ProcessGroup):
        self._outputs, self._full, self._rank = outputs, full, group.rank()
        self._work: dist.Work | None = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
            chunk_numel = sum(output.numel() for output in self._outputs)
            _split_into(self._full.view(-1, chunk_numel)[self._rank], self._outputs)
        return True


class _ExchangeThenAdd:
    """A reduce-scatter between two ranks: each sends the other the half it keeps and adds the half it receives to
    its own, which is the sum gloo's all-reduce makes of those two values, bit for bit. One output receives in place;
    several (a bucket's units) receive into one chunk that is then split into them."""

    def __init__(self, outputs: list[torch.Tensor], full: torch.Tensor, group: dist.ProcessGroup):
        halves = full.view(2, -1)
        other, splits = _halves_split(group, halves.shape[1])
        self._outputs = outputs
        self._own: torch.Tensor | None = halves[1 - other]
        self._received = outputs[0] if len(outputs) == 1 else torch.empty_like(halves[other])
        self._work: dist.Work | None = dist.all_to_all_single(
            self._received, halves[other], splits, splits, group=group, async_op=True
        )

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
            assert self._own is not None
            self._received.add_(self._own)
            self._own = None
            if len(self._outputs) > 1:
                _split_into(self._received, self._outputs)
                free_storage(self._received)  # (on the CPU: the backend's work, which may outlive us, holds it too)
        return True


class _ScatterThenSplit:
    """A reduce-scatter into one chunk-sized temporary, split into the outputs once it completes."""

    def __init__(self, outputs: list[torch.Tensor], full: torch.Tensor, group: dist.ProcessGroup):
        self._outputs = outputs
        chunk_numel = sum(output.numel() for output in outputs)
        self._chunk: torch.Tensor | None = torch.empty(chunk_numel, dtype=full.dtype, device=full.device)
        self._work: Waitable | None = reduce_scatter(self._chunk, full, group)

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
            assert self._chunk is not None
            _split_into(self._chunk, self._outputs)
            self._chunk = None
        return True


def _split_into(chunk: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    for output, piece in zip(outputs, chunk.split([output.numel() for output in outputs]), strict=True):
        output.copy_(piece)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> Waitable:
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


def gradient_divide_factors(world_size: int) -> tuple[float, float]:
    """FSDP1's (pre, post) divisors: split 1/world_size so that fp16/bf16 sums neither overflow nor underflow.

    pre doubles while it divides world_size and stays below world_size / pre; post = world_size / pre.
    """
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre
