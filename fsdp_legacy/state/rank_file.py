"""Read back one rank's torch.save file of a LOCAL or SHARDED state dict without running pickled code.

Since torch 2.6, torch.load defaults to weights_only=True, which refuses a ShardedTensor (its state names getattr and
process-group classes), so FSDP1 users saving per-rank files are told to pass weights_only=False: any code in the
file then runs. load_rank_state reads the file with the converter's restricted unpickler (convert/loading.py: an
explicit allowlist, ShardedTensors as inert LocalShards) and builds each ShardedTensor again on this rank, ready for
model.load_state_dict under the same StateDictType and for FSDP.optim_state_dict_to_load.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata, init_from_local_shards

from ..convert.errors import CheckpointError
from ..convert.loading import LocalShards, load_rank_file


def load_rank_state(path: str, process_group: dist.ProcessGroup | None = None) -> Any:
    """This rank's state dict from `path` (saved by the same rank of a job of the same world size), tensors on CPU.

    Plain tensors come back as torch.load(weights_only=True) gives them; each ShardedTensor is rebuilt over
    `process_group` (default: the default group) from the shards the file holds. A file of another rank or world size,
    or one holding DTensors (FSDP2, or FSDP1 with a device_mesh), is refused with what to use instead.
    """
    group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)

    def rebuild(value: Any) -> Any:
        if isinstance(value, LocalShards):
            return _sharded_tensor(path, value, rank, world_size, group)
        if isinstance(value, dict):
            return type(value)((key, rebuild(item)) for key, item in value.items())
        if isinstance(value, list):
            return [rebuild(item) for item in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(rebuild(item) for item in value)
        return value

    return rebuild(load_rank_file(path))


def _sharded_tensor(
    path: str, held: LocalShards, rank: int, world_size: int, group: dist.ProcessGroup
) -> ShardedTensor:
    if held.source != "ShardedTensor":
        raise CheckpointError(
            f"{path} holds a {held.source} (FSDP2, or FSDP1 with a device_mesh), which load_rank_state does not "
            "rebuild: save and load such state with torch.distributed.checkpoint (dcp.save / dcp.load), or convert "
            "the files with `fsdp-legacy convert`."
        )
    if (held.rank, held.world_size) != (dist.get_global_rank(group, rank), world_size):
        raise CheckpointError(
            f"{path} was saved by rank {held.rank} of {held.world_size}; this is rank "
            f"{dist.get_global_rank(group, rank)} of {world_size}. A LOCAL or SHARDED per-rank file loads only on the "
            "rank and world size that saved it: read each rank's own file, or reshard the files with "
            "`fsdp-legacy convert` (or save with torch.distributed.checkpoint, which reshards on load)."
        )
    shards = [
        Shard(tensor.clone(), ShardMetadata(list(offsets), list(tensor.shape), f"rank:{rank}/cpu"))
        for offsets, tensor in held.pieces
    ]
    return init_from_local_shards(shards, list(held.shape), process_group=group)
