"""Every unpickling the converter does: torch.load with weights_only=True (safe_load), and restricted unpicklers
that allow an explicit list of globals (DCP's `.metadata`, and per-rank torch.save files of LOCAL state dicts, whose
ShardedTensors weights_only refuses). Errors name the file and say what to do."""

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
    except (RuntimeError, EOFError, OSError, ValueError) as error:
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
        if name in self.allowed.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise Refused(f"{module}.{name}")


# A torch.save file of a LOCAL state dict pickles each flat parameter as a ShardedTensor:
#   _rebuild_from_type_v2(_rebuild_wrapper_subclass, ShardedTensor, (...), state)
#   state = (local_shards: [Shard(tensor, ShardMetadata)], ShardedTensorMetadata, ShardedTensor.ProcessGroupState,
#            sharding_spec, init_rrefs)
# ShardedTensor.__setstate__ needs a process group of the saving world size; instead, the rebuild maps to LocalShards
# below, and every class of the state to an inert stand-in that only stores what the pickle gives it.


@dataclass(frozen=True)
class LocalShards:
    """What one rank's file holds of a ShardedTensor: its local pieces (dim-0 offsets, tensor), the global shape and
    dtype, and the saving rank (global) and world size."""

    pieces: tuple[tuple[tuple[int, ...], torch.Tensor], ...]
    shape: torch.Size
    dtype: torch.dtype
    rank: int
    world_size: int


class _Inert:
    """Stand-in for a class of a ShardedTensor's state: stores its arguments and pickled state, runs nothing."""

    def __init__(self, *args: Any) -> None:
        self.args, self.state = args, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str) -> Any:
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots)
        if not isinstance(state, dict) or name not in state:
            raise pickle.UnpicklingError(f"a {type(self).__name__} without {name}")
        return state[name]


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
    """torch._tensor._rebuild_from_type_v2 for a ShardedTensor, without building one (func is never called)."""
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


def _never_called(*_: Any) -> None:
    raise Refused("torch._utils._rebuild_wrapper_subclass outside a ShardedTensor")


_SHARD = "torch.distributed._shard"


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
    """One rank's torch.save file of a LOCAL state dict, memory-mapped, each ShardedTensor as LocalShards.

    This is the one torch.load without weights_only=True, and still safe: weights_only's unpickler cannot be given
    more globals for one call, so the pickle module passed here is a restricted one whose find_class resolves only an
    explicit allowlist (torch's tensor rebuild functions, torch.Size/device, dtypes, OrderedDict; torch itself maps
    storages to dtype holders) and maps ShardedTensor, its rebuild and its state classes to inert stand-ins
    (no ShardedTensor.__setstate__, no process group). Any other global is refused before it is imported.
    """
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):  # torch's values
        raise CheckpointError(
            f"{path} is a per-rank LOCAL state dict file, which holds ShardedTensors and is read with a restricted "
            "pickle module, but TORCH_FORCE_WEIGHTS_ONLY_LOAD is set and makes torch refuse any pickle module: unset "
            "it for this conversion (the restricted loader still runs no code from the file)."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_RANK_FILE_PICKLE, mmap=True)
    except Refused as refused:
        raise CheckpointError(
            f"{path} names {refused}, which a per-rank LOCAL state dict file never holds: refused: this loader never "
            "runs code from a checkpoint. Use a checkpoint from a trusted source, saved with torch.save(model."
            "state_dict()) under LOCAL_STATE_DICT."
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
