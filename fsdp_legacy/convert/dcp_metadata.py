"""DCP's `.metadata`, read without trusting it: unpickled with only DCP's own metadata classes allowed, then every
value those classes hold checked for the type and range DCP gives it, before any reader uses one. The allowlist
keeps code from running, but the classes are plain dataclasses whose fields a pickle can fill with anything (a chunk
list of None, a list where a dict belongs, a size that its chunks do not tile): here those are refused by name, as a
damaged metadata file, instead of surfacing as a TypeError or a wrong tensor further on.

What is checked: every key a str and every entry a TensorStorageMetadata (a dtype, a size of non-negative ints, chunks
that lie inside it and tile it exactly, no overlap, no gap) or a BytesStorageMetadata; `storage_data` a map of
MetadataIndex to a storage record with a relative file name inside the directory and a non-negative offset and
length; `planner_data`, where it is DCP's flattening map, naming for each key the path that spells it (a junk map
would otherwise rename the keys); the save id a str.
"""

import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .errors import CheckpointError
from .loading import Refused, RestrictedUnpickler

# Everything a DCP .metadata pickle may name; anything else could run code when unpickled.
METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
_EXACT_TILING_LIMIT = 4096  # chunks per tensor checked pairwise for overlap; beyond, along dimension 0 only


class _MetadataUnpickler(RestrictedUnpickler):
    allowed = METADATA_CLASSES


class _Damaged(Exception):
    """One value of the metadata that DCP never writes (the message says which)."""


def read_metadata(file: str) -> Metadata:
    """`.metadata` unpickled with the allowlist, then checked value by value (CheckpointError naming the file and
    the value)."""
    try:
        with open(file, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except Refused as refused:
        raise CheckpointError(
            f"{file} refers to {refused}, which DCP metadata never holds: unpickling it could run arbitrary code, so "
            "it is refused. Use a checkpoint from a trusted source."
        ) from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError, KeyError) as error:
        raise CheckpointError(
            f"{file} cannot be read: it is truncated or corrupted ({error}). Restore it from a "
            "copy or re-create the checkpoint."
        ) from None
    except (RecursionError, MemoryError, OverflowError) as error:
        raise CheckpointError(f"{file} cannot be read: it is corrupted ({type(error).__name__}).") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP metadata: not a DCP checkpoint.")
    try:
        check_metadata(metadata)
    except _Damaged as damaged:
        raise CheckpointError(
            f"{file} is damaged: {damaged}, which DCP never writes. Restore the checkpoint from a copy, or save it "
            "again."
        ) from None
    return metadata


def check_metadata(metadata: Metadata) -> None:
    """Raise _Damaged naming the first value of `metadata` that is not what DCP writes."""
    entries = _field(metadata, "state_dict_metadata")
    if not isinstance(entries, Mapping):
        raise _Damaged(f"its state_dict_metadata is a {type(entries).__name__}, not a dict")
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise _Damaged(f"its state_dict_metadata has the key {key!r:.80}, not a str")
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor(key, entry)
        elif not isinstance(entry, BytesStorageMetadata):
            raise _Damaged(f"its entry of {key} is a {type(entry).__name__}, not a tensor's or an object's")
    _check_storage(_field(metadata, "storage_data"))
    _check_planner_data(_field(metadata, "planner_data"), entries)
    storage_meta = _field(metadata, "storage_meta")
    if storage_meta is not None:
        if not isinstance(storage_meta, StorageMeta):
            raise _Damaged(f"its storage_meta is a {type(storage_meta).__name__}")
        save_id = _field(storage_meta, "save_id")
        if save_id is not None and not isinstance(save_id, str):
            raise _Damaged(f"its save id is a {type(save_id).__name__}, not a str")
    version = _field(metadata, "version")
    if version is not None and not isinstance(version, str):
        raise _Damaged(f"its version is a {type(version).__name__}, not a str")


def _field(value: Any, name: str) -> Any:
    """A dataclass field as unpickled: a pickle may leave it out (its default then applies, or it is damaged)."""
    try:
        return getattr(value, name)
    except AttributeError:
        raise _Damaged(f"its {type(value).__name__} has no {name}") from None


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise _Damaged(f"{what} is a {type(value).__name__}, not a sequence of ints")
    if not all(type(n) is int and n >= 0 for n in value):
        raise _Damaged(f"{what} is {tuple(value)!r:.80}, not non-negative ints")
    return tuple(value)


def _check_tensor(key: str, entry: TensorStorageMetadata) -> None:
    properties = _field(entry, "properties")
    if not isinstance(properties, TensorProperties) or not isinstance(_field(properties, "dtype"), torch.dtype):
        raise _Damaged(f"the properties of {key} hold no dtype")
    size = _ints(_field(entry, "size"), f"the size of {key}")
    chunks = _field(entry, "chunks")
    if not isinstance(chunks, list):
        raise _Damaged(f"the chunks of {key} are a {type(chunks).__name__}, not a list")
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, ChunkStorageMetadata):
            raise _Damaged(f"chunk {index} of {key} is a {type(chunk).__name__}, not a chunk")
        offsets = _ints(_field(chunk, "offsets"), f"the offsets of chunk {index} of {key}")
        sizes = _ints(_field(chunk, "sizes"), f"the sizes of chunk {index} of {key}")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise _Damaged(
                f"chunk {index} of {key} has {len(offsets)} offsets and {len(sizes)} sizes for a tensor of "
                f"{len(size)} dimensions"
            )
        if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
            raise _Damaged(f"chunk {index} of {key} at {offsets} of size {sizes} lies outside its size {size}")
        boxes.append((offsets, sizes))
    _check_tiling(key, size, boxes)


def _check_tiling(key: str, size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """The chunks cover the tensor exactly once: their elements add up to its own and no two overlap."""
    total = _numel(size)
    covered = sum(_numel(sizes) for _, sizes in boxes)
    if covered != total:
        raise _Damaged(f"the chunks of {key} hold {covered} elements, but its size {size} has {total}")
    boxes = [box for box in boxes if _numel(box[1])]
    if len(boxes) <= _EXACT_TILING_LIMIT:
        for i, (a_offsets, a_sizes) in enumerate(boxes):
            for b_offsets, b_sizes in boxes[i + 1 :]:
                if all(
                    ao < bo + bs and bo < ao + as_
                    for ao, as_, bo, bs in zip(a_offsets, a_sizes, b_offsets, b_sizes, strict=True)
                ):
                    raise _Damaged(f"two chunks of {key}, at {a_offsets} and {b_offsets}, overlap")
        return
    rows = sorted((offsets[0], offsets[0] + sizes[0]) for offsets, sizes in boxes)  # many chunks: dim 0 stripes
    reached = 0
    for begin, end in rows:
        if begin != reached:
            raise _Damaged(f"the chunks of {key} along its first dimension leave a gap or overlap at {begin}")
        reached = end


def _numel(sizes: Sequence[int]) -> int:
    count = 1
    for n in sizes:
        count *= n
    return count


def _check_storage(storage: Any) -> None:
    if storage is None:
        return
    if not isinstance(storage, Mapping):
        raise _Damaged(f"its storage_data is a {type(storage).__name__}, not a dict")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(_field(index, "fqn"), str):
            raise _Damaged(f"its storage_data has the key {index!r:.80}, not an index of a key")
        if index.offset is not None:
            _ints(index.offset, f"the storage index offset of {index.fqn}")
        if type(info).__name__ != "_StorageInfo":
            continue  # another storage writer's record: refused by the readers that need one (dcp_files)
        name = _field(info, "relative_path")
        if not isinstance(name, (str, os.PathLike)):
            raise _Damaged(f"the file of {index.fqn} is a {type(name).__name__}, not a file name")
        name = os.fspath(name)
        if not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
            raise _Damaged(f"the file of {index.fqn} is {name!r:.80}, not a file inside the checkpoint's directory")
        for what in ("offset", "length"):
            value = _field(info, what)
            if type(value) is not int or value < 0:
                raise _Damaged(f"the {what} of {index.fqn}'s item is {value!r:.40}, not a non-negative int")


def _check_planner_data(planner_data: Any, entries: Mapping[str, Any]) -> None:
    """DCP's flattening map names, for each flattened key, the path of the value in the saved tree; the key is that
    path joined by dots. Another planner's data (not a dict) is not used by the readers."""
    if not isinstance(planner_data, Mapping):
        return
    for key in entries:
        path = planner_data.get(key)
        if path is None:
            continue
        if not isinstance(path, (tuple, list)) or not path or not all(type(p) in (str, int) for p in path):
            raise _Damaged(f"its planner_data maps {key} to {path!r:.80}, not a path of str and int")
        if ".".join(map(str, path)) != key:
            raise _Damaged(f"its planner_data maps {key} to the path {'.'.join(map(str, path))!r:.80}")
