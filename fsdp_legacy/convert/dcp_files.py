"""A torch.distributed.checkpoint (DCP) directory as a checkpoint, read and written by one process with no process
group.

Reading does not go through dcp.load, which unpickles `.metadata` and every non-tensor item without restriction: the
metadata is unpickled with only DCP's own metadata classes allowed, and every item (a torch.save archive at an offset
of a `.distcp` file) is CRC-checked and loaded with weights_only=True, one tensor at a time.

Writing goes through dcp.save (so the files are DCP's own), planned from tensors on the meta device: a planner
materialises each tensor from the source only when the writer asks for it, and can store a tensor as several chunks
(a LOCAL checkpoint's flat parameters, one chunk per rank as N ranks would have saved them). Each item goes to a file
of its own, since DCP's writer holds every tensor of a file until the file is done.

Every data file written here ends with a stamp of the save's identity (the save id DCP's writer puts in `.metadata`),
after the items, where DCP never reads: a directory whose files carry different ones (or some none) mixes saves and
is refused by the reader. What each item holds is covered by the CRC-32s of its torch.save archive, checked on read,
and every file by the CRC-32 in the side file (side_file.py), which also carries a LOCAL checkpoint's layout records.
"""

import dataclasses
import glob
import io
import json
import math
import os
import struct
import time
import traceback
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from .atomic import atomic_directory
from .checkpoint import Checkpoint, Chunk, Path, TensorMeta, dotted, unflatten
from .dcp_metadata import read_metadata
from .errors import CheckpointError
from .integrity import check_archive
from .loading import safe_load
from .record import FlatParamRecord
from .seals import Seals
from .side_file import SIDE_FILE, SideFile, check_files, file_crc, read_side_file, write_side_file

METADATA_FILE = ".metadata"
_STAMP = b"\nfsdp_legacy-save"  # ends every data file written here, after the JSON of the save identity and its size


def is_dcp(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_FILE))


@dataclasses.dataclass(frozen=True)
class _Stored:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


class DcpCheckpoint(Checkpoint):
    def __init__(self, path: str) -> None:
        self.location = path
        metadata = read_metadata(os.path.join(path, METADATA_FILE))
        storage = metadata.storage_data
        if not isinstance(storage, Mapping) or any(
            type(v).__name__ != "_StorageInfo" or getattr(v, "transform_descriptors", None) for v in storage.values()
        ):
            raise CheckpointError(
                f"{path} was written by a DCP storage writer other than FileSystemWriter without "
                "extensions (or compresses its items): only that layout can be read offline."
            )
        stored = {
            (index.fqn, tuple(index.offset) if index.offset is not None else None): info
            for index, info in storage.items()
        }
        check_stamps(path, metadata, storage)
        side = read_side_file(path)
        if side is None:
            refuse_unfinished(path, data_files(metadata))
        else:
            check_side_file(path, side, metadata)
            # .metadata's CRC-32 here; each item's bytes are covered by its archive's CRC-32s, checked when read (a
            # whole-file check of every data file is dcp_checkpoint.load's, spread over the ranks).
            check_files(path, side, [METADATA_FILE] if METADATA_FILE in side.files else [])
            self.side_records = {r.flat_key: r for r in side.records.get("model", side.records.get("", ()))}
        self._side = side
        # (every value below was checked by read_metadata: types, chunks tiling each tensor, planner_data's paths)
        mapping = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
        self._items: dict[Path, list[_Stored]] = {}
        self.leaves = {}
        sizes: dict[str, int] = {}  # file -> its size
        for key, entry in metadata.state_dict_metadata.items():
            leaf_path: Path = tuple(mapping.get(key, (key,)))
            if isinstance(entry, TensorStorageMetadata):
                dtype = entry.properties.dtype
                items = [self._locate(stored, key, tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
                for item in items:
                    self._check_extent(item, key, math.prod(item.sizes or ()) * dtype.itemsize, sizes)
                self._items[leaf_path] = items
                self.leaves[leaf_path] = TensorMeta(torch.Size(entry.size), dtype)
            elif isinstance(entry, BytesStorageMetadata):
                item = self._locate(stored, key, None, None)
                self._check_extent(item, key, 0, sizes)
                self.leaves[leaf_path] = self._load(item, key)
        if not any(p[0] == "model" for p in self.leaves) and all(len(p) == 1 for p in self.leaves):
            self._items = {("model", *p): v for p, v in self._items.items()}  # dcp.save(model.state_dict())
            self.leaves = {("model", *p): v for p, v in self.leaves.items()}
        self._cache: tuple[_Stored | None, Any] = (None, None)  # the last item read: flat slices reuse it

    def check_items(self, files: Collection[str] | None = None) -> None:
        """Every tensor item (of `files`, default all) against its archive's CRC-32s and the dtype and shape
        `.metadata` declares for it: CheckpointError naming the file and the tensor of the first that is not."""
        for path, items in self._items.items():
            for item in items:
                if files is None or item.file in files:
                    self._tensor(item, path)
        self._cache = (None, None)

    def data_file_names(self) -> list[str]:
        return sorted({item.file for items in self._items.values() for item in items})

    def _name_the_item(self, name: str) -> None:
        """For a data file whose CRC-32 differs from the side file's: raise the error of the first of its items whose
        archive, dtype or shape is wrong (it names the tensor); return where every item reads right (the damage is
        elsewhere in the file: its stamp, say)."""
        self.check_items([name])

    def _check_extent(self, item: _Stored, key: str, nbytes: int, sizes: dict[str, int]) -> None:
        """The item lies inside its file and has room for the chunk's bytes (a torch.save archive stores them
        uncompressed): a size in `.metadata` that its items cannot hold is refused before anything is allocated."""
        file = os.path.join(self.location, item.file)
        if item.file not in sizes:
            try:
                sizes[item.file] = os.path.getsize(file)
            except OSError:
                raise CheckpointError(
                    f"{file}, which holds {key}, is missing: the checkpoint is incomplete (copy every file of the "
                    "directory)."
                ) from None
        if item.offset + item.length > sizes[item.file]:
            raise CheckpointError(
                f"{file} holds {sizes[item.file]} bytes, but the item of {key} ends at byte "
                f"{item.offset + item.length}: it is truncated."
            )
        if item.length < nbytes:
            raise CheckpointError(
                f"{self.location}/{METADATA_FILE} is damaged: the chunk of {key} at {item.offsets} takes {nbytes} "
                f"bytes, but its item in {item.file} holds {item.length}."
            )

    def verify_seals(self) -> Seals:
        """With our side file: every file against its CRC-32 there (the save identities were checked on opening).
        Without (a plain dcp.save): every tensor item against its archive's CRC-32s and the dtype and shape
        `.metadata` declares for it."""
        if self._side is not None:
            for name in sorted(self._side.files):
                try:
                    check_files(self.location, self._side, [name])
                except CheckpointError as error:
                    self._name_the_item(name)  # which tensor's bytes changed, where an item's archive says
                    raise error from None
            return Seals(
                (
                    f"CRC-32 of every file ({SIDE_FILE})",
                    "one save (the save identity in every data file and in the side file)",
                ),
            )
        self.check_items()
        return Seals(
            ("CRC-32s of every item's torch.save archive", "every item's dtype and shape against .metadata"),
            (
                f"no {SIDE_FILE} (written by dcp.save itself): no save identity and no CRC-32 of .metadata or of whole "
                "files, so a file of another save with the same layout is not seen",
            ),
        )

    def _locate(self, stored: Mapping, key: str, offsets: Any, sizes: Any) -> _Stored:
        info = stored.get((key, offsets))
        if info is None:
            raise CheckpointError(
                f"{self.location}/{METADATA_FILE} lists {key} but not where it is stored: the "
                "metadata is damaged. Restore the checkpoint from a copy."
            )
        return _Stored(offsets, sizes, str(info.relative_path), int(info.offset), int(info.length))

    def read(self, path: Path) -> torch.Tensor:
        meta = self.leaves[path]
        out = torch.empty(meta.shape, dtype=meta.dtype)
        for item in self._items[path]:
            region = tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes, strict=True))
            out[region].copy_(self._tensor(item, path))
        return out

    def read_flat(self, path: Path, start: int, stop: int) -> torch.Tensor:
        if len(self.leaves[path].shape) != 1:
            return super().read_flat(path, start, stop)
        out = torch.empty(stop - start, dtype=self.leaves[path].dtype)
        for item in self._items[path]:
            lo, hi = max(start, item.offsets[0]), min(stop, item.offsets[0] + item.sizes[0])
            if lo < hi:
                piece = self._tensor(item, path)[lo - item.offsets[0] : hi - item.offsets[0]]
                out[lo - start : hi - start].copy_(piece)
        return out

    def chunks(self, path: Path) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
        return [(item.offsets, item.sizes) for item in self._items[path]]

    def _tensor(self, item: _Stored, path: Path) -> torch.Tensor:
        if self._cache[0] != item:
            self._cache = (None, None)  # release the previous item first
            value = self._load(item, dotted(path))
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != item.sizes:
                raise CheckpointError(
                    f"{self.location}/{item.file}: the item of {dotted(path)} at offset "
                    f"{item.offset} is not the tensor chunk of shape {item.sizes} the metadata "
                    "lists: the checkpoint is damaged."
                )
            if value.dtype != self.leaves[path].dtype:  # refused, never cast: the bytes are not what was saved
                raise CheckpointError(
                    f"{self.location}/{item.file}: the item of {dotted(path)} at offset {item.offset} holds "
                    f"{value.dtype} data, but {METADATA_FILE} declares {self.leaves[path].dtype}: the checkpoint is "
                    "damaged or was edited."
                )
            if not _as_dcp_writes(value):
                raise CheckpointError(
                    f"{self.location}/{item.file}: the item of {dotted(path)} at offset {item.offset} is a view "
                    f"(storage offset {value.storage_offset()}, strides {value.stride()}, of a storage of "
                    f"{value.untyped_storage().nbytes()} bytes) where dcp.save writes each tensor in a storage of "
                    "its own bytes: the checkpoint is damaged or was edited."
                )
            self._cache = (item, value)
        return self._cache[1]

    def _load(self, item: _Stored, key: str) -> Any:
        file = os.path.join(self.location, item.file)
        where = f"{file} (the item of {key} at byte {item.offset})"
        try:
            handle = open(file, "rb")
        except FileNotFoundError:
            raise CheckpointError(
                f"{file}, which holds {key}, is missing: the checkpoint is incomplete (copy every "
                "file of the directory)."
            ) from None
        with handle:
            view = io.BufferedReader(_Slice(handle, item.offset, item.length))
            check_archive(view, where)
            view.seek(0)
            return safe_load(view, where)


def _as_dcp_writes(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lies in a storage of exactly its own bytes, each element once (any order of dimensions): how
    dcp.save writes every item (it clones any tensor that is a view of a larger storage)."""
    if tensor.numel() == 0:
        return True
    if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return False
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(tensor.shape, tensor.stride(), strict=True) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def check_stamps(directory: str, metadata: Metadata, storage: Mapping) -> None:
    """Refuse a directory whose data files are not all of the save its metadata describes (stamped by write_dcp;
    a directory with no stamped file was written by another writer and has nothing to check)."""
    extents: dict[str, int] = {}  # file -> the end of its last item
    for info in storage.values():
        name = str(info.relative_path)
        extents[name] = max(extents.get(name, 0), int(info.offset) + int(info.length))
    stamps = {name: _stamp_of(os.path.join(directory, name), extent) for name, extent in sorted(extents.items())}
    if not any(kind == "save" for kind, _ in stamps.values()):
        return
    expected = getattr(metadata.storage_meta, "save_id", None)
    wrong = {
        name: f"of save {stamp}" if kind == "save" else kind
        for name, (kind, stamp) in stamps.items()
        if kind != "unreadable" and stamp != expected
    }
    unstamped = all(what == "no save identity" for what in wrong.values())
    if wrong and unstamped and not os.path.exists(os.path.join(directory, SIDE_FILE)):
        raise CheckpointError(
            f"{directory} is an unfinished save: DCP wrote its files, but the save stopped before every data file "
            f"carried its identity and before its {SIDE_FILE} was written ({', '.join(wrong)} not yet stamped): a "
            "rank was killed or failed during the save. Use an earlier checkpoint (fsdp_legacy.checkpoint.latest "
            "finds the newest complete one)."
        )
    if wrong:
        listed = ", ".join(f"{name} ({what})" for name, what in wrong.items())
        raise CheckpointError(
            f"{directory} mixes the files of different saves: its {METADATA_FILE} is of save {expected}, but {listed}: "
            "a file was copied from another checkpoint or left from an earlier save. Restore the whole directory from "
            "one save."
        )


def _stamp_of(path: str, extent: int) -> tuple[str, str | None]:
    """What a data file says of its save, past `extent` (the end of its items): ("save", id); ("no save identity",
    None) when nothing follows the items; ("a damaged save identity", None); or ("unreadable", None) when the file is
    missing or shorter than its items (reported as such when they are read)."""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, io.SEEK_END)
            if size <= extent:
                return ("unreadable", None) if size < extent else ("no save identity", None)
            file.seek(extent)
            tail = file.read()
    except OSError:
        return "unreadable", None
    record, length, stamp = tail[: -len(_STAMP) - 8], tail[-len(_STAMP) - 8 : -len(_STAMP)], tail[-len(_STAMP) :]
    try:
        if stamp != _STAMP or struct.unpack("<Q", length)[0] != len(record):
            raise ValueError
        save_id = json.loads(record)["save_id"]
        if not isinstance(save_id, str):
            raise ValueError
    except (ValueError, KeyError, TypeError, struct.error):
        return "a damaged save identity", None
    return "save", save_id


def ends_with_stamp(path: str) -> bool:
    """Whether a data file ends with a save stamp of ours (written before the side file, which completes a save)."""
    try:
        with open(path, "rb") as file:
            file.seek(max(0, file.seek(0, io.SEEK_END) - len(_STAMP)))
            return file.read() == _STAMP
    except OSError:
        return False


def refuse_unfinished(directory: str, names: Iterable[str]) -> None:
    """For a directory without a side file: refuse it where its data files carry our stamps (or a side file was
    being written), as a save through fsdp_legacy that did not finish, or whose side file was lost: read as a plain
    dcp.save, it would lose every CRC-32 and identity check its saver made."""
    stamped = [n for n in names if ends_with_stamp(os.path.join(directory, n))]
    if stamped or glob.glob(os.path.join(glob.escape(directory), f"{SIDE_FILE}.tmp-*")):
        raise CheckpointError(
            f"{directory} was being saved through fsdp_legacy.dcp_checkpoint.save, which writes {SIDE_FILE} (the "
            "CRC-32s) last, but it has none: the save did not finish (or the file was lost)."
        )


def check_side_file(directory: str, side: SideFile, metadata: Metadata) -> None:
    """The side file must be of the save `.metadata` describes."""
    expected = getattr(metadata.storage_meta, "save_id", None)
    if side.save_id != expected:
        raise CheckpointError(
            f"{directory} mixes the files of different saves: its {METADATA_FILE} is of save {expected}, but "
            f"{SIDE_FILE} is of save {side.save_id}: a file was copied from another checkpoint or left from an "
            "earlier save. Restore the whole directory from one save."
        )


def written_metadata(returned: Metadata | None, directory: str) -> Metadata:
    """The metadata of a save that dcp.save just wrote to `directory`: what it returned, or, where that lacks the
    files and the save's identity (torch 2.11) or is missing, what it wrote."""
    if returned is not None and returned.storage_data is not None:
        return returned
    return read_metadata(os.path.join(directory, METADATA_FILE))


def data_files(metadata: Metadata) -> list[str]:
    return sorted({str(info.relative_path) for info in metadata.storage_data.values()})


def save_id_of(metadata: Metadata) -> str | None:
    return getattr(metadata.storage_meta, "save_id", None)


def stamp_file(path: str, save_id: str) -> None:
    """Append the save's identity to one of its data files, after its items, where DCP never reads."""
    record = json.dumps({"save_id": save_id}).encode()
    with open(path, "ab") as file:
        file.write(record + struct.pack("<Q", len(record)) + _STAMP)


def _stamp(directory: str, metadata: Metadata, records: Mapping[str, Iterable[FlatParamRecord]]) -> None:
    """Append the save's identity to each of its data files, then write the side file (records and CRC-32s)."""
    save_id = save_id_of(metadata)
    if not save_id:
        return
    names = data_files(metadata)
    for name in names:
        stamp_file(os.path.join(directory, name), save_id)
    crcs = {name: file_crc(os.path.join(directory, name)) for name in [*names, METADATA_FILE]}
    write_side_file(directory, save_id, records, crcs, saved_at=time.time())


class _Slice(io.RawIOBase):
    """A read-only window [start, start + length) of an open file."""

    def __init__(self, file: io.BufferedReader, start: int, length: int) -> None:
        self._file, self._start, self._length, self._position = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self._length - self._position))
        self._file.seek(self._start + self._position)
        count = self._file.readinto(memoryview(buffer)[:count]) or 0
        self._position += count
        return count

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position


# --------------------------------------------------------------------------------------------------------------------
# Writing


def write_dcp(
    source: Checkpoint,
    destination: str,
    chunks: Mapping[Path, list[Chunk]],
    on_tensor: Callable[[Path, int], None],
    before_commit: Callable[[str], None] | None = None,
) -> None:
    """Write `source` as a DCP checkpoint, atomically, holding one source tensor in memory at a time; a tensor
    listed in `chunks` is stored as those pieces, the others whole. `before_commit(temporary directory)` runs once it
    is complete, before it replaces `destination`."""
    with atomic_directory(destination) as temporary:
        tree = unflatten(
            {
                path: torch.empty(leaf.shape, dtype=leaf.dtype, device="meta") if isinstance(leaf, TensorMeta) else leaf
                for path, leaf in source.leaves.items()
            }
        )
        # One file per item: FileSystemWriter keeps every tensor of a file alive until the file is complete.
        writer = FileSystemWriter(
            temporary, single_file_per_rank=False, sync_files=True, thread_count=1, per_thread_copy_ahead=0
        )
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                metadata = dcp.save(
                    tree, storage_writer=writer, planner=_StreamingPlanner(source, chunks, on_tensor), no_dist=True
                )
        except CheckpointException as wrapped:  # DCP wraps what the source raised (a damaged item, a full disk, ...)
            failure = next(iter(wrapped.failures.values()))[0]
            if isinstance(failure, RuntimeError) and _raised_by_torch_save(failure):  # a short write: a full disk
                raise OSError(f"torch.save could not write an item ({failure})") from None
            raise failure from None
        records = {"model": source.side_records.values()} if source.side_records else {}
        _stamp(temporary, written_metadata(metadata, temporary), records)
        if before_commit is not None:
            before_commit(temporary)


def _raised_by_torch_save(error: BaseException) -> bool:
    """Whether torch.save raised it: how its archive writer reports a write that failed ("unexpected pos")."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ is not None else []
    return any(frame.filename.endswith(os.path.join("torch", "serialization.py")) for frame in frames)


class _StreamingPlanner(DefaultSavePlanner):
    def __init__(self, source: Checkpoint, chunks: Mapping[Path, list[Chunk]], on_tensor: Callable) -> None:
        super().__init__()
        self._source, self._on_tensor = source, on_tensor
        self._chunks = {dotted(path): pieces for path, pieces in chunks.items()}
        self._cache: tuple[str | None, torch.Tensor | None] = (None, None)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items: list[WriteItem] = []
        for item in plan.items:
            pieces = self._chunks.get(item.index.fqn)
            if pieces is None or item.tensor_data is None:
                items.append(item)
                continue
            for offsets, sizes in pieces:
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                data = TensorWriteData(chunk=chunk, properties=item.tensor_data.properties, size=item.tensor_data.size)
                index = MetadataIndex(item.index.fqn, torch.Size(offsets))
                items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        if not (isinstance(value, torch.Tensor) and value.is_meta):
            return value
        if self._cache[0] != index.fqn:
            self._cache = (None, None)
            self._cache = (index.fqn, self._source.read(self.mappings[index.fqn]))
        return self._cache[1]

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        if write_item.tensor_data is not None:
            assert isinstance(data, torch.Tensor), "a tensor item resolves to a tensor"
            chunk = write_item.tensor_data.chunk
            data = data[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))]
            self._on_tensor(self.mappings[write_item.index.fqn], data.numel() * data.element_size())
        return data
