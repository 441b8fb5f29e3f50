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

Failures (docs/failures.md): every rank talks to rank 0 only, and the ranks agree on the outcome at fixed points
(peers.py), so a failure anywhere, a rank's death included, raises the same error on every rank and leaves no send
or receive unmatched: a save agrees after preparing the destination, and again after the data before rank 0 renames
the new directory into place; a load agrees after every rank has checked the files (before the model is touched),
and again after reading.
"""

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ..convert.atomic import atomic_directory
from ..convert.errors import CheckpointError
from ..convert.integrity import check_archive
from ..flat_param import FlatParameter, FlatParamLayout, ParamInfo
from ..handle import FlatParamHandle
from ..naming import join_fqn
from ..safetensors_format import (
    BIN_INDEX,
    BIN_WEIGHTS,
    DTYPES,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    SAVE_ID,
    SAVED_AT,
    SafetensorsWriter,
    WeightsDirectory,
    new_save_id,
    parse_size,
    plan_shards,
    shard_names,
    write_index,
)
from ..unit import FSDPUnit
from .peers import Peers

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


@dataclass
class ShardCopy:
    """What the stream reads of a handle (its layout, shard group and local shard), the shard copied off the training
    tensors, so that a background save writes the values of the moment it was asked for."""

    sharded: bool
    group: dist.ProcessGroup
    layout: FlatParamLayout
    rank: int
    local_shard: torch.Tensor


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


def _stream_unit(
    handle: FlatParamHandle | ShardCopy, wanted: dict[ParamInfo, _Entry], sink: Callable, peers: Peers
) -> None:
    """Every rank calls it for the same unit and `wanted` parameters; rank 0's `sink(entry, first element, piece)`
    receives each piece of each wanted parameter. The other ranks of rank 0's shard group send the span of their
    shard holding wanted pieces, one rank at a time, into one buffer on rank 0; a rank found dead is skipped."""
    me = dist.get_rank()
    sink = _row_major(sink)
    if not handle.sharded:
        if me == 0:
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

    dtype = handle.local_shard.dtype
    if me != 0:
        pieces, lo, hi = span(handle.rank)
        if pieces:
            try:
                data = handle.local_shard[lo:hi].to(peers.device).contiguous()
            except Exception as error:  # rank 0 still waits for this many elements
                peers.note(error)
                data = torch.zeros(hi - lo, dtype=dtype, device=peers.device)
            peers.send(data)
        return
    buffer: torch.Tensor | None = None
    for group_rank, global_rank in enumerate(ranks):
        pieces, lo, hi = span(group_rank)
        if not pieces or global_rank in peers.gone:
            continue
        if global_rank == 0:
            shard = handle.local_shard[lo:hi]
        else:
            if buffer is None:
                buffer = torch.empty(handle.layout.shard_numel, dtype=dtype, device=peers.device)
            shard = buffer[: hi - lo]
            if not peers.receive(shard, global_rank):
                continue
        for piece in pieces:
            start = piece.offset_in_shard - lo
            sink(wanted[piece.info], piece.start_in_param, shard[start : start + piece.numel_in_shard])
    del buffer


def _row_major(sink: Callable) -> Callable:
    """`sink` for pieces in flat order; a parameter held in memory order (a transpose, channels_last: flat_param.py)
    arrives in pieces of that order, which are no runs of the file's row-major bytes: it is put together whole first
    (one parameter's size on rank 0), then handed on row-major."""
    pending: dict[ParamInfo, tuple[torch.Tensor, int]] = {}

    def ordered(entry: _Entry, first: int, piece: torch.Tensor) -> None:
        info = entry.info
        if info is None or info.stride is None:
            sink(entry, first, piece)
            return
        if info not in pending:
            pending[info] = (torch.empty(info.numel, dtype=piece.dtype, device=piece.device), 0)
        whole, filled = pending.pop(info)
        whole[first : first + piece.numel()].copy_(piece)
        filled += piece.numel()
        if filled < info.numel:
            pending[info] = (whole, filled)
        else:
            sink(entry, 0, info.view_of(whole).contiguous().view(-1))

    return ordered


def _plan(entries: list[_Entry], max_size: int, out: Callable[[_Entry], torch.dtype]) -> list[list[_Entry]]:
    groups = plan_shards([entry.numel * out(entry).itemsize for entry in entries], max_size)
    return [[entries[i] for i in group] for group in groups]


def _write_piece(file: SafetensorsWriter, entry: _Entry, first: int, piece: torch.Tensor) -> None:
    file.write(entry.key, first, piece)  # (a module-level seam: the fault tests make it fail)


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
    assembled in memory, so rank 0 holds up to `max_shard_size` bytes. The directory is replaced atomically, and every
    file of it carries the save's identity (so that a directory mixed from two saves is refused on load). A failure
    anywhere, on any rank (a missing or unwritable destination, a full disk, a rank killed), raises the same error on
    every rank and leaves the previous directory (or none) in place.
    """
    check_save_dtype(dtype)
    peers = Peers(save_frame(directory))
    sources: SaveSources | None = None
    try:
        sources = collect_for_save(model)
    except Exception as error:
        peers.note(error)
    write_full_model(sources, directory, peers, max_shard_size, dtype, safe_serialization)


def check_save_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype}: only a floating-point dtype can be saved to")


def save_frame(directory: str) -> Callable[[str], str]:
    """The message every rank raises when a save of `directory` fails, from its cause."""
    return lambda cause: (
        f"save_full_model could not save {directory}: {cause.rstrip('.')}. Nothing was replaced: the previous "
        "checkpoint there, if any, is intact."
    )


@dataclass
class SaveSources:
    """Every tensor of the full state dict (entries) and where the parameters come from (the handles, or copies)."""

    entries: list[_Entry]
    handles: list[FlatParamHandle] | list[ShardCopy]

    @property
    def copied_bytes(self) -> int:
        shards = sum(h.local_shard.nbytes for h in self.handles if isinstance(h, ShardCopy))
        return shards + sum(e.tensor.nbytes for e in self.entries if e.tensor is not None)


def collect_for_save(model: nn.Module) -> SaveSources:
    entries, handles = _collect(model)
    for handle in handles:
        handle.writeback_orig_params()  # use_orig_params: a replaced .data counts, as before an all-gather
    return SaveSources(entries, handles)


def copy_sources(
    sources: SaveSources, into: Callable[[torch.Tensor], torch.Tensor], every_rank: bool = False
) -> SaveSources:
    """The sources with every local shard and whole tensor copied by `into(tensor)` (a CPU copy); rank 0 alone
    writes whole tensors, so the other ranks copy none unless `every_rank` (a SHARDED state dict holds them)."""
    copies: list[ShardCopy] = []
    for handle in sources.handles:
        assert isinstance(handle, FlatParamHandle)
        copies.append(ShardCopy(handle.sharded, handle.group, handle.layout, handle.rank, into(handle.local_shard)))
    keep = every_rank or dist.get_rank() == 0
    entries = [
        _Entry(e.key, e.shape, e.dtype, e.aliases, e.unit, e.info, into(e.tensor.detach()) if keep else None)
        if e.tensor is not None
        else e
        for e in sources.entries
    ]
    return SaveSources(entries, copies)


def write_full_model(
    sources: SaveSources | None,
    directory: str,
    peers: Peers,
    max_shard_size: int | str,
    dtype: torch.dtype | None,
    safe_serialization: bool,
) -> None:
    """The save itself, on every rank alike (None: this rank failed to collect, noted in `peers`)."""
    writer = peers.rank == 0
    with contextlib.ExitStack() as stack:  # rank 0: the temporary directory and its open files
        shards: list[list[_Entry]] = []
        names: list[str] = []
        files: dict[str, SafetensorsWriter] = {}
        tmp, save_id, saved_at = "", new_save_id(), f"{time.time():.6f}"

        def out(entry: _Entry) -> torch.dtype:
            return dtype if dtype is not None and entry.dtype.is_floating_point else entry.dtype

        if sources is not None and peers.failure is None:
            try:
                unstorable = [
                    f"{e.key} ({out(e)})" for e in sources.entries if safe_serialization and out(e) not in DTYPES
                ]
                if unstorable:
                    raise ValueError(f"safetensors cannot store {', '.join(unstorable)}: pass safe_serialization=False")
                shards = _plan(sources.entries, parse_size(max_shard_size), out)
                names = shard_names(len(shards), SAFE_WEIGHTS if safe_serialization else BIN_WEIGHTS)
                if writer:
                    tmp = stack.enter_context(atomic_directory(directory))
                    for shard, name in zip(shards, names, strict=True) if safe_serialization else ():
                        tensors = [(e.key, e.shape, out(e)) for e in shard]
                        metadata = {SAVE_ID: save_id, SAVED_AT: saved_at}
                        file = SafetensorsWriter(os.path.join(tmp, name), tensors, metadata, checksum=True)
                        stack.callback(file.close)
                        files.update((entry.key, file) for entry in shard)
            except Exception as error:
                peers.note(error)
        peers.agree()  # the destination is ready on rank 0, or every rank raises
        assert sources is not None
        _write_all(tmp, shards, names, sources.handles, out, files if safe_serialization else None, peers)
        if writer and peers.failure is None:
            try:
                for file in dict.fromkeys(files.values()):  # (each file once, in order)
                    file.seal()
                if len(shards) > 1:
                    _write_index(tmp, shards, names, out, safe_serialization, save_id, saved_at)
            except Exception as error:
                peers.note(error)
        peers.agree(commit=stack.close)  # every rank's data arrived: rank 0 renames the directory into place


def _write_all(
    tmp: str,
    shards: list[list[_Entry]],
    names: list[str],
    handles: list[FlatParamHandle] | list[ShardCopy],
    out: Callable[[_Entry], torch.dtype],
    files: dict[str, SafetensorsWriter] | None,
    peers: Peers,
) -> None:
    """Stream every tensor to rank 0, which writes it into `files` (safetensors, by key) or, when None, assembles and
    torch.saves each file. A failure on rank 0 stops the writing but not the transfers: no rank is left in a send."""
    writing = peers.rank == 0

    def guarded(write: Callable[[_Entry, int, torch.Tensor], None]) -> Callable[[_Entry, int, torch.Tensor], None]:
        def sink(entry: _Entry, first: int, piece: torch.Tensor) -> None:
            if peers.failure is None:
                try:
                    write(entry, first, piece)
                except Exception as error:
                    peers.note(error)

        return sink

    def by_unit(group: list[_Entry]) -> dict[int, dict[ParamInfo, _Entry]]:
        units: dict[int, dict[ParamInfo, _Entry]] = {}
        for entry in group:
            if entry.info is not None:
                units.setdefault(entry.unit, {})[entry.info] = entry
        return units

    def stream(group: list[_Entry], sink: Callable) -> None:
        for index, wanted in by_unit(group).items():
            _stream_unit(handles[index], wanted, sink, peers)
        for entry in group if writing else ():
            if entry.tensor is not None:
                sink(entry, 0, entry.tensor.detach())

    if files is not None:
        stream(
            [entry for shard in shards for entry in shard], guarded(lambda e, i, p: _write_piece(files[e.key], e, i, p))
        )
        return
    for shard, name in zip(shards, names, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        if writing and peers.failure is None:
            try:
                tensors = {e.key: torch.empty(e.shape, dtype=out(e)) for e in shard}
            except Exception as error:  # (out of memory)
                peers.note(error)

        def fill(entry: _Entry, first: int, piece: torch.Tensor, tensors: dict = tensors) -> None:
            tensors[entry.key].view(-1)[first : first + piece.numel()].copy_(piece.reshape(-1))

        stream(shard, guarded(fill))
        if writing and peers.failure is None:
            try:
                torch.save(tensors, os.path.join(tmp, name))
            except Exception as error:
                peers.note(error)
        tensors.clear()


def _write_index(
    tmp: str,
    shards: list[list[_Entry]],
    names: list[str],
    out: Callable[[_Entry], torch.dtype],
    safe: bool,
    save_id: str,
    saved_at: str,
) -> None:
    entries = [entry for shard in shards for entry in shard]
    metadata = {
        "total_parameters": sum(e.numel for e in entries if not _is_buffer(e)),
        "total_size": sum(e.numel * out(e).itemsize for e in entries),
        SAVE_ID: save_id,
        SAVED_AT: saved_at,
    }
    weight_map = {entry.key: name for shard, name in zip(shards, names, strict=True) for entry in shard}
    write_index(os.path.join(tmp, SAFE_INDEX if safe else BIN_INDEX), weight_map, metadata)


def _is_buffer(entry: _Entry) -> bool:
    return entry.tensor is not None and not isinstance(entry.tensor, nn.Parameter)


def _match(entries: list[_Entry], source: WeightsDirectory, directory: str, model: nn.Module, strict: bool) -> tuple:
    """The checkpoint's key for each entry it can load, the missing and unexpected keys; raises what would make the
    load wrong (a shape or dtype mismatch, and with `strict` a missing or unexpected key)."""
    chosen: dict[str, str] = {}
    known: set[str] = set()
    missing, problems = [], []
    for entry in entries:
        names = [entry.key, *entry.aliases]
        known.update(names)
        key = next((name for name in names if name in source.meta), None)
        if key is None:
            missing.append(entry.key)
            continue
        file, shape, dtype = source.meta[key]
        if shape != entry.shape:
            problems.append(
                f"size mismatch for {key} in {file}: copying a param with shape {shape} from checkpoint, the shape "
                f"in current model is {entry.shape}. Load a checkpoint of this model (same architecture)."
            )
        elif dtype != entry.dtype:
            problems.append(
                f"dtype mismatch for {key} in {file}: the checkpoint holds {dtype}, the model's parameter is "
                f"{entry.dtype}. Nothing is cast on load: save with save_full_model(..., dtype={entry.dtype}) or "
                "build the model in the checkpoint's dtype."
            )
        else:
            chosen[entry.key] = key
    unexpected = [key for key in source.meta if key not in known]
    if strict and missing:
        problems.append(f"Missing key(s) in {directory}: " + ", ".join(f'"{key}"' for key in missing) + ".")
    if strict and unexpected:
        listed = ", ".join(f'"{key}" (in {source.meta[key][0]})' for key in unexpected)
        problems.append(f"Unexpected key(s) in {directory}: {listed}. Pass strict=False to load the rest.")
    if problems:
        raise RuntimeError(f"Error(s) in loading {directory} into {type(model).__name__}:\n\t" + "\n\t".join(problems))
    return chosen, missing, unexpected


@torch.no_grad()
def load_full_model(model: nn.Module, directory: str, *, strict: bool = True, verify_data: bool = True) -> Any:
    """Load a directory of full weights in Hugging Face's layout (written by save_full_model or by transformers'
    save_pretrained) into a wrapped model; every rank must call it. Each rank reads from the safetensors files only
    the bytes of each parameter that its shard holds, straight into its shard (whole tensors for buffers and
    parameters outside units), so no rank ever holds the full model, nor a second copy of its shard;
    `pytorch_model.bin` files cannot be read in part and are memory-mapped whole on every rank.

    Before anything is copied, every rank checks the files (each safetensors header against its file: ranges inside
    it, no two tensors overlapping, byte counts matching dtype x shape; all files of one save) and the keys, and the
    ranks agree: a damaged or mixed directory, a shape or dtype mismatch, and with `strict` a missing or unexpected
    key raise the same RuntimeError on every rank, naming the key or file, and leave the model untouched. With
    `verify_data` (the default) the data is checked against the CRC-32s save_full_model seals into each header, and
    `pytorch_model.bin` archives against torch.save's CRC-32s, the ranks sharing the work (each reads about 1/world
    of the checkpoint once more), so one flipped bit is refused too, naming the tensor. A tied
    weight saved once loads into all its references. Returns (missing_keys, unexpected_keys), as
    nn.Module.load_state_dict does.
    """
    peers = Peers(lambda cause: cause if directory in cause else f"load_full_model could not load {directory}: {cause}")
    with contextlib.ExitStack() as stack:
        entries: list[_Entry] = []
        handles: list[FlatParamHandle] = []
        chosen: dict[str, str] = {}
        missing: list[str] = []
        unexpected: list[str] = []
        try:
            entries, handles = _collect(model)
            source = WeightsDirectory(directory, stack)
            chosen, missing, unexpected = _match(entries, source, directory, model, strict)
            if verify_data:
                _check_data(source, peers)
        except Exception as error:
            peers.note(error)
        peers.agree()  # every rank found the files sound, or every rank raises with the model untouched
        try:
            _read_all(source, entries, handles, chosen)
        except Exception as error:
            peers.note(
                RuntimeError(
                    f"{error}. The model is now partly loaded: load a complete checkpoint into it before using it."
                )
            )
        peers.agree()
    return _IncompatibleKeys(missing, unexpected)


def _check_data(source: WeightsDirectory, peers: Peers) -> None:
    """Raise where this rank's share of the data does not match what its writer sealed."""
    share = (peers.rank, peers.size)
    if source.safe:
        problem = source.data_crc_problem(share)
        if problem is not None:
            raise RuntimeError(f"{problem}. Restore the file from a copy; nothing was loaded.")
        return
    for name in sorted({file for file, _, _ in source.meta.values()})[share[0] :: share[1]]:
        path = os.path.join(source.directory, name)
        with open(path, "rb") as file:
            try:
                check_archive(file, path)
            except CheckpointError as error:
                raise RuntimeError(str(error)) from None


def _read_all(
    source: WeightsDirectory, entries: list[_Entry], handles: list[FlatParamHandle], chosen: dict[str, str]
) -> None:
    pieces = [{p.info: p for p in h.layout.shard_pieces(h.rank)} if h.sharded else {} for h in handles]
    for handle in handles:
        if handle.sharded and handle.holds_gathered_copy:
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
            target, first = handle.local_shard[info.offset : info.offset + info.numel], 0
        elif info in pieces[entry.unit]:
            piece = pieces[entry.unit][info]
            target = handle.local_shard[piece.offset_in_shard : piece.offset_in_shard + piece.numel_in_shard]
            first = piece.start_in_param
        else:
            continue
        if info.stride is None:
            source.read_into(key, first, target)
        else:  # held in memory order: the file's row-major bytes of the whole parameter, reordered
            whole = torch.empty(info.shape, dtype=target.dtype, device=target.device)
            source.read_into(key, 0, whole.view(-1))
            target.copy_(info.flatten(whole)[first : first + target.numel()])
