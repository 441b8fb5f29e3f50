"""The fuzzer's mutations: each takes a fresh copy of an intact checkpoint and a seeded random source, damages or
edits the copy, and says what it did, precisely enough to read (the case's id reproduces it exactly). Kinds: bit
flips in tensor data and in headers, truncations, deletions, appended bytes, header and metadata edits that stay
self-consistent (the seals then stand alone), hostile pickles, hostile values of DCP's metadata classes, files of two
saves mixed."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .damage import flip_bit, set_record_field
from .hostile import HOSTILE_VALUES, code_pickles, replace_dcp_item, with_hostile_rebuild, with_pickle
from .regions import Region, files_of


@dataclass(frozen=True)
class Source:
    """An intact checkpoint of one format, the same format from the other save, and where its bytes are."""

    name: str
    intact: Path
    other: Path
    regions: tuple[Region, ...]

    @property
    def files(self) -> list[str]:
        return files_of(self.intact)

    @property
    def is_dcp(self) -> bool:
        return (self.intact / ".metadata").exists()

    @property
    def is_safetensors(self) -> bool:
        return any(f.endswith(".safetensors") for f in self.files)

    @property
    def archives(self) -> list[str]:
        """Its torch.save files."""
        return [f for f in self.files if f == "" or f.endswith(".pt")]


Mutate = Callable[[Path, Source, random.Random, Path], str]  # (copy, source, rng, marker) -> what it did


def _at(copy: Path, file: str) -> Path:
    return copy / file if file else copy


def _named(file: str) -> str:
    return file or "the file"


def _category(region: Region) -> str:
    what = region.what.rsplit(": ", 1)[-1]
    for key in ("the pickle", "zip header", "central directory"):
        if key in what:
            return key
    return "a small record" if what.startswith("record ") else what


def _flip_in(copy: Path, region: Region, rng: random.Random) -> str:
    offset, bit = rng.randrange(region.start, region.end), rng.randrange(8)
    flip_bit(str(_at(copy, region.file)), offset, bit)
    return f"flipped bit {bit} of byte {offset} of {_named(region.file)} ({region.what})"


def flip_data(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    return _flip_in(copy, rng.choice([r for r in source.regions if r.data]), rng)


def flip_header(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    headers = [r for r in source.regions if not r.data]
    category = rng.choice(sorted({_category(r) for r in headers}))
    return _flip_in(copy, rng.choice([r for r in headers if _category(r) == category]), rng)


def _some_file(source: Source, rng: random.Random) -> tuple[str, int]:
    file = rng.choice(source.files)
    return file, os.path.getsize(_at(source.intact, file))


def flip_anywhere(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    file, size = _some_file(source, rng)
    return _flip_in(copy, Region(file, 0, size, False, "anywhere"), rng)


def truncate(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    file, size = _some_file(source, rng)
    length = rng.choice([0, rng.randrange(size), size - 1, size - rng.randrange(1, min(size, 64) + 1)])
    os.truncate(_at(copy, file), length)
    return f"truncated {_named(file)} to {length} of its {size} bytes"


def delete(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    file = rng.choice(source.files)
    os.remove(_at(copy, file))
    return f"deleted {file}"


def append(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    file = rng.choice(source.files)
    count = rng.choice([1, 8, 100, 4096])
    junk = rng.choice(
        [b"\0" * count, bytes(rng.randrange(256) for _ in range(count)), b"PK\x05\x06" * max(1, count // 4)]
    )
    with open(_at(copy, file), "ab") as handle:
        handle.write(junk)
    return f"appended {len(junk)} bytes ({junk[:8]!r}...) to {_named(file)}"


def mix(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    file = rng.choice([f for f in source.files if os.path.exists(source.other / f)])
    shutil.copy2(source.other / file, copy / file)
    return f"replaced {file} by the file of the same name from the other save"


# --------------------------------------------------------------------------------------------------------------------
# Self-consistent edits: the result is a well-formed file of its format, its seals untouched


def _read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def _rename_in_index(copy: Path, old: str, new: str) -> None:
    index = copy / "model.safetensors.index.json"
    if index.exists():
        body = json.loads(index.read_text())
        body["weight_map"][new] = body["weight_map"].pop(old)
        index.write_text(json.dumps(body, indent=2))


def edit_safetensors_header(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    file = rng.choice([f for f in source.files if f.endswith(".safetensors")])
    header, data = _read_safetensors(copy / file)
    names = sorted(k for k in header if k != "__metadata__")
    name = rng.choice(names)
    entry = header[name]
    edit = rng.choice(["rename", "permute", "swap", "dtype", "metadata"])
    if edit == "rename":
        at = rng.randrange(len(name))
        new = name[:at] + rng.choice([c for c in "abcxyz._0" if c != name[at]]) + name[at + 1 :]
        header[new] = header.pop(name)
        _rename_in_index(copy, name, new)
        what = f"renamed {name} to {new}"
    elif edit == "permute" and len(entry["shape"]) > 1 and len(set(entry["shape"])) > 1:
        entry["shape"] = entry["shape"][::-1]
        what = f"reversed the shape of {name} to {entry['shape']}"
    elif edit == "swap":
        same = [
            n
            for n in names
            if n != name
            and header[n]["data_offsets"][1] - header[n]["data_offsets"][0]
            == entry["data_offsets"][1] - entry["data_offsets"][0]
        ]
        if not same:
            return edit_safetensors_header(copy, source, rng, marker)
        other = rng.choice(same)
        entry["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], entry["data_offsets"]
        what = f"swapped the data offsets of {name} and {other}"
    elif edit == "dtype":
        entry["dtype"] = {"F32": "I32", "I64": "F64", "F64": "I64"}.get(entry["dtype"], "F32")
        what = f"declared {name} as {entry['dtype']}"
    else:
        metadata = header.setdefault("__metadata__", {})
        key = rng.choice(sorted(metadata) or ["format"])
        metadata[key] = rng.choice(["", "pt", "1e300", metadata.get(key, "x")[::-1]])
        what = f"set __metadata__[{key!r}] to {metadata[key]!r}"
    _write_safetensors(copy / file, header, data)
    return f"{file}: {what} (the header rewritten, offsets valid)"


def edit_index(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    index = copy / "model.safetensors.index.json"
    body = json.loads(index.read_text())
    weight_map = body["weight_map"]
    name = rng.choice(sorted(weight_map))
    edit = rng.choice(["elsewhere", "drop", "extra", "metadata"])
    if edit == "elsewhere":
        weight_map[name] = rng.choice(sorted(set(weight_map.values())) + ["../outside.safetensors"])
        what = f"pointed {name} at {weight_map[name]}"
    elif edit == "drop":
        del weight_map[name]
        what = f"removed {name}"
    elif edit == "extra":
        weight_map[name + ".extra"] = weight_map[name]
        what = f"listed {name}.extra in {weight_map[name]}"
    else:
        body["metadata"] = rng.choice([None, [], {"total_size": -1}, {"fsdp_legacy_save_id": "other"}])
        what = f"set its metadata to {body['metadata']!r}"
    index.write_text(json.dumps(body, indent=2))
    return f"model.safetensors.index.json: {what}"


def swap_dcp_metadata(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    """Two tensors' items (or their declarations) swapped in `.metadata`, consistently: still a valid DCP
    directory."""
    metadata = dcp.FileSystemReader(str(copy)).read_metadata()
    if rng.random() < 0.5:
        by_length: dict[int, list] = {}
        for index, info in metadata.storage_data.items():
            by_length.setdefault(int(info.length), []).append(index)
        pairs = sorted((v for v in by_length.values() if len(v) > 1), key=lambda v: str(v[0]))
        first, second = rng.sample(rng.choice(pairs), 2)
        storage = metadata.storage_data
        storage[first], storage[second] = storage[second], storage[first]
        what = f"swapped the items of {first.fqn} and {second.fqn} (same length)"
    else:
        by_size: dict[str, list[str]] = {}
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                by_size.setdefault(str(tuple(entry.size)), []).append(key)
        pairs = sorted((v for v in by_size.values() if len(v) > 1), key=lambda v: v[0])
        first, second = rng.sample(rng.choice(pairs), 2)
        table = metadata.state_dict_metadata
        table[first], table[second] = table[second], table[first]
        what = f"swapped the declarations of {first} and {second} (same size)"
    with open(copy / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    return f".metadata: {what}"


def edit_side_file(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    """A hostile value in the side file, its own checksum removed (as earlier versions wrote it, with none)."""
    path = copy / ".fsdp_legacy.json"
    body = json.loads(path.read_text())
    body.pop("checksum")
    field, value = rng.choice(
        [
            ("saved_at", 1e300),
            ("saved_at", -1),
            ("saved_at", "yesterday"),
            ("saved_at", True),
            ("files", []),
            ("files", {".metadata": "x"}),
            ("files", {"../../outside": 1}),
            ("files", {"": 0}),
            ("records", []),
            ("records", {"": [123]}),
            ("records", {"": ["{"]}),
            ("save_id", 7),
            ("save_id", "another-save"),
            ("version", 2),
            ("format", None),
        ]
    )
    body[field] = value
    path.write_text(json.dumps(body))
    return f".fsdp_legacy.json: {field} set to {value!r} (its checksum removed)"


def hostile_values(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    name = rng.choice(sorted(HOSTILE_VALUES))
    metadata = dcp.FileSystemReader(str(copy)).read_metadata()
    HOSTILE_VALUES[name](metadata, rng)
    with open(copy / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    return f".metadata: {name} (DCP's own classes, pickled)"


def hostile_pickle(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    kind, payload = rng.choice(sorted(code_pickles(marker).items()))
    if source.is_dcp:
        target = rng.choice([".metadata", "an item"])
        if target == ".metadata":
            (copy / ".metadata").write_bytes(payload)
            return f".metadata replaced by a pickle that runs {kind}"
        metadata = dcp.FileSystemReader(str(copy)).read_metadata()
        index = rng.choice(sorted(metadata.storage_data, key=str))
        info = metadata.storage_data[index]
        with open(copy / str(info.relative_path), "rb") as handle:
            handle.seek(int(info.offset))
            item = handle.read(int(info.length))
        replace_dcp_item(copy, index, with_pickle(item, payload))
        return f"the item of {index.fqn} rebuilt around a pickle that runs {kind} (valid CRC-32s, offsets moved)"
    file = rng.choice(source.archives)
    path = _at(copy, file)
    path.write_bytes(with_pickle(path.read_bytes(), payload))
    return f"{_named(file)}: its data.pkl replaced by a pickle that runs {kind} (the archive's CRC-32s valid)"


def edit_zip_entry(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    """A zip entry of a torch.save archive (the last archive of a DCP data file) that names another compression
    method or sets flags: what one flipped bit in its central directory can say."""
    file = rng.choice([f for f in source.files if f == "" or f.endswith((".pt", ".distcp"))])
    field, value = rng.choice([("method", 8), ("method", 12), ("method", 14), ("method", 99), ("flags", 0x09)])
    record = rng.randrange(3)
    set_record_field(str(_at(copy, file)), field, value, record)
    return f"{_named(file)}: the {field} of its zip entry {record} set to {value:#x}"


def hostile_rebuild(copy: Path, source: Source, rng: random.Random, marker: Path) -> str:
    """One tensor of a torch.save archive (a DCP item, or a whole torch.save file) rebuilt with a storage offset, size
    or stride that no save writes, the archive's CRC-32s valid (DCP: offsets moved, .metadata rewritten)."""
    if source.is_dcp:
        metadata = dcp.FileSystemReader(str(copy)).read_metadata()
        tensors = [
            i
            for i in metadata.storage_data
            if isinstance(metadata.state_dict_metadata.get(i.fqn), TensorStorageMetadata)
        ]
        index = rng.choice(sorted(tensors, key=str))
        info = metadata.storage_data[index]
        with open(copy / str(info.relative_path), "rb") as handle:
            handle.seek(int(info.offset))
            item, what = with_hostile_rebuild(handle.read(int(info.length)), rng)
        replace_dcp_item(copy, index, item)
        return f"the item of {index.fqn}: {what} (valid CRC-32s, offsets moved)"
    file = rng.choice([f for f in source.archives if f == "" or "rank" not in f])
    path = _at(copy, file)
    archive, what = with_hostile_rebuild(path.read_bytes(), rng)
    path.write_bytes(archive)
    return f"{_named(file)}: {what} (the archive's CRC-32s valid)"


@dataclass(frozen=True)
class Kind:
    name: str
    mutate: Mutate
    applies: Callable[[Source], bool]


def _always(source: Source) -> bool:
    return True


KINDS: tuple[Kind, ...] = (
    Kind("flip data", flip_data, _always),
    Kind("flip header", flip_header, _always),
    Kind("flip anywhere", flip_anywhere, _always),
    Kind("truncate", truncate, _always),
    Kind("delete", delete, lambda s: s.intact.is_dir()),
    Kind("append", append, _always),
    Kind("mix saves", mix, lambda s: len(s.files) > 1),
    Kind("edit header", edit_safetensors_header, lambda s: s.is_safetensors),
    Kind("edit index", edit_index, lambda s: (s.intact / "model.safetensors.index.json").exists()),
    Kind("swap metadata", swap_dcp_metadata, lambda s: s.is_dcp),
    Kind("edit side file", edit_side_file, lambda s: (s.intact / ".fsdp_legacy.json").exists()),
    Kind("edit zip entry", edit_zip_entry, lambda s: s.is_dcp or bool(s.archives)),
    Kind("hostile values", hostile_values, lambda s: s.is_dcp),
    Kind("hostile pickle", hostile_pickle, lambda s: s.is_dcp or bool(s.archives)),
    Kind("hostile rebuild", hostile_rebuild, lambda s: s.is_dcp or any(f == "" or "rank" not in f for f in s.archives)),
)
