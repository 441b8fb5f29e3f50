"""Hostile content: pickles that would run code if unpickled (each makes a marker directory, so that a run can tell
that it happened), torch.save archives rebuilt around such a pickle with valid CRC-32s (so that only the unpickler
stands between it and the reader), and values of DCP's own allowlisted metadata classes that no saver writes."""

from __future__ import annotations

import io
import os
import pickle
import random
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp


class _Runs:
    """Unpickled, calls `function(*args)`: pickle's REDUCE, which any global the unpickler resolves can reach."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.function, self.args


def code_pickles(marker: Path) -> dict[str, bytes]:
    """Pickles that make `marker` (a directory) when unpickled, by name."""
    make = f"import os; os.mkdir({str(marker)!r})"
    return {
        "posix.mkdir": pickle.dumps(_Runs(os.mkdir, str(marker))),
        "builtins.exec": pickle.dumps(_Runs(exec, make)),
        "a state dict holding builtins.eval": pickle.dumps(
            {"model": {"weight": [0.0, 1.0]}, "optim": _Runs(eval, f"__import__('os').mkdir({str(marker)!r})")}
        ),
    }


def rebuilt_archive(archive: bytes, replace: Callable[[str, bytes], bytes]) -> bytes:
    """A torch.save archive with each record's bytes passed through `replace(name, bytes)`, written afresh (so every
    CRC-32 and offset of the zip is valid)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            target.writestr(info.filename, replace(info.filename, source.read(info)))
    return out.getvalue()


def with_pickle(archive: bytes, payload: bytes) -> bytes:
    return rebuilt_archive(archive, lambda name, data: payload if name.endswith("data.pkl") else data)


def replace_dcp_item(directory: Path, index: Any, item: bytes) -> None:
    """Put `item` in place of the item of `index` (a MetadataIndex) of a DCP directory, moving the items after it in
    their file and rewriting `.metadata` to match: the directory stays consistent for DCP's own reader."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    info = metadata.storage_data[index]
    file = directory / str(info.relative_path)
    raw = file.read_bytes()
    start, end = int(info.offset), int(info.offset) + int(info.length)
    file.write_bytes(raw[:start] + item + raw[end:])
    shift = len(item) - (end - start)
    for other_info in metadata.storage_data.values():
        if other_info.relative_path == info.relative_path and int(other_info.offset) >= end:
            other_info.offset += shift
    info.length = len(item)
    with open(directory / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)


# --------------------------------------------------------------------------------------------------------------------
# Hostile values of DCP's metadata classes (each edits `.metadata` as torch's reader returns it, in place)


def _tensor_entries(metadata: Any) -> list[str]:
    return sorted(k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks"))


def _some_tensor(metadata: Any, rng: random.Random) -> Any:
    return metadata.state_dict_metadata[rng.choice(_tensor_entries(metadata))]


def _some_storage(metadata: Any, rng: random.Random) -> Any:
    return metadata.storage_data[rng.choice(sorted(metadata.storage_data, key=str))]


def _chunk(metadata: Any, rng: random.Random) -> Any:
    return rng.choice(_some_tensor(metadata, rng).chunks)


HOSTILE_VALUES: dict[str, Callable[[Any, random.Random], None]] = {
    "a chunk list of None": lambda m, r: setattr(_some_tensor(m, r), "chunks", None),
    "a dict where the chunk list belongs": lambda m, r: setattr(_some_tensor(m, r), "chunks", {"0": 1}),
    "a chunk of negative size": lambda m, r: setattr(_chunk(m, r), "sizes", torch.Size([-3, 2])),
    "a chunk offset of 2**62": lambda m, r: setattr(_chunk(m, r), "offsets", torch.Size([2**62])),
    "a tensor of 2**40 x 2**40 elements": lambda m, r: setattr(_some_tensor(m, r), "size", torch.Size([2**40] * 2)),
    "a size of None": lambda m, r: setattr(_some_tensor(m, r), "size", None),
    "properties of None": lambda m, r: setattr(_some_tensor(m, r), "properties", None),
    "a dtype of complex128": lambda m, r: setattr(_some_tensor(m, r).properties, "dtype", torch.complex128),
    "storage_data as a list": lambda m, r: setattr(m, "storage_data", list(m.storage_data.values())),
    "state_dict_metadata of None": lambda m, r: setattr(m, "state_dict_metadata", None),
    "an item of length 2**62": lambda m, r: setattr(_some_storage(m, r), "length", 2**62),
    "an item of negative offset": lambda m, r: setattr(_some_storage(m, r), "offset", -100),
    "an item past its file's end": lambda m, r: setattr(_some_storage(m, r), "offset", 10**9),
    "an item in ../../outside": lambda m, r: setattr(_some_storage(m, r), "relative_path", "../../outside.distcp"),
    "an item in an absolute path": lambda m, r: setattr(_some_storage(m, r), "relative_path", "/etc/hostname"),
    "an item's path of None": lambda m, r: setattr(_some_storage(m, r), "relative_path", None),
    "planner_data of a string": lambda m, r: setattr(m, "planner_data", "model"),
    "planner_data mapping keys to ints": lambda m, r: setattr(
        m, "planner_data", dict.fromkeys(m.planner_data or {}, 7)
    ),
    "100000 chunks of one element": lambda m, r: setattr(
        _some_tensor(m, r), "chunks", [type(_chunk(m, r))(torch.Size([0]), torch.Size([1]))] * 100_000
    ),
    "a tensor's entry of None": lambda m, r: m.state_dict_metadata.__setitem__(_tensor_entries(m)[0], None),
}


# --------------------------------------------------------------------------------------------------------------------
# Hostile values in torch.save's tensor rebuilds (each gives `_rebuild_tensor_v2` arguments that no save writes, with
# the archive's CRC-32s valid)

_Geometry = Callable[[torch.Tensor], tuple[int, Any, Any]]  # -> (offset, size, stride)

REBUILD_EDITS: dict[str, _Geometry] = {
    "a storage offset of 2**40": lambda t: (2**40, tuple(t.shape), t.stride()),
    "a storage offset of -1": lambda t: (-1, tuple(t.shape), t.stride()),
    "a size of 2**31 x 2**31": lambda t: (0, (2**31, 2**31), (2**31, 1)),
    "a negative size": lambda t: (0, (-1,), (1,)),
    "a size past its storage's end": lambda t: (0, (t.numel() + 1,), (1,)),
    "a stride of 0 (every element the first)": lambda t: (0, tuple(t.shape), (0,) * t.dim()),
    "a negative stride": lambda t: (t.numel() - 1, (t.numel(),), (-1,)),
    "the elements shifted by one": lambda t: (1, (t.numel() - 1,), (1,)),
    "a size of floats": lambda t: (0, tuple(float(s) for s in t.shape), t.stride()),
    "a size of None": lambda t: (0, None, t.stride()),
}


def _hostile_pickler(target: torch.Tensor, geometry: _Geometry) -> Any:
    """A pickle module for torch.save whose Pickler writes `target`'s rebuild with `geometry`'s arguments."""
    from collections import OrderedDict

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if obj is not target:
                return NotImplemented
            storage = torch.storage.TypedStorage(wrap_storage=obj.untyped_storage(), dtype=obj.dtype, _internal=True)
            offset, size, stride = geometry(obj)
            return torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, False, OrderedDict())

    return types.SimpleNamespace(Pickler=Pickler, __name__="pickle")


def with_hostile_rebuild(archive: bytes, rng: random.Random, edit: str | None = None) -> tuple[bytes, str]:
    """The torch.save archive `archive` (tensors in plain containers) saved again with one tensor's rebuild given
    hostile arguments (REBUILD_EDITS[edit], or one drawn); what was done."""
    state = torch.load(io.BytesIO(archive), map_location="cpu", weights_only=True)
    tensors = [t for t in _tensors_in(state) if t.numel() > 0]
    target = rng.choice(tensors) if tensors else None
    if target is None:
        return archive, "no tensor with elements to rebuild: left intact"
    name = edit or rng.choice(sorted(REBUILD_EDITS))
    out = io.BytesIO()
    torch.save(state, out, pickle_module=_hostile_pickler(target, REBUILD_EDITS[name]))
    return out.getvalue(), f"a tensor of shape {tuple(target.shape)} rebuilt with {name}"


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []
