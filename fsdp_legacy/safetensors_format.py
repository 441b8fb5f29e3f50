"""The safetensors file format and Hugging Face's layout of a directory of them, as `save_pretrained` writes it: what
state/hf_checkpoint.py (save_full_model / load_full_model) and the offline converter (convert/safetensors_files.py,
convert/rank_files.py) share. It sits below both, so that the model-free converter never imports state/.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte range
in the data, plus "__metadata__"), then the raw bytes, row-major. A directory holds `model.safetensors`, or
`model-0000i-of-0000N.safetensors` files plus `model.safetensors.index.json` (`metadata.total_size`, `weight_map`).
No dependency on the safetensors package: writing needs only a header, then each tensor's bytes where they belong.
"""

import contextlib
import json
import math
import os
import re
import struct
import uuid
import zlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "BIN_INDEX",
    "BIN_WEIGHTS",
    "BY_NAME",
    "DTYPES",
    "SAFE_INDEX",
    "SAFE_WEIGHTS",
    "SAVED_AT",
    "SAVE_ID",
    "DATA_CRC32",
    "HEADER_CRC32",
    "TENSOR_CRC32",
    "SafetensorsHeader",
    "SafetensorsWriter",
    "Stored",
    "WeightsDirectory",
    "mixed_saves",
    "new_save_id",
    "parse_size",
    "plan_shards",
    "pread_into",
    "data_crc32",
    "read_safetensors_header",
    "shard_names",
    "write_index",
]

SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_WEIGHTS, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
BY_NAME = {name: dtype for dtype, name in DTYPES.items()}
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_WRITE_CHUNK = 32 * 2**20  # elements per write: bounds the buffer of a cast (or device-to-host copy)
_MAX_HEADER = 100_000_000  # the safetensors package refuses longer headers
# The identity of one save, repeated in the __metadata__ of each of its files and in its index: a directory whose files
# name different ones was mixed from several saves.
SAVE_ID = "fsdp_legacy_save_id"
SAVED_AT = "fsdp_legacy_saved_at"  # when the save began, seconds since the epoch: which save is newest (latest.py)
# The CRC-32 of the file's data (every byte after the header), 8 hex digits: safetensors itself has no checksum, so a
# flipped bit in tensor data would load silently. Written last, into a placeholder of the same length in the header.
DATA_CRC32 = "fsdp_legacy_data_crc32"
# The CRC-32 of each tensor's bytes, 8 hex digits per tensor in the order of their names: a flipped bit is then named
# by its tensor. And a CRC-32 over the header itself (every name, dtype, shape and offset, and the other metadata), so a
# renamed key or a permuted shape is seen too. Both are filled by seal(), as DATA_CRC32 is.
TENSOR_CRC32 = "fsdp_legacy_tensor_crc32"
HEADER_CRC32 = "fsdp_legacy_header_crc32"
_CRC_PLACEHOLDER = "--------"
_READ_BLOCK = 16 * 2**20


def parse_size(size: int | str) -> int:
    """A shard size in bytes, from an int or a string such as '5GB' (decimal) or '2GiB' (binary), as transformers
    reads max_shard_size."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]+)\s*", size)
    if match is None or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"max_shard_size={size!r}: give an int (bytes) or a string such as '5GB', '500MB' or '2GiB'")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def plan_shards(nbytes: Sequence[int], max_size: int) -> list[list[int]]:
    """huggingface_hub's split of tensors (by their sizes, in order) into files, as lists of indices: a new file when
    the next tensor would overflow this one; a tensor larger than max_size gets a file of its own. Never empty."""
    shards: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, count in enumerate(nbytes):
        if count > max_size:
            shards.append([index])
            continue
        if size + count > max_size and current:
            shards.append(current)
            current, size = [], 0
        current.append(index)
        size += count
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int, single: str) -> list[str]:
    """`single` for one file, else transformers' `stem-0000i-of-0000N.ext` names."""
    if count == 1:
        return [single]
    stem, ext = single.rsplit(".", 1)
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.{ext}" for i in range(count)]


def write_index(path: str, weight_map: dict[str, str], metadata: dict[str, Any]) -> None:
    """The index file of a sharded directory, formatted as transformers writes it."""
    index = {"metadata": metadata, "weight_map": weight_map}
    with open(path, "w") as file:
        file.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


class SafetensorsWriter:
    """One safetensors file written out of order: the header first (every tensor's place is known from its shape and
    dtype), then each tensor's bytes at its offset, in pieces, whenever they come."""

    def __init__(
        self,
        path: str,
        tensors: Sequence[tuple[str, Sequence[int], torch.dtype]],
        metadata: Mapping[str, str] | None = None,
        checksum: bool = False,
    ) -> None:
        """`checksum`: the header gets DATA_CRC32, TENSOR_CRC32 and HEADER_CRC32, filled by `seal()` once every byte
        is written."""
        names = sorted(key for key, _, _ in tensors)
        seals = {DATA_CRC32: 8, TENSOR_CRC32: 8 * len(names), HEADER_CRC32: 8} if checksum else {}
        header: dict[str, Any] = {
            "__metadata__": {"format": "pt", **(metadata or {}), **{k: "-" * n for k, n in seals.items()}}
        }
        self.offsets: dict[str, tuple[int, torch.dtype]] = {}
        self._spans: dict[str, tuple[int, int]] = {}
        offset = 0
        for key, shape, dtype in tensors:
            if dtype not in DTYPES:
                raise ValueError(f"{key}: safetensors cannot store {dtype}")
            end = offset + math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            self.offsets[key] = (offset, dtype)
            self._spans[key] = (offset, end)
            offset = end
        self._header, self._names = header, names
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.data_start = 8 + len(encoded)
        self._places: dict[str, int] = {}  # seal key -> where seal() writes its digits
        for key, length in seals.items():
            pair = f'"{key}":"{"-" * length}"'.encode()
            self._places[key] = 8 + encoded.index(pair) + len(pair) - 1 - length
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)  # (read back by seal())
        try:
            _pwrite(self.fd, struct.pack("<Q", len(encoded)) + encoded, 0)
            os.ftruncate(self.fd, self.data_start + offset)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, key: str, first: int, piece: torch.Tensor) -> None:
        """Elements [first, first + piece.numel()) of the flattened tensor `key`, cast to its dtype in the file."""
        offset, dtype = self.offsets[key]
        position = self.data_start + offset + first * dtype.itemsize
        flat = piece.reshape(-1)
        for start in range(0, flat.numel(), _WRITE_CHUNK):
            chunk = flat[start : start + _WRITE_CHUNK].to(device="cpu", dtype=dtype).contiguous()
            _pwrite(self.fd, chunk.view(torch.uint8).numpy().data, position)
            position += chunk.numel() * dtype.itemsize

    def seal(self) -> None:
        """Every tensor is written: put the CRC-32s of the data, of each tensor and of the header into the header
        (the data read back from the file, since the pieces arrive in any order)."""
        if not self._places:
            return
        by_name, whole = tensor_crc32s(self.fd, self.data_start, self._spans)
        values = {
            DATA_CRC32: f"{whole:08x}",
            TENSOR_CRC32: "".join(f"{by_name[name]:08x}" for name in self._names),
        }
        metadata = {**self._header["__metadata__"], **values}
        tensors = {k: v for k, v in self._header.items() if k != "__metadata__"}
        values[HEADER_CRC32] = f"{header_crc32(tensors, metadata):08x}"
        for key, value in values.items():
            _pwrite(self.fd, value.encode(), self._places[key])

    def close(self) -> None:
        os.close(self.fd)


def data_crc32(fd: int, data_start: int) -> int:
    """The CRC-32 of an open file's bytes from `data_start` to its end."""
    crc, position = 0, data_start
    while block := os.pread(fd, _READ_BLOCK, position):
        crc = zlib.crc32(block, crc)
        position += len(block)
    return crc


def tensor_crc32s(fd: int, data_start: int, spans: Mapping[str, tuple[int, int]]) -> tuple[dict[str, int], int]:
    """The CRC-32 of each tensor's bytes (`spans`: name -> [begin, end) in the data, tiling it) and of the whole
    data, in one pass over the file. ValueError where the file ends early."""
    crcs: dict[str, int] = {}
    whole = 0
    for name, (begin, end) in sorted(spans.items(), key=lambda item: item[1]):
        crc, position = 0, data_start + begin
        while position < data_start + end:
            block = os.pread(fd, min(_READ_BLOCK, data_start + end - position), position)
            if not block:
                raise ValueError(f"the file ends inside the data of {name}: it was cut short")
            crc = zlib.crc32(block, crc)
            whole = zlib.crc32(block, whole)
            position += len(block)
        crcs[name] = crc
    return crcs, whole


def header_crc32(tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> int:
    """The seal over a header: every tensor's entry and the metadata (but this seal), in a canonical encoding, so it
    is the same however the JSON was spaced or ordered."""
    body = {
        "metadata": {k: v for k, v in metadata.items() if k != HEADER_CRC32},
        "tensors": {k: [v["dtype"], list(v["shape"]), list(v["data_offsets"])] for k, v in tensors.items()},
    }
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _pwrite(fd: int, data: Any, position: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written


def new_save_id() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class Stored:
    """Where one tensor's bytes lie in a safetensors file."""

    dtype: torch.dtype
    shape: torch.Size
    start: int  # first byte, from the start of the file
    nbytes: int


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, Stored]
    metadata: dict[str, str]
    data_start: int  # the first byte after the header

    @property
    def save_id(self) -> str | None:
        return self.metadata.get(SAVE_ID)

    @property
    def data_sealed(self) -> bool:
        """Whether the header records a CRC-32 of the data (save_full_model's, the converter's)."""
        return DATA_CRC32 in self.metadata or TENSOR_CRC32 in self.metadata

    @property
    def header_sealed(self) -> bool:
        """Whether the header carries a seal of its own (checked by read_safetensors_header)."""
        return HEADER_CRC32 in self.metadata

    @property
    def sealed_per_tensor(self) -> bool:
        """Whether the header records a CRC-32 for each tensor, so that tensors can be checked one by one."""
        return TENSOR_CRC32 in self.metadata

    def data_crc_problem(self, path: str, only: Collection[str] | None = None) -> str | None:
        """None when the file's data matches the CRC-32s its header records (or it records none), else why not,
        naming the tensors whose bytes changed where the header records a CRC-32 per tensor. `only`: check just
        these tensors (their own CRC-32s; the header must record them, `sealed_per_tensor`)."""
        per_tensor, whole = self.metadata.get(TENSOR_CRC32), self.metadata.get(DATA_CRC32)
        if per_tensor is None and whole is None:
            return None
        if _CRC_PLACEHOLDER in (whole, (per_tensor or "")[:8]):
            return f"{path} was never sealed: the save that wrote it did not finish"
        start = self.data_start
        checked = self.tensors if only is None else {key: self.tensors[key] for key in only}
        assert only is None or per_tensor is not None, "tensors are checked one by one against per-tensor CRC-32s"
        spans = {key: (t.start - start, t.start - start + t.nbytes) for key, t in checked.items()}
        fd = os.open(path, os.O_RDONLY)
        try:
            crcs, actual = tensor_crc32s(fd, self.data_start, spans)
        except ValueError as error:
            return f"{path}: {error}"
        finally:
            os.close(fd)
        if per_tensor is not None:
            names = sorted(self.tensors)
            recorded = [per_tensor[8 * i : 8 * i + 8] for i in range(len(names))]
            changed = [
                name for name, crc in zip(names, recorded, strict=True) if name in crcs and f"{crcs[name]:08x}" != crc
            ]
            if changed:
                listed = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
                return (
                    f"{path}: the data of {listed} does not match the CRC-32 its header records for it (the data "
                    "changed after saving)"
                )
        if only is None and whole is not None and f"{actual:08x}" != whole:
            return (
                f"{path}: its tensor data does not match the CRC-32 its header records (the data changed after saving)"
            )
        return None


def read_safetensors_header(path: str) -> SafetensorsHeader:
    """A file's tensors and metadata, checked against the file before any tensor is read, as the safetensors package
    checks them: every dtype known, every byte count the dtype x the shape, and the tensors' bytes tiling the data
    exactly (none past the end of the file, none over another's, no byte of no tensor). A lying header would otherwise
    show up as one tensor silently wrong, or as an error on only the rank whose shard reads the missing bytes.
    ValueError naming the file and the first problem found."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        prefix = file.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is too short for a safetensors file ({size} bytes): it is truncated or not one")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(size - 8, _MAX_HEADER):
            raise ValueError(
                f"{path}: its header length ({length} bytes) runs past the end of the file ({size} bytes) or past the "
                "format's limit: it is truncated or not a safetensors file"
            )
        try:
            header = json.loads(file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: its header is not JSON ({error}): the file is damaged") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its header is a {type(header).__name__}, not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: its __metadata__ is not a map of strings to strings")
    data_start, data_size = 8 + length, size - 8 - length
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, Stored] = {}
    for key, entry in header.items():
        try:
            dtype, shape, (begin, end) = BY_NAME[entry["dtype"]], entry["shape"], entry["data_offsets"]
            if not all(type(n) is int and n >= 0 for n in (*shape, begin, end)) or begin > end:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{path}: the header entry of {key} is malformed or of an unknown dtype: {entry!r:.200}"
            ) from None
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(
                f"{path}: {key} holds {end - begin} bytes, but a {tuple(shape)} {dtype} tensor takes "
                f"{math.prod(shape) * dtype.itemsize}: the header is damaged"
            )
        tensors[key] = Stored(dtype, torch.Size(shape), data_start + begin, end - begin)
        spans.append((begin, end, key))
    spans.sort()
    beyond = next((span for span in spans if span[1] > data_size), None)
    if beyond is not None:
        raise ValueError(
            f"{path} is cut short: {beyond[2]}'s bytes [{beyond[0]}, {beyond[1]}) of its data lie past the end of the "
            f"file, which holds {data_size} bytes of data: it is truncated or its header is damaged"
        )
    reached, last = 0, ""
    for begin, end, key in spans:
        if begin < reached:
            raise ValueError(
                f"{path}: {key}'s bytes [{begin}, {end}) overlap {last}'s: its header is damaged (each tensor must "
                "have bytes of its own)"
            )
        if begin > reached:
            raise ValueError(f"{path}: bytes [{reached}, {begin}) of its data belong to no tensor: it is damaged")
        reached, last = end, key
    if reached != data_size:
        raise ValueError(
            f"{path}: {data_size - reached} bytes follow the last tensor's data: it is damaged, or not what its header "
            "says"
        )
    _check_header_seal(path, header, metadata)
    return SafetensorsHeader(tensors, metadata, data_start)


def _check_header_seal(path: str, entries: Mapping[str, Any], metadata: Mapping[str, str]) -> None:
    """ValueError unless the header matches the seal its writer put in it (files without one pass: save_pretrained's,
    earlier fsdp_legacy's). Our writers put the per-tensor CRC-32s and the header seal in together, so a file with
    only one of them lost the other's key to damage."""
    seal, per_tensor = metadata.get(HEADER_CRC32), metadata.get(TENSOR_CRC32)
    if seal is None and per_tensor is None:
        return
    if seal is None or per_tensor is None or len(per_tensor) != 8 * len(entries):
        raise ValueError(
            f"{path}: its header's seals ({HEADER_CRC32}, {TENSOR_CRC32}) are incomplete or do not fit its "
            f"{len(entries)} tensors: the header is damaged"
        )
    if seal == _CRC_PLACEHOLDER:
        raise ValueError(f"{path} was never sealed: the save that wrote it did not finish")
    if seal != f"{header_crc32(entries, metadata):08x}":
        raise ValueError(
            f"{path}: its header (tensor names, dtypes, shapes, offsets or metadata) does not match the CRC-32 seal "
            f"its writer recorded ({HEADER_CRC32}): it was edited or damaged after saving"
        )


def pread_into(fd: int, position: int, buffer: torch.Tensor, what: str) -> None:
    """Fill the contiguous CPU tensor `buffer` with the file's bytes from `position` on (ValueError if it ends)."""
    view = memoryview(buffer.view(torch.uint8).numpy().data).cast("B") if buffer.numel() else memoryview(b"")
    while view:
        read = os.preadv(fd, [view], position)
        if read == 0:
            raise ValueError(f"{what} ends before the data of a tensor: the file was cut short while being read")
        view, position = view[read:], position + read


def mixed_saves(save_ids: Mapping[str, str | None], where: str) -> str | None:
    """The error for files (name -> their save identity) of one directory that come from different saves."""
    if len(set(save_ids.values())) < 2:
        return None
    by_id: dict[str | None, list[str]] = {}
    for name, save_id in save_ids.items():
        by_id.setdefault(save_id, []).append(name)
    listed = "; ".join(f"{', '.join(names)}: {f'save {i}' if i else 'no save identity'}" for i, names in by_id.items())
    return (
        f"{where} mixes the files of different saves ({listed}): a file was copied from another checkpoint or left "
        "from an earlier save. Restore the whole directory from one save."
    )


# --------------------------------------------------------------------------------------------------------------------
# A directory of full weights


class WeightsDirectory:
    """The tensors of a checkpoint directory by name: (file, shape, dtype) from the files' headers, and reads of a
    range of elements. Opening it checks everything that can be checked without reading the data, so that a damaged
    or mixed directory is refused before the model is touched: each safetensors header against its file (as the
    safetensors package does), the index against the headers, and that every file is of one save. A range of a
    row-major tensor is one contiguous run of bytes in a safetensors file, so it is read with pread straight into its
    destination; torch.save files are memory-mapped and sliced."""

    def __init__(self, directory: str, stack: contextlib.ExitStack) -> None:
        found = [name for name in (SAFE_INDEX, SAFE_WEIGHTS, BIN_INDEX, BIN_WEIGHTS) if _exists(directory, name)]
        if not found:
            raise FileNotFoundError(
                f"{directory} holds none of {SAFE_WEIGHTS}, {SAFE_INDEX}, {BIN_WEIGHTS}, {BIN_INDEX}: not a directory "
                "written by save_full_model or save_pretrained."
            )
        self.safe = found[0] in (SAFE_INDEX, SAFE_WEIGHTS)
        files = [found[0]]
        weight_map: dict[str, str] | None = None
        save_ids: dict[str, str | None] = {}
        if found[0] in (SAFE_INDEX, BIN_INDEX):
            weight_map, save_ids[found[0]] = _read_index(os.path.join(directory, found[0]))
            files = sorted(set(weight_map.values()))
        self.meta: dict[str, tuple[str, torch.Size, Any]] = {}
        self._where: dict[str, tuple[int, Stored]] = {}  # safetensors: key -> (descriptor, where its bytes are)
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}
        self.headers: dict[str, SafetensorsHeader] = {}  # safetensors: each file's header, by file name
        self.directory = directory
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}, named in {found[0]}, is missing: copy every file of the directory.")
            if self.safe:
                try:
                    header = read_safetensors_header(path)
                except ValueError as error:
                    raise RuntimeError(f"{error}. Restore the file from a copy; nothing was loaded.") from None
                fd = os.open(path, os.O_RDONLY)
                stack.callback(os.close, fd)
                save_ids[name] = header.save_id
                self.headers[name] = header
                contents = {key: (stored.shape, stored.dtype) for key, stored in header.tensors.items()}
                self._where.update((key, (fd, stored)) for key, stored in header.tensors.items())
            else:  # torch.save files cannot be read in part: each is loaded whole (memory-mapped) on every rank
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except Exception as error:
                    raise RuntimeError(f"{path} cannot be read: {error}. Restore it from a copy.") from None
                self._loaded[name] = state
                contents = {key: (value.shape, value.dtype) for key, value in state.items()}
            for key, (shape, dtype) in contents.items():
                if key in self.meta:
                    raise RuntimeError(
                        f"{key} is in both {self.meta[key][0]} and {name} of {directory}: the directory mixes saves. "
                        "Restore the whole directory from one save."
                    )
                self.meta[key] = (name, shape, dtype)
        mixed = mixed_saves(save_ids, directory)
        if mixed is not None:
            raise RuntimeError(mixed)
        if weight_map is not None and weight_map != {key: file for key, (file, _, _) in self.meta.items()}:
            raise RuntimeError(
                f"{directory}/{found[0]} does not list the tensors its files hold (or names other files for them): the "
                "directory is incomplete or mixes saves. Restore it from one save."
            )

    def data_crc_problem(self, share: tuple[int, int] = (0, 1)) -> str | None:
        """Why the data of this process's `share` (index, count) of the safetensors files' sealed tensors does not
        match the CRC-32s their headers record, or None. The work is split by tensor where the headers record a
        CRC-32 per tensor (so one file is checked by all ranks together), else by file; files with no seal (written
        by save_pretrained) are not checked."""
        work: list[tuple[int, str, str | None]] = []  # (bytes, file, tensor or None for the whole file)
        for name, header in sorted(self.headers.items()):
            if header.sealed_per_tensor:
                work += [(stored.nbytes, name, key) for key, stored in sorted(header.tensors.items())]
            elif header.data_sealed:
                work.append((sum(stored.nbytes for stored in header.tensors.values()), name, None))
        work.sort(key=lambda item: (-item[0], item[1], item[2] or ""))  # the largest first, dealt round the ranks
        whole: set[str] = set()  # files checked as a whole (one CRC-32 of all their data)
        tensors: dict[str, list[str]] = {}  # file -> the tensors of it to check
        for _, name, key in work[share[0] :: share[1]]:
            if key is None:
                whole.add(name)
            else:
                tensors.setdefault(name, []).append(key)
        for name in sorted(whole | set(tensors)):
            problem = self.headers[name].data_crc_problem(
                os.path.join(self.directory, name), None if name in whole else tensors[name]
            )
            if problem is not None:
                return problem
        return None

    def read_into(self, key: str, first: int, target: torch.Tensor) -> None:
        """Elements [first, first + target.numel()) of the flattened tensor `key` into the 1-D `target`."""
        name, _, dtype = self.meta[key]
        if not self.safe:
            target.copy_(self._loaded[name][key].reshape(-1)[first : first + target.numel()])
            return
        direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
        buffer = target if direct else torch.empty(target.numel(), dtype=dtype)
        fd, stored = self._where[key]
        pread_into(fd, stored.start + first * dtype.itemsize, buffer, name)
        if not direct:
            target.copy_(buffer)


def _read_index(path: str) -> tuple[dict[str, str], str | None]:
    try:
        with open(path) as file:
            index = json.load(file)
        weight_map, metadata = index["weight_map"], index.get("metadata") or {}
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("its weight_map is not a map of tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise RuntimeError(f"{path} is not a readable index ({error}): restore it from a copy.") from None
    return weight_map, metadata.get(SAVE_ID) if isinstance(metadata, dict) else None


def _exists(directory: str, name: str) -> bool:
    return os.path.isfile(os.path.join(directory, name))
