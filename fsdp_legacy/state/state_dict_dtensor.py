"""SHARDED state-dict values (model and optimizer) as DTensors: torch FSDP1's format with a device mesh, and
fsdp_legacy's format without one where torch no longer has ShardedTensor.

* FSDP's 1-D mesh: dim-0 chunks, placement Shard(0), chunk r on rank r (ranks past the number of chunks hold an empty
  piece);
* HYBRID_SHARD's 2-D mesh (replicate dim, shard dim): (Replicate(), Shard(0)), every replica holds the same chunks;
* a 1-D mesh sliced from tensor parallelism's 2-D mesh: over that 2-D mesh (tensor_parallel.sharded_dtensor);
* no mesh and no ShardedTensor (sharded_tensor_compat.py): Shard(0) on a 1-D mesh over the unit's process group, the
  layout FSDP2 saves, so DCP, FSDP2 and the converter read it as any DTensor checkpoint.

A LOCAL_STATE_DICT holds flat shards, which a device mesh does not describe: torch refuses the combination, and so
does fsdp_legacy, with torch's message, for model and optimizer alike.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..api import StateDictSettings, StateDictType
from ..tensor_parallel import DTensorParam, root_mesh, sharded_dtensor
from ..unit import FSDPUnit
from . import sharded_tensor_compat

_LOCAL_WITH_MESH = (  # torch's message, word for word
    "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with LOCAL_STATE_DICT. "
    "Please set state_dict_type to SHARDED_STATE_DICT to get DTensor state_dict."
)

_LOCAL_WITHOUT_SHARDED_TENSOR = (
    "LOCAL_STATE_DICT holds each unit's flat shard as a ShardedTensor, which this version of torch no longer has. "
    "Save a SHARDED_STATE_DICT instead (DTensor values, resharded by torch.distributed.checkpoint at any world size), "
    "or a FULL_STATE_DICT."
)


def check_model_settings(unit: FSDPUnit) -> None:
    """A unit built with a device mesh saves DTensors: LOCAL_STATE_DICT is refused, and the model config's
    `_use_dtensor` turns True, as torch sets it (its callers may read it). Without ShardedTensor in torch, a
    LOCAL_STATE_DICT (a ShardedTensor of the flat shard) cannot be made: refused too."""
    if unit._state_dict_type == StateDictType.LOCAL_STATE_DICT and not has_sharded_tensor():
        raise RuntimeError(_LOCAL_WITHOUT_SHARDED_TENSOR)
    if unit._device_mesh is None:
        return
    if unit._state_dict_type == StateDictType.LOCAL_STATE_DICT:
        raise RuntimeError(_LOCAL_WITH_MESH)
    unit._state_dict_config._use_dtensor = True


def check_optim_settings(unit: FSDPUnit, settings: StateDictSettings) -> None:
    """The same for the optimizer config, which torch checks whenever the settings are read."""
    if unit._device_mesh is None:
        return
    if settings.state_dict_type == StateDictType.LOCAL_STATE_DICT:
        raise RuntimeError(_LOCAL_WITH_MESH)
    settings.optim_state_dict_config._use_dtensor = True  # type: ignore[attr-defined]


def uses_dtensor(unit: FSDPUnit, config: Any) -> bool:
    """Whether the unit's SHARDED values are DTensors rather than ShardedTensors."""
    return bool(getattr(config, "_use_dtensor", False)) or unit._device_mesh is not None or not has_sharded_tensor()


def has_sharded_tensor() -> bool:
    return sharded_tensor_compat.AVAILABLE


# One mesh per process group for the fallback (building a mesh registers it with torch; never twice per group).
_group_meshes: dict[dist.ProcessGroup, DeviceMesh] = {}


def state_dict_mesh(unit: FSDPUnit) -> DeviceMesh:
    """The unit's device mesh, or a 1-D mesh over its process group."""
    if unit._device_mesh is not None:
        return unit._device_mesh
    mesh = _group_meshes.get(unit.process_group)
    if mesh is None:
        mesh = _group_meshes[unit.process_group] = DeviceMesh.from_group(unit.process_group, unit.compute_device.type)
    return mesh


def chunk_dtensor(
    param: torch.Tensor, unit: FSDPUnit, offload_to_cpu: bool, record: DTensorParam | None = None
) -> torch.Tensor:
    """`param` (the whole parameter, or a state of its shape; a DTensor parameter's local piece, of which `record`
    tells the rest) as its dim-0 chunks over the unit's mesh; built from the local chunk, without communication."""
    dtensor = sharded_dtensor(param, state_dict_mesh(unit), record)
    if dtensor is None:
        chunks = param.chunk(unit.world_size)
        rank = unit.rank  # the rank in the shard group, which is the mesh's last dimension
        local = chunks[rank].detach().clone() if rank < len(chunks) else param.new_empty((0, *param.shape[1:]))
        return dtensor_of_chunk(local, param.shape, param.stride(), unit, offload_to_cpu)
    return dtensor.cpu() if offload_to_cpu and dtensor.device.type != "cpu" else dtensor


def chunks_on_own_mesh(unit: FSDPUnit) -> bool:
    """Whether the unit's DTensor values are its parameters' dim-0 chunks alone (FSDP's mesh is not sliced from a
    tensor-parallel one, whose placements they would carry)."""
    return root_mesh(state_dict_mesh(unit)) is None


def dtensor_of_chunk(
    local: torch.Tensor, shape: torch.Size, stride: tuple[int, ...], unit: FSDPUnit, offload_to_cpu: bool
) -> torch.Tensor:
    """The SHARDED value of a parameter (or a state of its shape) of which this rank holds the dim-0 chunk `local`
    (an empty piece past the number of chunks)."""
    mesh = state_dict_mesh(unit)
    placements: list[Placement] = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    dtensor = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    return dtensor.cpu() if offload_to_cpu and dtensor.device.type != "cpu" else dtensor
