"""The safetensors file format and Hugging Face's layout of a directory of them, as `save_pretrained` writes it: what
`hf_checkpoint` (save_full_model / load_full_model) and the offline converter (`--to safetensors`) share.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte range
in the data, plus "__metadata__"), then the raw bytes, row-major. A directory holds `model.safetensors`, or
`model-0000i-of-0000N.safetensors` files plus `model.safetensors.index.json` (`metadata.total_size`, `weight_map`).
No dependency on the safetensors package: writing needs only a header, then each tensor's bytes where they belong.
"""

import json
import math
import os
import re
import struct
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "BIN_INDEX",
    "BIN_WEIGHTS",
    "BY_NAME",
    "DTYPES",
    "SAFE_INDEX",
    "SAFE_WEIGHTS",
    "SafetensorsWriter",
    "parse_size",
    "plan_shards",
    "read_header",
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

    def __init__(self, path: str, tensors: Sequence[tuple[str, Sequence[int], torch.dtype]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
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
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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

    def close(self) -> None:
        os.close(self.fd)


def _pwrite(fd: int, data: Any, position: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """A file's JSON header and the byte where its data starts; ValueError when it is not a safetensors file."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        prefix = file.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is too short for a safetensors file ({size} bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > size - 8:
            raise ValueError(f"{path}: its header length ({length} bytes) runs past the end of the file")
        try:
            header = json.loads(file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its header is a {type(header).__name__}, not a JSON object")
    return header, 8 + length
