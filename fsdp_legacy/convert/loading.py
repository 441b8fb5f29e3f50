"""Every unpickling the converter does: torch.load with weights_only=True (safe_load), and restricted unpicklers
that allow an explicit list of globals (DCP's `.metadata`, and per-rank torch.save files holding ShardedTensors or
DTensors, which weights_only refuses). Errors name the file and say what to do."""

import enum
import math
import os
import pickle
import types
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from .errors import CheckpointError


def safe_load(file: str | BinaryIO, where: str, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) onto the CPU: tensors and plain containers only, never pickled code."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        lines = [line.strip() for line in str(error).splitlines()]
        reason = next((line for line in lines if "unsupported" in line.lower()), lines[0] if lines else "")
        if "ShardedTensor" in reason:
            reason += "; one rank's torch.save of a LOCAL state dict: pass the directory of every rank's file"
        raise CheckpointError(
            f"{where} holds pickled Python objects other than tensors and plain containers ({reason}); loading them "
            "could run arbitrary code, so it is refused (torch.load(weights_only=True)). If you trust the file's "
            "origin, load it yourself with weights_only=False and save its tensors again with torch.save."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, TypeError, OverflowError, IndexError, KeyError) as error:
        # (a tensor rebuilt with arguments no save writes: a size of None, an offset past the storage...)
        raise _corrupted(where, error) from None


def _corrupted(where: str, error: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{where} cannot be read: it is truncated or corrupted ({(str(error).splitlines() or [''])[0]}). Restore it "
        "from a copy or re-create the checkpoint."
    )


# --------------------------------------------------------------------------------------------------------------------
# Restricted unpicklers


class Refused(pickle.UnpicklingError):
    """A pickle named a global outside the allowlist (the message is "module.name")."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in `allowed` (module -> names), torch's dtypes, and the
    `substitutes` (module, name) -> object it maps instead of importing; any other global raises Refused, before
    anything is imported or called."""

    allowed: Mapping[str, Collection[str]] = {}
    substitutes: Mapping[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        substitute = self.substitutes.get((module, name))
        if substitute is not None:
            return substitute
        if (module, name) == ("builtins", "getattr"):
            return self._enum_member
        if name in self.allowed.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise Refused(f"{module}.{name}")

    def _enum_member(self, owner: object, name: object) -> Any:
        """What `getattr` may do in a pickle: Python 3.11.0 to 3.11.4 pickle an enum member as `getattr(EnumClass,
        "NAME")` (later releases as `EnumClass(value)`), so DCP's own metadata written there holds it. Only a member
        of an allowed Enum class is given; any other use of getattr would reach arbitrary attributes."""
        if (
            isinstance(owner, type)
            and issubclass(owner, enum.Enum)
            and owner.__qualname__ in self.allowed.get(owner.__module__, ())
            and isinstance(name, str)
            and name in owner.__members__
        ):
            return owner.__members__[name]
        raise Refused(f"builtins.getattr({getattr(owner, '__qualname__', type(owner).__name__)}, {name!r})")


# A torch.save file of a LOCAL state dict pickles each flat parameter as a ShardedTensor:
#   _rebuild_from_type_v2(_rebuild_wrapper_subclass, ShardedTensor, (...), state)
#   state = (local_shards: [Shard(tensor, ShardMetadata)], ShardedTensorMetadata, ShardedTensor.ProcessGroupState,
#            sharding_spec, init_rrefs)
# ShardedTensor.__setstate__ needs a process group of the saving world size; instead, the rebuild maps to LocalShards
# below, and every class of the state to an inert stand-in that only stores what the pickle gives it.


@dataclass(frozen=True)
class LocalShards:
    """What one rank's file holds of a ShardedTensor or a DTensor: its local pieces (global offsets, tensor), the
    global shape and dtype, the saving rank (global) and world size, and which of the two it was."""

    pieces: tuple[tuple[tuple[int, ...], torch.Tensor], ...]
    shape: torch.Size
    dtype: torch.dtype
    rank: int
    world_size: int
    source: str = "ShardedTensor"


class _Inert:
    """Stand-in for a class of a ShardedTensor's or DTensor's state: stores its arguments and pickled state, runs
    nothing. (Built by REDUCE, cls(*args), or by NEWOBJ, cls.__new__(cls, *args), which skips __init__.)"""

    args: tuple
    state: Any

    def __new__(cls, *args: Any) -> "_Inert":
        self = super().__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str) -> Any:
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots)
        if not isinstance(state, dict) or name not in state:
            raise pickle.UnpicklingError(f"a {type(self).__name__} without {name}")
        return state[name]

    def get(self, name: str) -> Any:
        try:
            return self.field(name)
        except pickle.UnpicklingError:
            return None


def _inert(name: str) -> type[_Inert]:
    return type(name, (_Inert,), {})


_ShardedTensor = _inert("ShardedTensor")
_ShardedTensor.ProcessGroupState = _inert("ProcessGroupState")  # type: ignore[attr-defined]
_Shard, _ShardMetadata = _inert("Shard"), _inert("ShardMetadata")
_ShardedTensorMetadata = _inert("ShardedTensorMetadata")


def _getattr(owner: Any, name: str) -> Any:
    """Protocol 2 pickles the nested class ShardedTensor.ProcessGroupState as getattr(ShardedTensor, name)."""
    if owner is _ShardedTensor and name == "ProcessGroupState":
        return _ShardedTensor.ProcessGroupState
    raise Refused(f"getattr({getattr(owner, '__name__', type(owner).__name__)}, {name!r})")


def _rebuild_sharded(func: Any, new_type: Any, args: Any, state: Any) -> LocalShards:
    """torch._tensor._rebuild_from_type_v2 for a ShardedTensor or a DTensor, without building one (func is never
    called)."""
    if new_type is _DTensor:
        return _rebuild_dtensor(args, state)
    if new_type is not _ShardedTensor:
        raise Refused(f"torch._tensor._rebuild_from_type_v2 of {getattr(new_type, '__name__', new_type)!r}")
    if not isinstance(state, tuple) or len(state) != 5:
        raise pickle.UnpicklingError("a ShardedTensor whose state is not (shards, metadata, group, spec, rrefs)")
    shards, metadata, group = state[:3]
    if not (
        isinstance(shards, list)
        and all(isinstance(s, _Shard) for s in shards)
        and isinstance(metadata, _ShardedTensorMetadata)
        and isinstance(group, _ShardedTensor.ProcessGroupState)
    ):
        raise pickle.UnpicklingError("a ShardedTensor with a malformed state")
    pieces = []
    for shard in shards:
        tensor, where = shard.field("tensor"), shard.field("metadata")
        if (
            not isinstance(tensor, torch.Tensor)
            or type(tensor) not in (torch.Tensor, torch.nn.Parameter)
            or not isinstance(where, _ShardMetadata)
        ):
            raise pickle.UnpicklingError("a ShardedTensor shard that is not a plain tensor with its metadata")
        offsets = tuple(int(o) for o in where.field("shard_offsets"))
        if tuple(int(s) for s in where.field("shard_sizes")) != tuple(tensor.shape):
            raise pickle.UnpicklingError("a ShardedTensor shard whose tensor does not have the size its metadata says")
        pieces.append((offsets, tensor.detach()))
    properties = metadata.field("tensor_properties")
    dtype = properties.field("dtype") if isinstance(properties.state, dict) else properties.state[0]
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("a ShardedTensor without a dtype")
    return LocalShards(
        tuple(pieces),
        torch.Size(metadata.field("size")),
        dtype,
        int(group.field("global_rank")),
        int(group.field("global_world_size")),
    )


# A DTensor pickles as _rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor, dtype, size, ...), state)
# with state (None, {"_local_tensor": tensor, "_spec": DTensorSpec}); the spec holds the DeviceMesh (its attributes:
# the saving rank, its coordinate on each mesh dimension, the mesh's shape), the placements (Shard(dim) / Replicate
# per mesh dimension) and the global TensorMeta. The local tensor's place in the global one follows from those, as
# torch computes it: each Shard splits the extent left by the mesh dimensions before it into torch.chunk pieces.
_DTensor, _DTensorSpec, _DeviceMesh = _inert("DTensor"), _inert("DTensorSpec"), _inert("DeviceMesh")
_Shard1D, _Replicate = _inert("Shard"), _inert("Replicate")
_DTensorMeta = _inert("TensorMeta")


def _rebuild_dtensor(args: Any, state: Any) -> LocalShards:
    if isinstance(state, tuple) and len(state) == 2:
        state = {**(state[0] or {}), **(state[1] or {})}
    if not isinstance(state, dict) or not isinstance(state.get("_spec"), _DTensorSpec):
        raise pickle.UnpicklingError("a DTensor without its local tensor and spec")
    local, spec = state.get("_local_tensor"), state["_spec"]
    if not isinstance(local, torch.Tensor) or type(local) not in (torch.Tensor, torch.nn.Parameter):
        raise pickle.UnpicklingError("a DTensor whose local tensor is not a plain tensor")
    meta = spec.get("tensor_meta")
    shape, dtype = (meta.args[0], meta.args[2]) if isinstance(meta, _DTensorMeta) and len(meta.args) == 3 else args[1:3]
    mesh, placements = spec.field("mesh"), spec.field("placements")
    if not isinstance(mesh, _DeviceMesh) or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("a DTensor with a malformed spec")
    sizes, coordinate, rank = _mesh_place(mesh)
    if len(placements) != len(sizes) or len(coordinate) != len(sizes):
        raise pickle.UnpicklingError("a DTensor whose placements do not match its mesh")
    offsets, extents = [0] * len(shape), list(shape)
    for placement, size, index in zip(placements, sizes, coordinate, strict=True):
        if isinstance(placement, _Replicate):
            continue
        if not isinstance(placement, _Shard1D):  # _StridedShard (FSDP2 with TP), Partial: no plain chunk of a tensor
            raise Refused(f"a DTensor placement {type(placement).__name__}, which the converter does not read")
        dim = int(placement.field("dim")) % max(len(shape), 1)
        chunk = -(-extents[dim] // size)
        start = min(index * chunk, extents[dim])
        offsets[dim] += start
        extents[dim] = max(0, min(chunk, extents[dim] - start))
    if tuple(extents) != tuple(local.shape):
        raise pickle.UnpicklingError(
            f"a DTensor whose local tensor {tuple(local.shape)} is not its chunk {tuple(extents)} of {tuple(shape)} "
            "(uneven or strided sharding the converter does not read)"
        )
    pieces = ((tuple(offsets), local.detach()),) if local.numel() else ()
    return LocalShards(pieces, torch.Size(shape), dtype, rank, math.prod(sizes), source="DTensor")


def _mesh_place(mesh: _Inert) -> tuple[list[int], list[int], int]:
    """The mesh's shape, the saving rank's coordinate on it, and that rank, from a pickled DeviceMesh's attributes
    (torch >= 2.10 keeps the shape in `_layout`, earlier versions a `mesh` tensor of ranks)."""
    rank, coordinate, layout = mesh.get("_rank"), mesh.get("_coordinate_on_dim"), mesh.get("_layout")
    if mesh.get("mesh") is not None:
        sizes = list(mesh.field("mesh").shape)
    elif isinstance(layout, _Inert) and layout.get("axes") is not None:  # one _FlatLayout per mesh dimension
        sizes = [math.prod(axis.field("shape")) if isinstance(axis, _Inert) else 0 for axis in layout.field("axes")]
    elif isinstance(layout, _Inert):  # torch 2.10 to 2.12: a nested shape, one entry per mesh dimension
        shape = layout.field("shape")
        sizes = [_nested_size(entry) for entry in (shape if isinstance(shape, tuple) else (shape,))]
    else:
        raise pickle.UnpicklingError("a DeviceMesh without its shape")
    if not isinstance(rank, int) or coordinate is None or not all(sizes):
        raise pickle.UnpicklingError("a DeviceMesh without the saving rank's place (saved by a rank outside it?)")
    return sizes, [int(c) for c in coordinate], rank


def _nested_size(entry: Any) -> int:
    """The number of ranks along one mesh dimension of a nested layout shape (an int, or a tuple of them)."""
    if isinstance(entry, int):
        return entry
    return math.prod(_nested_size(inner) for inner in entry) if isinstance(entry, tuple) else 0


def _never_called(*_: Any) -> None:
    raise Refused("torch._utils._rebuild_wrapper_subclass outside a ShardedTensor")


_SHARD = "torch.distributed._shard"
_DT = "torch.distributed.tensor"


class _RankFileUnpickler(RestrictedUnpickler):
    allowed = {
        "torch._utils": {"_rebuild_tensor_v2", "_rebuild_tensor", "_rebuild_parameter"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size", "device"},
        "collections": {"OrderedDict"},
    }
    substitutes = {
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_sharded,
        ("torch._utils", "_rebuild_wrapper_subclass"): _never_called,
        (f"{_SHARD}.sharded_tensor.api", "ShardedTensor"): _ShardedTensor,
        ("__builtin__", "getattr"): _getattr,
        ("builtins", "getattr"): _getattr,
        (f"{_SHARD}.sharded_tensor.shard", "Shard"): _Shard,
        (f"{_SHARD}.metadata", "ShardMetadata"): _ShardMetadata,
        (f"{_SHARD}.sharded_tensor.metadata", "ShardedTensorMetadata"): _ShardedTensorMetadata,
        (f"{_SHARD}.sharded_tensor.metadata", "TensorProperties"): _inert("TensorProperties"),
        (f"{_SHARD}.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): _inert("MEM_FORMAT_ENCODING"),
        (f"{_SHARD}.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"): _inert("ChunkShardingSpec"),
        ("torch.distributed.remote_device", "_remote_device"): _inert("_remote_device"),
        # DTensor (FSDP2): today's module names, and torch.distributed._tensor's before 2.5
        **{(module, "DTensor"): _DTensor for module in (_DT, f"{_DT}._api", "torch.distributed._tensor.api")},
        **{
            (module, name): stand_in
            for module in (f"{_DT}._dtensor_spec", "torch.distributed._tensor.placement_types")
            for name, stand_in in (("DTensorSpec", _DTensorSpec), ("TensorMeta", _DTensorMeta))
        },
        **{
            (module, name): stand_in
            for module in (f"{_DT}.placement_types", "torch.distributed._tensor.placement_types")
            for name, stand_in in (
                ("Shard", _Shard1D),
                ("Replicate", _Replicate),
                ("_StridedShard", _inert("_StridedShard")),
                ("Partial", _inert("Partial")),
                ("_Partial", _inert("Partial")),
            )
        },
        (f"{_DT}._dtensor_spec", "ShardOrderEntry"): _inert("ShardOrderEntry"),
        ("torch.distributed.device_mesh", "DeviceMesh"): _DeviceMesh,
        ("torch.distributed._mesh_layout", "_MeshLayout"): _inert("_MeshLayout"),
        ("torch.distributed._mesh_layout", "_FlatLayout"): _inert("_FlatLayout"),
    }


def _restricted_module(unpickler: type) -> types.ModuleType:
    """A pickle module for torch.load(pickle_module=...) whose Unpickler is `unpickler` (torch subclasses it)."""
    module = types.ModuleType(f"fsdp_legacy_restricted_{unpickler.__name__}")
    module.Unpickler = unpickler  # type: ignore[attr-defined]
    module.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]
    module.load = lambda file, **kwargs: unpickler(file, **kwargs).load()  # type: ignore[attr-defined]
    return module


_RANK_FILE_PICKLE = _restricted_module(_RankFileUnpickler)


def load_rank_file(path: str) -> Any:
    """One rank's torch.save file of a state dict, memory-mapped, each ShardedTensor or DTensor as LocalShards.

    This is the one torch.load without weights_only=True, and still safe: weights_only's unpickler cannot be given
    more globals for one call, so the pickle module passed here is a restricted one whose find_class resolves only an
    explicit allowlist (torch's tensor rebuild functions, torch.Size/device, dtypes, OrderedDict; torch itself maps
    storages to dtype holders) and maps ShardedTensor and DTensor, their rebuild and their state classes (metadata,
    placements, DeviceMesh) to inert stand-ins (no __setstate__ of theirs, no process group). Any other global is
    refused before it is imported.
    """
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):  # torch's values
        raise CheckpointError(
            f"{path} is a per-rank state dict file, which holds ShardedTensors or DTensors and is read with a "
            "restricted pickle module, but TORCH_FORCE_WEIGHTS_ONLY_LOAD is set and makes torch refuse any pickle "
            "module: unset it for this conversion (the restricted loader still runs no code from the file)."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_RANK_FILE_PICKLE, mmap=True)
    except Refused as refused:
        raise CheckpointError(
            f"{path} names {refused}, which a per-rank LOCAL state dict file never holds: refused: this loader never "
            "runs code from a checkpoint. Use a checkpoint from a trusted source, saved with torch.save(model."
            "state_dict()) under LOCAL_STATE_DICT or SHARDED_STATE_DICT (or of a fully_shard model)."
        ) from None
    except (
        pickle.UnpicklingError,
        RuntimeError,
        EOFError,
        OSError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
    ) as error:
        raise _corrupted(path, error) from None
