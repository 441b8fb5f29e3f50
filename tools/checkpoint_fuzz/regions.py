"""Where the bytes of a checkpoint are: which ranges of which file hold tensor data and which hold a header (a
safetensors header, a torch.save archive's pickle and zip headers, DCP's `.metadata`, our side file), so that a
mutation can aim at either. Parsed independently of the readers under test (the zip format by hand, DCP's items
with torch's own reader), on the intact copy."""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch.distributed.checkpoint as dcp


@dataclass(frozen=True)
class Region:
    file: str  # relative to the checkpoint (empty for a checkpoint that is one file)
    start: int
    end: int
    data: bool  # tensor data (True) or a header, a pickle, metadata (False)
    what: str


def files_of(checkpoint: Path) -> list[str]:
    """The files of a checkpoint, relative to it, sorted ("" for a checkpoint that is one file)."""
    if checkpoint.is_file():
        return [""]
    return sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())


def archive_regions(archive: bytes, file: str, base: int = 0, label: str = "") -> list[Region]:
    """The records of a torch.save archive (at `base` in `file`): data records as data, the pickle, the small records
    and every zip header (local headers, the central directory) as headers."""
    found: list[Region] = []
    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        for info in opened.infolist():
            name_length, extra_length = struct.unpack_from("<2H", archive, info.header_offset + 26)
            data_start = info.header_offset + 30 + name_length + extra_length
            record = info.filename.split("/", 1)[-1]
            header = f"{label}zip header of {record}"
            found.append(Region(file, base + info.header_offset, base + data_start, False, header))
            is_data = record.startswith("data/") and record[5:].isdigit()
            what = f"{label}record {record}" + (" (the pickle)" if record == "data.pkl" else "")
            if info.file_size:
                found.append(Region(file, base + data_start, base + data_start + info.file_size, is_data, what))
    end_record = archive.rfind(b"PK\x05\x06")  # the end of central directory record holds where the directory starts
    (directory,) = struct.unpack_from("<I", archive, end_record + 16)
    found.append(Region(file, base + directory, base + len(archive), False, f"{label}zip central directory"))
    return found


def safetensors_regions(path: Path, file: str) -> list[Region]:
    raw = path.read_bytes()
    (length,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + length])
    found = [Region(file, 0, 8, False, "the header's length"), Region(file, 8, 8 + length, False, "the header")]
    for name, entry in header.items():
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            if end > begin:
                found.append(Region(file, 8 + length + begin, 8 + length + end, True, f"the data of {name}"))
    return found


def dcp_regions(directory: Path) -> list[Region]:
    """Every item of a DCP directory (a torch.save archive for tensors and pickled objects), the stamp after them
    (ours), `.metadata` and the side file."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    found: list[Region] = []
    ends: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        file, start, length = str(info.relative_path), int(info.offset), int(info.length)
        ends[file] = max(ends.get(file, 0), start + length)
        with open(directory / file, "rb") as handle:
            handle.seek(start)
            item = handle.read(length)
        label = f"the item of {index.fqn}{'' if index.offset is None else ' ' + str(tuple(index.offset))}: "
        if zipfile.is_zipfile(io.BytesIO(item)):
            found.extend(archive_regions(item, file, start, label))
        else:
            found.append(Region(file, start, start + length, True, label.rstrip(": ")))
    for file, end in ends.items():
        size = os.path.getsize(directory / file)
        if size > end:
            found.append(Region(file, end, size, False, "the save stamp after the items"))
    for name in (".metadata", ".fsdp_legacy.json"):
        if (directory / name).exists():
            found.append(Region(name, 0, os.path.getsize(directory / name), False, name))
    return found


def regions_of(checkpoint: Path) -> list[Region]:
    """Every region of every file of an intact checkpoint of ours."""
    if checkpoint.is_file():
        return archive_regions(checkpoint.read_bytes(), "")
    if (checkpoint / ".metadata").exists():
        return dcp_regions(checkpoint)
    found: list[Region] = []
    for file in files_of(checkpoint):
        path = checkpoint / file
        if file.endswith(".safetensors"):
            found.extend(safetensors_regions(path, file))
        elif file.endswith(".pt"):
            found.extend(archive_regions(path.read_bytes(), file))
        else:
            found.append(Region(file, 0, path.stat().st_size, False, file))
    return found
