"""Damage done to checkpoints on disk, as a bad disk, a bad copy or a hand edit leaves them, for the tests of the
readers' checks (test_seals.py, test_malformed_inputs.py) and the fuzzer's mutations (mutations.py). Everything here
parses the formats by itself or with torch's own DCP reader, never with the code under test, so a reader cannot agree
with its own mistake."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp


def flip_bit(path: str, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ (1 << bit)]))


# --------------------------------------------------------------------------------------------------------------------
# safetensors


def safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    """A file's header as JSON, and where its data starts."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        return json.loads(file.read(length)), 8 + length


def largest_tensor(path: str) -> tuple[str, int]:
    """The name of a file's largest tensor and the offset of its first byte in the file."""
    header, start = safetensors_header(path)
    sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    name = max(sizes, key=lambda k: sizes[k])
    return name, start + header[name]["data_offsets"][0]


def rewrite_safetensors_header(path: str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a file's header in place, keeping its length (padded with spaces), so the data stays where it was."""
    header, start = safetensors_header(path)
    edit(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= start - 8, "the edited header must not grow past the original"
    with open(path, "r+b") as file:
        file.seek(8)
        file.write(encoded + b" " * (start - 8 - len(encoded)))


# --------------------------------------------------------------------------------------------------------------------
# torch.save archives


def data_record_offset(archive: bytes, minimum: int = 4) -> tuple[str, int]:
    """The name of the first data record of at least `minimum` bytes in a torch.save archive, and the offset of its
    first byte in `archive`."""
    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        record = next(i for i in opened.infolist() if "/data/" in i.filename and i.file_size >= minimum)
    name_length, extra_length = struct.unpack_from("<2H", archive, record.header_offset + 26)
    return record.filename, record.header_offset + 30 + name_length + extra_length


def tensors_holding(path: str, record: str) -> list[str]:
    """The dotted keys of the tensors of a full torch.save file (loaded by torch) whose storage's bytes are the
    record's: which tensors a damaged record damages."""
    with zipfile.ZipFile(path) as opened:
        data = opened.read(record)
    found: list[str] = []

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for name, item in value.items():
                walk(item, f"{key}.{name}" if key else str(name))
        elif isinstance(value, torch.Tensor) and bytes(value.untyped_storage()) == data:
            found.append(key)

    walk(torch.load(path, weights_only=True), "")
    return found


def pickle_offset(archive: bytes, needle: bytes) -> int:
    """Where `needle` first occurs inside the pickle (data.pkl) of a torch.save archive."""
    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        record = next(i for i in opened.infolist() if i.filename.endswith("data.pkl"))
    name_length, extra_length = struct.unpack_from("<2H", archive, record.header_offset + 26)
    start = record.header_offset + 30 + name_length + extra_length
    return start + archive[start : start + record.file_size].index(needle)


# --------------------------------------------------------------------------------------------------------------------
# DCP


def dcp_items(directory: str) -> dict[str, tuple[str, int, int]]:
    """Every tensor item of a DCP directory by its key (its first chunk's): (file, offset, length), read by torch."""
    metadata = dcp.FileSystemReader(directory).read_metadata()
    items = {}
    for index, info in metadata.storage_data.items():
        if index.offset is not None and index.fqn not in items:
            items[index.fqn] = (str(info.relative_path), int(info.offset), int(info.length))
    return items


def flip_in_item(directory: str, key: str) -> str:
    """Flip one bit in the tensor data of the item of `key`; the file it is in."""
    name, offset, length = dcp_items(directory)[key]
    path = os.path.join(directory, name)
    with open(path, "rb") as file:
        file.seek(offset)
        archive = file.read(length)
    _, start = data_record_offset(archive)
    flip_bit(path, offset + start)
    return path


def rewrite_metadata(directory: str, edit: Callable[[Any], None]) -> None:
    """`.metadata` read by torch's reader, edited, and pickled back (the classes DCP allows, hostile values)."""
    metadata = dcp.FileSystemReader(directory).read_metadata()
    edit(metadata)
    with open(os.path.join(directory, ".metadata"), "wb") as file:
        pickle.dump(metadata, file)


def set_record_field(path: str, field: str, value: int, record: int = 0) -> None:
    """Set a 2-byte field ("flags" or "method", the compression method) of a zip archive's `record`-th entry in its
    central directory, in place: what zipfile reads when it opens the record (the local header is left alone)."""
    with open(path, "rb") as file:
        archive = file.read()
    end = archive.rfind(b"PK\x05\x06")
    (central,) = struct.unpack_from("<I", archive, end + 16)
    for _ in range(record):  # each entry: 46 bytes, then its name, extra field and comment
        central += 46 + sum(struct.unpack_from("<3H", archive, central + 28))
    with open(path, "r+b") as file:
        file.seek(central + {"flags": 8, "method": 10}[field])
        file.write(struct.pack("<H", value))
