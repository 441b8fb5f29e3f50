"""Full model weights in Hugging Face's layout, saved and loaded streaming: `save_full_model` / `load_full_model`.

The layout is what `transformers`' `save_pretrained` writes: `model.safetensors`, or `model-0000i-of-0000N.safetensors`
files plus `model.safetensors.index.json` (`metadata.total_size`, `weight_map`), keyed by clean FQNs, tied weights
once (under their first name); `pytorch_model.bin` (and its sharded variant) with torch.save.

Saving never builds the state dict. Every name, shape and dtype is known from the units' layouts, so every rank plans
the files alike; rank 0 writes each safetensors header first, and then each parameter's bytes where they belong as the
pieces arrive: for each unit in turn, rank 0 takes its own shard's pieces and receives the other ranks' shards one at
a time (point to point, into one shard-sized buffer), so rank 0 holds at most one shard of one unit plus one write
buffer, and the other ranks hold nothing extra. Loading reads, on every rank, only the bytes of each tensor that its
shard holds (a range of a flattened tensor is one run of bytes in a safetensors file), straight into the local shard.
Neither needs the safetensors package: the format is a length, a JSON header and the raw bytes.
"""

import contextlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from .convert.atomic import atomic_directory
from .flat_param import FlatParameter, ParamInfo
from .handle import FlatParamHandle
from .naming import join_fqn
from .safetensors_io import (
    BIN_INDEX,
    BIN_WEIGHTS,
    BY_NAME,
    DTYPES,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    SafetensorsWriter,
    plan_shards,
    read_header,
    shard_names,
    write_index,
)
from .safetensors_io import parse_size as _parse_size
from .unit import FSDPUnit

__all__ = ["load_full_model", "save_full_model"]


@dataclass
class _Entry:
    """One tensor of the full model: a parameter inside a unit's flat parameter, or a tensor held whole (a parameter
    outside every unit, a persistent buffer)."""

    key: str
    shape: torch.Size
    dtype: torch.dtype  # as the FULL state dict gives it: the full-precision master, a buffer's original dtype
    aliases: list[str] = field(default_factory=list)  # tied references: not written, accepted on load
    unit: int = -1  # index of its handle, for a parameter in a flat parameter
    info: ParamInfo | None = None
    tensor: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _collect(model: nn.Module) -> tuple[list[_Entry], list[FlatParamHandle]]:
    """Every tensor of the model's full state dict, once, in module order (a unit's parameters together), and the
    handles. The same on every rank: it reads only the layouts and the registered tensors."""
    entries: list[_Entry] = []
    handles: list[FlatParamHandle] = []
    seen: dict[object, _Entry] = {}
    managed = {
        id(p) for m in model.modules() if isinstance(m, FSDPUnit) for h in m._handles for p in h.orig_params.values()
    }

    def add(identity: object, entry: _Entry) -> None:
        if identity in seen:
            seen[identity].aliases.append(entry.key)
        else:
            seen[identity] = entry
            entries.append(entry)

    def visit(module: nn.Module, path: str, unit: FSDPUnit | None, unit_path: str) -> None:
        if isinstance(module, FSDPUnit):
            unit, unit_path = module, path
            for handle in module._handles:  # (several in a unit whose parameters differ in dtype)
                if handle not in handles:
                    handles.append(handle)
                index, dtype = handles.index(handle), handle.local_shard.dtype
                for info in handle.layout.params:
                    add((index, info), _Entry(join_fqn(path, info.fqn), info.shape, dtype, unit=index, info=info))
                for shared in handle.layout.shared:
                    key = join_fqn(path, join_fqn(shared.module_name, shared.param_name))
                    add((index, shared.primary), _Entry(key, shared.primary.shape, dtype))
        for name, param in module._parameters.items():
            if param is not None and not isinstance(param, FlatParameter) and id(param) not in managed:
                add(id(param), _Entry(join_fqn(path, name), param.shape, param.dtype, tensor=param))
        for name, buffer in module._buffers.items():
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            key = join_fqn(path, name)
            relative = key[len(unit_path) + 1 :] if unit_path else key
            dtype = unit._buffer_dtypes.get(relative, buffer.dtype) if unit is not None else buffer.dtype
            add(id(buffer), _Entry(key, buffer.shape, dtype, tensor=buffer))
        for name, child in module._modules.items():
            if child is not None:
                visit(child, join_fqn(path, name), unit, unit_path)

    visit(model, "", None, "")
    return entries, handles


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _stream_unit(handle: FlatParamHandle, wanted: dict[ParamInfo, _Entry], sink: Callable | None) -> None:
    """Every rank calls it for the same unit and `wanted` parameters; rank 0's `sink(entry, first element, piece)`
    receives each piece of each wanted parameter. The other ranks of rank 0's shard group send the span of their
    shard holding wanted pieces, one rank at a time, into one buffer on rank 0."""
    me = dist.get_rank()
    if not handle.sharded:
        if me == 0 and sink is not None:
            for info, entry in wanted.items():
                sink(entry, 0, handle.local_shard[info.offset : info.offset + info.numel])
        return
    ranks = dist.get_process_group_ranks(handle.group)
    if 0 not in ranks:  # another replica (hybrid sharding): rank 0's shard group has it all
        return

    def span(group_rank: int) -> tuple[list, int, int]:
        pieces = [p for p in handle.layout.shard_pieces(group_rank) if p.info in wanted]
        if not pieces:
            return [], 0, 0
        return pieces, pieces[0].offset_in_shard, pieces[-1].offset_in_shard + pieces[-1].numel_in_shard

    if me != 0:
        pieces, lo, hi = span(handle.rank)
        if pieces:
            dist.send(handle.local_shard[lo:hi].to(_comm_device()).contiguous(), dst=0)
        return
    buffer: torch.Tensor | None = None
    for group_rank, global_rank in enumerate(ranks):
        pieces, lo, hi = span(group_rank)
        if not pieces:
            continue
        if global_rank == 0:
            shard = handle.local_shard[lo:hi]
        else:
            if buffer is None or buffer.numel() < hi - lo:
                buffer = torch.empty(handle.layout.shard_numel, dtype=handle.local_shard.dtype, device=_comm_device())
            shard = buffer[: hi - lo]
            dist.recv(shard, src=global_rank)
        for piece in pieces:
            start = piece.offset_in_shard - lo
            assert sink is not None
            sink(wanted[piece.info], piece.start_in_param, shard[start : start + piece.numel_in_shard])
    del buffer


def _plan(entries: list[_Entry], max_size: int, out: Callable[[_Entry], torch.dtype]) -> list[list[_Entry]]:
    groups = plan_shards([entry.numel * out(entry).itemsize for entry in entries], max_size)
    return [[entries[i] for i in group] for group in groups]


class _SafetensorsFile(SafetensorsWriter):
    def __init__(self, path: str, entries: list[_Entry], out: Callable[[_Entry], torch.dtype]) -> None:
        for entry in entries:
            if out(entry) not in DTYPES:
                raise ValueError(f"{entry.key}: safetensors cannot store {out(entry)}; pass safe_serialization=False")
        super().__init__(path, [(entry.key, entry.shape, out(entry)) for entry in entries])


def _write_piece(file: _SafetensorsFile, entry: _Entry, first: int, piece: torch.Tensor, dtype: torch.dtype) -> None:
    file.write(entry.key, first, piece)  # (a module-level seam: the atomicity test makes it fail)


@torch.no_grad()
def save_full_model(
    model: nn.Module,
    directory: str,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    safe_serialization: bool = True,
) -> None:
    """Write the model's full weights (clean FQNs, tied weights once) into `directory` in Hugging Face's layout, on
    rank 0; every rank must call it. Parameters are saved in their full-precision master dtype and buffers in their
    original dtype, or floating-point tensors cast to `dtype`.

    safetensors (the default) is streamed: rank 0's extra memory is one shard of one unit plus a write buffer, the
    other ranks' none. `safe_serialization=False` writes torch.save files, which cannot be streamed: each file is
    assembled in memory, so rank 0 holds up to `max_shard_size` bytes. The directory is replaced atomically: a failure
    leaves the previous one (or none) in place, and raises on every rank.
    """
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype}: only a floating-point dtype can be saved to")
    entries, handles = _collect(model)
    for handle in handles:
        handle.writeback_orig_params()  # use_orig_params: a replaced .data counts, as before an all-gather

    def out(entry: _Entry) -> torch.dtype:
        return dtype if dtype is not None and entry.dtype.is_floating_point else entry.dtype

    shards = _plan(entries, _parse_size(max_shard_size), out)
    names = shard_names(len(shards), SAFE_WEIGHTS if safe_serialization else BIN_WEIGHTS)
    writer = dist.get_rank() == 0
    failure: BaseException | None = None
    try:
        with contextlib.ExitStack() as stack:
            tmp = ""
            if writer:
                try:
                    tmp = stack.enter_context(atomic_directory(directory))
                except Exception as error:
                    failure = error
            sink_failure = _write_all(tmp, shards, names, handles, out, safe_serialization, failure is None and writer)
            failure = failure or sink_failure
            if writer and failure is None and len(shards) > 1:
                _write_index(tmp, shards, names, out, safe_serialization)
            if failure is not None:
                raise failure
    except Exception as error:
        if not writer:
            raise
        failure = error
    verdict = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    dist.broadcast_object_list(verdict, src=0)
    if failure is not None:
        raise failure
    if verdict[0] is not None:
        raise RuntimeError(f"save_full_model: rank 0 could not write {directory}: {verdict[0]}")


def _write_all(
    tmp: str,
    shards: list[list[_Entry]],
    names: list[str],
    handles: list[FlatParamHandle],
    out: Callable[[_Entry], torch.dtype],
    safe: bool,
    writing: bool,
) -> BaseException | None:
    """Stream every tensor to rank 0 and (while `writing`) write it. A failure on rank 0 stops the writing but not the
    transfers, so the other ranks are never left blocked in a send; it is returned."""
    failure: BaseException | None = None

    def guarded(write: Callable[[_Entry, int, torch.Tensor], None]) -> Callable[[_Entry, int, torch.Tensor], None]:
        def sink(entry: _Entry, first: int, piece: torch.Tensor) -> None:
            nonlocal failure
            if failure is None and writing:
                try:
                    write(entry, first, piece)
                except Exception as error:
                    failure = error

        return sink

    def by_unit(group: list[_Entry]) -> dict[int, dict[ParamInfo, _Entry]]:
        units: dict[int, dict[ParamInfo, _Entry]] = {}
        for entry in group:
            if entry.info is not None:
                units.setdefault(entry.unit, {})[entry.info] = entry
        return units

    if safe:
        files: dict[str, _SafetensorsFile] = {}
        with contextlib.ExitStack() as stack:
            if writing:
                try:
                    for shard, name in zip(shards, names, strict=True):
                        file = _SafetensorsFile(os.path.join(tmp, name), shard, out)
                        stack.callback(file.close)
                        files.update((entry.key, file) for entry in shard)
                except Exception as error:
                    failure = error
            sink = guarded(lambda e, first, piece: _write_piece(files[e.key], e, first, piece, out(e)))
            all_entries = [entry for shard in shards for entry in shard]
            for index, wanted in by_unit(all_entries).items():
                _stream_unit(handles[index], wanted, sink if writing else None)
            for entry in all_entries:
                if entry.tensor is not None:
                    sink(entry, 0, entry.tensor.detach())
        return failure
    for shard, name in zip(shards, names, strict=True):
        tensors = {e.key: torch.empty(e.shape, dtype=out(e)) for e in shard} if writing else {}

        def fill(entry: _Entry, first: int, piece: torch.Tensor, tensors: dict = tensors) -> None:
            tensors[entry.key].view(-1)[first : first + piece.numel()].copy_(piece.reshape(-1))

        sink = guarded(fill)
        for index, wanted in by_unit(shard).items():
            _stream_unit(handles[index], wanted, sink if writing else None)
        for entry in shard:
            if entry.tensor is not None:
                sink(entry, 0, entry.tensor.detach())
        if writing and failure is None:
            try:
                torch.save(tensors, os.path.join(tmp, name))
            except Exception as error:
                failure = error
        tensors.clear()
    return failure


def _write_index(
    tmp: str, shards: list[list[_Entry]], names: list[str], out: Callable[[_Entry], torch.dtype], safe: bool
) -> None:
    entries = [entry for shard in shards for entry in shard]
    metadata = {
        "total_parameters": sum(e.numel for e in entries if not _is_buffer(e)),
        "total_size": sum(e.numel * out(e).itemsize for e in entries),
    }
    weight_map = {entry.key: name for shard, name in zip(shards, names, strict=True) for entry in shard}
    write_index(os.path.join(tmp, SAFE_INDEX if safe else BIN_INDEX), weight_map, metadata)


def _is_buffer(entry: _Entry) -> bool:
    return entry.tensor is not None and not isinstance(entry.tensor, nn.Parameter)


class _Source:
    """The tensors of a checkpoint directory by name: (file, shape, dtype) from the files' headers, and reads of a
    range of elements. A range of a row-major tensor is one contiguous run of bytes in a safetensors file, so it is
    read with pread straight into its destination (no memory map, no copy of anything else); torch.save files are
    memory-mapped and sliced."""

    def __init__(self, directory: str, stack: contextlib.ExitStack) -> None:
        found = [name for name in (SAFE_INDEX, SAFE_WEIGHTS, BIN_INDEX, BIN_WEIGHTS) if _exists(directory, name)]
        if not found:
            raise FileNotFoundError(
                f"{directory} holds none of {SAFE_WEIGHTS}, {SAFE_INDEX}, {BIN_WEIGHTS}, {BIN_INDEX}: not a directory "
                "written by save_full_model or save_pretrained."
            )
        self.safe = found[0] in (SAFE_INDEX, SAFE_WEIGHTS)
        files = [found[0]]
        if found[0] in (SAFE_INDEX, BIN_INDEX):
            with open(os.path.join(directory, found[0])) as file:
                files = sorted(set(json.load(file)["weight_map"].values()))
        self.meta: dict[str, tuple[str, torch.Size, Any]] = {}
        self._where: dict[str, tuple[int, int]] = {}  # safetensors: key -> (descriptor, first byte)
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}
        for name in files:
            path = os.path.join(directory, name)
            if self.safe:
                header, data_start = read_header(path)
                fd = os.open(path, os.O_RDONLY)
                stack.callback(os.close, fd)
                for key, value in header.items():
                    if key == "__metadata__":
                        continue
                    shape, dtype = torch.Size(value["shape"]), BY_NAME.get(value["dtype"], value["dtype"])
                    begin, end = value["data_offsets"]
                    if isinstance(dtype, torch.dtype) and end - begin != math.prod(shape) * dtype.itemsize:
                        raise RuntimeError(f"{path} is corrupt: {key}'s data offsets do not match its shape and dtype")
                    self.meta[key] = (name, shape, dtype)
                    self._where[key] = (fd, data_start + begin)
            else:  # torch.save files cannot be read in part: each is loaded whole (memory-mapped) on every rank
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                self._loaded[name] = state
                self.meta.update((key, (name, value.shape, value.dtype)) for key, value in state.items())

    def read_into(self, key: str, first: int, target: torch.Tensor) -> None:
        """Elements [first, first + target.numel()) of the flattened tensor `key` into the 1-D `target`."""
        name, _, dtype = self.meta[key]
        if not self.safe:
            target.copy_(self._loaded[name][key].reshape(-1)[first : first + target.numel()])
            return
        direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
        buffer = target if direct else torch.empty(target.numel(), dtype=dtype)
        fd, start = self._where[key]
        view = memoryview(buffer.view(torch.uint8).numpy().data).cast("B") if buffer.numel() else memoryview(b"")
        position = start + first * dtype.itemsize
        while view:
            read = os.preadv(fd, [view], position)
            if read == 0:
                raise RuntimeError(f"{name} ends before the data of {key}: the file is truncated")
            view, position = view[read:], position + read
        if not direct:
            target.copy_(buffer)


def _exists(directory: str, name: str) -> bool:
    return os.path.isfile(os.path.join(directory, name))


@torch.no_grad()
def load_full_model(model: nn.Module, directory: str, *, strict: bool = True) -> Any:
    """Load a directory of full weights in Hugging Face's layout (written by save_full_model or by transformers'
    save_pretrained) into a wrapped model; every rank must call it. Each rank reads from the safetensors files only
    the bytes of each parameter that its shard holds, straight into its shard (whole tensors for buffers and
    parameters outside units), so no rank ever holds the full model, nor a second copy of its shard;
    `pytorch_model.bin` files cannot be read in part and are memory-mapped whole on every rank.

    Every rank validates the same metadata before anything is copied: a shape or dtype mismatch, and with `strict`
    a missing or unexpected key, raise a RuntimeError on every rank naming the key and its file, and leave the model
    untouched. A tied weight saved once loads into all its references. Returns (missing_keys, unexpected_keys), as
    nn.Module.load_state_dict does.
    """
    entries, handles = _collect(model)
    with contextlib.ExitStack() as stack:
        source = _Source(directory, stack)
        chosen: dict[str, str] = {}
        known: set[str] = set()
        missing, errors = [], []
        for entry in entries:
            names = [entry.key, *entry.aliases]
            known.update(names)
            key = next((name for name in names if name in source.meta), None)
            if key is None:
                missing.append(entry.key)
                continue
            file, shape, dtype = source.meta[key]
            if shape != entry.shape:
                errors.append(
                    f"size mismatch for {key} in {file}: copying a param with shape {shape} from checkpoint, the shape "
                    f"in current model is {entry.shape}. Load a checkpoint of this model (same architecture)."
                )
            elif dtype != entry.dtype:
                errors.append(
                    f"dtype mismatch for {key} in {file}: the checkpoint holds {dtype}, the model's parameter is "
                    f"{entry.dtype}. Nothing is cast on load: save with save_full_model(..., dtype={entry.dtype}) or "
                    "build the model in the checkpoint's dtype."
                )
            else:
                chosen[entry.key] = key
        unexpected = [key for key in source.meta if key not in known]
        if strict and missing:
            errors.append(f"Missing key(s) in {directory}: " + ", ".join(f'"{key}"' for key in missing) + ".")
        if strict and unexpected:
            listed = ", ".join(f'"{key}" (in {source.meta[key][0]})' for key in unexpected)
            errors.append(f"Unexpected key(s) in {directory}: {listed}.")
        if errors:
            raise RuntimeError(
                f"Error(s) in loading {directory} into {type(model).__name__}:\n\t" + "\n\t".join(errors)
            )
        pieces = [{p.info: p for p in h.layout.shard_pieces(h.rank)} if h.sharded else {} for h in handles]
        for handle in handles:
            if handle.sharded and handle.is_unsharded:
                handle.reshard()  # an unsharded copy left from forward would go stale
        for entry in entries:
            key = chosen.get(entry.key)
            if key is None:
                continue
            if entry.info is None:
                assert entry.tensor is not None
                source.read_into(key, 0, entry.tensor.detach().view(-1))
                continue
            handle, info = handles[entry.unit], entry.info
            if not handle.sharded:
                source.read_into(key, 0, handle.local_shard[info.offset : info.offset + info.numel])
            elif info in pieces[entry.unit]:
                piece = pieces[entry.unit][info]
                target = handle.local_shard[piece.offset_in_shard : piece.offset_in_shard + piece.numel_in_shard]
                source.read_into(key, piece.start_in_param, target)
    return _IncompatibleKeys(missing, unexpected)
