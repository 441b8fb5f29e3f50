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
from collections.abc import Mapping, Sequence
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
        """`checksum`: the header gets DATA_CRC32, filled by `seal()` once every byte is written."""
        extra = {DATA_CRC32: _CRC_PLACEHOLDER} if checksum else {}
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {}), **extra}}
        self.offsets: dict[str, tuple[int, torch.dtype]] = {}
        offset = 0
        for key, shape, dtype in tensors:
            if dtype not in DTYPES:
                raise ValueError(f"{key}: safetensors cannot store {dtype}")
            end = offset + math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            self.offsets[key] = (offset, dtype)
            offset = end
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.data_start = 8 + len(encoded)
        pair = f'"{DATA_CRC32}":"{_CRC_PLACEHOLDER}"'.encode()  # where seal() writes the CRC-32's digits
        self._crc_at = 8 + encoded.index(pair) + len(pair) - 1 - len(_CRC_PLACEHOLDER) if extra else None
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
        """Every tensor is written: put the data's CRC-32 into the header (read back from the file, since the pieces
        arrive in any order)."""
        if self._crc_at is not None:
            crc = data_crc32(self.fd, self.data_start)
            _pwrite(self.fd, f"{crc:08x}".encode(), self._crc_at)

    def close(self) -> None:
        os.close(self.fd)


def data_crc32(fd: int, data_start: int) -> int:
    """The CRC-32 of an open file's bytes from `data_start` to its end."""
    crc, position = 0, data_start
    while block := os.pread(fd, _READ_BLOCK, position):
        crc = zlib.crc32(block, crc)
        position += len(block)
    return crc


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

    def data_crc_problem(self, path: str) -> str | None:
        """None when the file's data matches the CRC-32 its header records (or it records none), else why not."""
        recorded = self.metadata.get(DATA_CRC32)
        if recorded is None:
            return None
        fd = os.open(path, os.O_RDONLY)
        try:
            actual = f"{data_crc32(fd, self.data_start):08x}"
        finally:
            os.close(fd)
        if actual == recorded:
            return None
        if recorded == _CRC_PLACEHOLDER:
            return f"{path} was never sealed: the save that wrote it did not finish"
        return f"{path}: its tensor data does not match the CRC-32 its header records (the data changed after saving)"


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
    return SafetensorsHeader(tensors, metadata, data_start)


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
