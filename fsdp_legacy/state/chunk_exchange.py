"""SHARDED state dicts without gathering a whole unit.

torch FSDP1's SHARDED layout gives rank r the dim-0 chunk r of every original parameter (`param.chunk(world_size)`).
In a row-major parameter that chunk is one contiguous range of the flat parameter, which one or a few neighbouring
ranks' shards hold. One all-to-all moves exactly those ranges: each rank sends every element of its shard to the one
rank whose chunk holds it, so a rank holds its shard and its chunks (about two shards), never the unit whole (world
size shards) as a gather does. The same exchange serves the flat parameter and each of its optimizer states.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import collectives as comm
from ..flat_param import FlatParamLayout, ParamInfo
from ..storage import free_storage


@dataclass(frozen=True)
class _Range:
    """The elements [start, end) of the unsharded flat tensor that rank `rank`'s chunk of `info` holds."""

    info: ParamInfo
    rank: int
    start: int
    end: int
    shape: torch.Size


def chunk_rows(rows: int, world_size: int) -> list[int]:
    """torch.chunk's split of `rows` (> 0) rows: chunks of ceil(rows / world_size) rows, as many as the rows fill."""
    per_chunk = -(-rows // world_size)
    return [min(per_chunk, rows - first) for first in range(0, rows, per_chunk)]


def _chunk_ranges(info: ParamInfo, world_size: int) -> list[_Range]:
    row_numel = info.numel // info.shape[0]
    ranges, start = [], info.offset
    for rank, rows in enumerate(chunk_rows(info.shape[0], world_size)):
        end = start + rows * row_numel
        ranges.append(_Range(info, rank, start, end, torch.Size((rows, *info.shape[1:]))))
        start = end
    return ranges


def can_exchange(layout: FlatParamLayout) -> bool:
    """Whether every parameter's chunks are contiguous flat ranges: row-major, at least 1-D, not empty."""
    return all(info.stride is None and len(info.shape) > 0 and info.numel > 0 for info in layout.params)


@dataclass(frozen=True)
class ChunkPlan:
    """What one rank sends and receives to build its chunks of a unit's parameters from the ranks' shards."""

    send: tuple[tuple[int, int], ...]  # (start, end) in this rank's shard, grouped by destination rank
    send_sizes: tuple[int, ...]  # elements per destination rank
    receive_sizes: tuple[int, ...]  # elements per source rank
    chunks: tuple[_Range, ...]  # this rank's chunks, in flat order: the received elements, one after another

    @classmethod
    def of(cls, layout: FlatParamLayout, rank: int) -> "ChunkPlan":
        world, shard = layout.world_size, layout.shard_numel
        lo, hi = rank * shard, (rank + 1) * shard
        ranges = [r for info in layout.params for r in _chunk_ranges(info, world)]
        # What this shard holds of each rank's chunks, by destination rank, each in flat order.
        held = sorted((r.rank, max(r.start, lo), min(r.end, hi)) for r in ranges if max(r.start, lo) < min(r.end, hi))
        send_sizes = [0] * world
        for destination, start, end in held:
            send_sizes[destination] += end - start
        mine = tuple(r for r in ranges if r.rank == rank)
        receive_sizes = [0] * world
        for r in mine:
            for source in range(r.start // shard, (r.end - 1) // shard + 1):
                receive_sizes[source] += min(r.end, (source + 1) * shard) - max(r.start, source * shard)
        send = tuple((start - lo, end - lo) for _, start, end in held)
        return cls(send, tuple(send_sizes), tuple(receive_sizes), mine)


def exchange_chunks(
    plan: ChunkPlan, local: torch.Tensor, group: dist.ProcessGroup, offload_to_cpu: bool, local_owned: bool = False
) -> dict[ParamInfo, torch.Tensor]:
    """This rank's dim-0 chunk of each parameter, each a tensor of its own (on the CPU with `offload_to_cpu`), from
    every rank's `local` shard of a flat tensor (the flat parameter, or one of its optimizer states). `local_owned`:
    `local` is a temporary of the caller's, released once read. At most two shard-sized buffers live at once."""
    outgoing = torch.cat([local[start:end] for start, end in plan.send]) if plan.send else local.new_empty(0)
    if local_owned:
        free_storage(local)
    incoming = outgoing.new_empty(sum(plan.receive_sizes))
    comm.all_to_all(incoming, outgoing, list(plan.receive_sizes), list(plan.send_sizes), group).wait()
    # Each released now, not when the backend drops its work object (gloo's may outlive wait()).
    free_storage(outgoing)
    chunks, offset = {}, 0
    for r in plan.chunks:
        piece = incoming[offset : offset + r.end - r.start].view(r.shape)
        chunks[r.info] = piece.to("cpu") if offload_to_cpu and piece.device.type != "cpu" else piece.clone()
        offset += r.end - r.start
    free_storage(incoming)
    return chunks
