"""Offline conversion between checkpoint formats, on the CPU, without a process group or the model's code:

* "local": a DCP directory of {"model": LOCAL_STATE_DICT, "optim": optim_state_dict} (flat parameters with their
  layout records), one chunk per rank of the world size it is laid out for; read also from per-rank torch.save
  files of a LOCAL model state dict (rank_files.py);
* "dcp": a DCP directory in FSDP2's layout, every original parameter under its FQN (fully_shard models load it
  with dcp.load at any world size);
* "full": one torch.save file {"model": {fqn: tensor}, "optim": {"state": {fqn: {...}}, "param_groups": [...]}};
* "safetensors": Hugging Face's layout of the model weights (safetensors_files.py), optionally cast; no optimizer.

Sources are also read in the layouts the frameworks write (sources.py: Accelerate, Lightning, verl, safetensors).
The optimizer state is keyed by FQN in all of them, so it is copied as it is. Tensors stream one at a time, and what
was written is read back and compared with what was meant to be written, bit for bit, before it replaces the
destination: a conversion that fails (a full disk, a write error, a mismatch) leaves no output and the previous
destination, if any, as it was.
"""

import errno
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .checkpoint import Checkpoint, Path, TensorMeta, dotted
from .dcp_files import DcpCheckpoint, write_dcp
from .errors import CheckpointError
from .flat import Flattened, Unflattened, is_local, no_layout_message, records_in
from .inferred_layout import infer_layout
from .record import FlatParamRecord, is_flat_key
from .safetensors_files import ModelWeights, write_safetensors
from .seals import Seals
from .sources import SOURCE_LAYOUTS, open_source
from .torch_file import write_torch_file
from .views import Prefixless

FORMATS = ("local", "dcp", "full", "safetensors")

# progress(phase, bytes done, bytes in total, key of the tensor just done); phases: "write", "verify"
Progress = Callable[[str, int, int, str], None]


@dataclass(frozen=True)
class ConversionReport:
    source: str
    destination: str
    source_format: str
    target_format: str
    tensors: int  # tensors written
    bytes: int  # their size
    verified: int  # tensors read back and found equal to the source (0 without verification)
    seconds: float
    notes: tuple[str, ...] = ()  # what of the source was not carried over, and why
    source_seals: Seals = Seals()  # what of the source's seals was checked before converting, what it has none of

    def summary(self) -> str:
        check = (
            f", the output read back and verified bit for bit against the source ({self.verified} tensors)"
            if self.verified
            else ", the output not read back (not verified)"
        )
        checked = "; ".join(self.source_seals.verified) or "nothing: the source carries no seal"
        lines = [f"  source checked: {checked}"]
        lines += [f"  not verifiable in the source: {what}" for what in self.source_seals.unverified]
        return "\n".join(
            [
                f"{self.source} ({self.source_format}) -> {self.destination} ({self.target_format}): "
                f"{self.tensors} tensors, {self.bytes / 2**20:.1f} MiB{check}, {self.seconds:.1f} s",
                *lines,
                *(f"  note: {note}" for note in self.notes),
            ]
        )


def open_checkpoint(path: str | Sequence[str], layout: str | None = None) -> Checkpoint:
    """A checkpoint as it is stored: a DCP directory, a torch.save file, the per-rank torch.save files of a LOCAL
    state dict (a directory of them, a glob pattern, or a list of paths), or one of the layouts of sources.py; the
    layout is detected unless given (one of sources.SOURCE_LAYOUTS)."""
    return open_source(path, layout)[0]


def format_of(checkpoint: Checkpoint) -> str:
    if is_local(checkpoint):
        return "local"
    return "dcp" if isinstance(checkpoint, DcpCheckpoint) else "full"


def convert_checkpoint(
    source: str | Sequence[str],
    destination: str,
    to: str,
    world_size: int | None = None,
    layout_from: str | None = None,
    verify: bool = True,
    progress: Progress | None = None,
    source_layout: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    model_only: bool = False,
    strip_prefix: str | None = None,
    layout: Mapping[str, FlatParamRecord] | None = None,
) -> ConversionReport:
    """Convert the checkpoint at `source` to format `to` at `destination`, atomically. The source is any of the
    formats, or a layout the frameworks write (`source_layout`, one of sources.SOURCE_LAYOUTS; detected when None):
    a LOCAL one also as per-rank torch.save files (their directory, a glob pattern or a list), Accelerate's
    save_state directory, Lightning's FSDP checkpoint, verl's per-rank files, a safetensors directory.
    `to="local"` lays the flat parameters out for `world_size` (default: the world size of the layout), with the layout
    carried by the source or read from `layout_from` (a checkpoint of the same model and wrapping, also what reads
    LOCAL checkpoints saved without layout records, by torch's FSDP1, and verl's FSDP1 flat optimizer state).
    `to="safetensors"` writes the model weights in Hugging Face's layout (files of at most `max_shard_size`, floating
    tensors cast to `dtype`); the optimizer state is not carried there. `model_only` leaves the optimizer out;
    `strip_prefix` takes a prefix off the parameter names that have it (not with to="local"). `layout` gives the
    layout records themselves (by flat key), as `layout_from` would read them (cli/model_layout.py builds them from
    model code)."""
    if to not in FORMATS:
        raise CheckpointError(f"Unknown target format {to!r}: choose one of {', '.join(FORMATS)}.")
    if source_layout not in (None, "auto", *SOURCE_LAYOUTS):
        raise CheckpointError(
            f"Unknown source layout {source_layout!r}: choose one of auto, {', '.join(SOURCE_LAYOUTS)}."
        )
    if world_size is not None and (to != "local" or world_size < 1):
        raise CheckpointError("world_size applies to --to local only, and must be at least 1.")
    if (dtype is not None or max_shard_size != "5GB") and to != "safetensors":
        raise CheckpointError("dtype and max_shard_size apply to --to safetensors only.")
    if strip_prefix is not None and (to == "local" or not strip_prefix):
        raise CheckpointError("strip_prefix must be a non-empty prefix, and does not apply to --to local.")
    if dtype is not None and not dtype.is_floating_point:
        raise CheckpointError(f"dtype={dtype}: only floating tensors are cast, to a floating dtype.")
    if isinstance(source, str) and os.path.abspath(source) == os.path.abspath(destination):
        raise CheckpointError(f"{destination} is the source: write the conversion to another path.")
    start = time.perf_counter()
    progress = progress or (lambda *_: None)
    if layout is not None and layout_from is not None:
        raise CheckpointError("Pass the layout as layout_from (a checkpoint) or as layout (records), not both.")
    layout = dict(layout) if layout is not None else _records_of(layout_from) if layout_from is not None else {}
    stored, source_format = open_source(source, source_layout, layout, optimizer=not model_only)
    with stored:
        seals = stored.verify_seals()  # every seal its writer made, before anything is converted
        if source_format in ("dcp", "full"):
            source_format = format_of(stored)
        elif source_format == "local" and not is_local(stored):  # per-rank files of a SHARDED (or FSDP2) state dict
            source_format = "sharded per-rank files"
        notes: tuple[str, ...] = ()
        if is_local(stored) and not layout and not records_in(stored):
            layout, notes = _inferred_layout(stored)
        view: Checkpoint = Unflattened(stored, layout) if is_local(stored) else stored  # by FQN, as the others are
        if to == "safetensors" and not model_only and any(path[0] == "optim" for path in view.leaves):
            notes += ("the optimizer state was not carried over: safetensors holds model weights only",)
        if model_only or to == "safetensors":
            view = _without_optimizer(view)
        if strip_prefix is not None:
            view = Prefixless(view, strip_prefix)
        _check_optimizer(view)
        target, chunks = view, {}
        if to == "safetensors":
            target = ModelWeights(view, dtype)
        elif to == "local":
            target = Flattened(view, _target_layout(view, layout, world_size))
            chunks = {path: pieces for path, _ in target.tensors() if (pieces := target.chunks(path)) is not None}
        total = sum(leaf.nbytes for _, leaf in target.tensors())
        written = 0

        def on_tensor(path: Path, nbytes: int) -> None:
            nonlocal written
            written += nbytes
            progress("write", written, total, dotted(path))

        written_as = {"full": "full", "safetensors": "safetensors"}.get(to, "dcp")
        verified = 0

        def check(temporary: str) -> None:  # the output, read back before it replaces the destination
            nonlocal verified
            try:
                verified = verify_conversion(target, temporary, progress, written_as)
            except CheckpointError as error:
                raise CheckpointError(str(error).replace(temporary, destination)) from None

        before_commit = check if verify else None
        try:
            if to == "full":
                write_torch_file(target, destination, on_tensor, before_commit)
            elif to == "safetensors":
                write_safetensors(target, destination, max_shard_size, on_tensor, before_commit)
            else:
                write_dcp(target, destination, chunks, on_tensor, before_commit)
        except OSError as error:
            raise _write_failed(destination, error) from error
        tensors = sum(1 for _ in target.tensors())
    return ConversionReport(
        stored.location,
        destination,
        source_format,
        to,
        tensors,
        total,
        verified,
        time.perf_counter() - start,
        notes,
        seals,
    )


_HINTS = {
    errno.ENOSPC: "free some space on its file system",
    errno.EDQUOT: "free some space (the disk quota is used up)",
    errno.EFBIG: "a file grew past the file size limit (ulimit -f) or the file system's largest file",
    errno.EACCES: "make its directory writable",
    errno.EROFS: "its file system is read-only: choose another destination",
}


def _write_failed(destination: str, error: OSError) -> CheckpointError:
    """A write that failed (a full disk, a file size limit, no permission), said as such: the conversion's own error
    rather than a traceback."""
    parent = os.path.dirname(os.path.abspath(destination))
    try:
        free = f" ({shutil.disk_usage(parent).free / 2**20:.1f} MiB free there now)"
    except OSError:
        free = ""
    hint = _HINTS.get(error.errno or 0, "free space on its file system if it is full, or check the device")
    cause = f"{error.strerror or error}" + (f" ({error.filename})" if error.filename else "")
    return CheckpointError(
        f"Could not write {destination}: {cause}{free}. Nothing was written there, and the previous {destination}, "
        f"if any, is intact: {hint}, and run the conversion again."
    )


def _inferred_layout(stored: Checkpoint) -> tuple[dict[str, FlatParamRecord], tuple[str, ...]]:
    """The layout of a LOCAL checkpoint saved without records, from the optimizer state beside it; where that cannot
    be done, the error says why and how to give the layout."""
    try:
        inferred = infer_layout(stored)
    except CheckpointError as why:
        first = next(key for key in stored.section("model") if is_flat_key(key))
        raise CheckpointError(
            f"{no_layout_message(f'model.{first} in {stored.location}')} Its layout could not be inferred from the "
            f"optimizer state saved beside it either: {why}."
        ) from None
    return inferred.records, inferred.notes


def _records_of(path: str) -> dict[str, FlatParamRecord]:
    with open_checkpoint(path) as checkpoint:
        records = records_in(checkpoint)
    if not records:
        raise CheckpointError(
            f"{path} (the layout to use) carries no flat-parameter layout records: pass a LOCAL "
            "checkpoint saved by fsdp_legacy, or one converted from it."
        )
    return records


def _target_layout(view: Checkpoint, layout: dict, world_size: int | None) -> list[FlatParamRecord]:
    records = layout or records_in(view)
    if not records:
        raise CheckpointError(
            f"{view.location} carries no flat-parameter layout (it was not converted from a checkpoint saved by "
            "fsdp_legacy under LOCAL_STATE_DICT): pass --layout-from (layout_from=) a LOCAL checkpoint of the same "
            "model and wrapping saved by fsdp_legacy, at any world size."
        )
    return [r.at_world_size(world_size) if world_size else r for r in records.values()]


class _Selected(Checkpoint):
    """The leaves of a checkpoint but its optimizer state."""

    def __init__(self, source: Checkpoint) -> None:
        self.location, self._source = source.location, source
        self.leaves = {path: leaf for path, leaf in source.leaves.items() if path[0] != "optim"}

    def read(self, path: Path) -> torch.Tensor:
        return self._source.read(path)

    def read_flat(self, path: Path, start: int, stop: int) -> torch.Tensor:
        return self._source.read_flat(path, start, stop)

    def chunks(self, path: Path) -> list | None:
        return self._source.chunks(path)


def _without_optimizer(view: Checkpoint) -> Checkpoint:
    return _Selected(view) if any(path[0] == "optim" for path in view.leaves) else view


def _check_optimizer(view: Checkpoint) -> None:
    """Optimizer state keyed by anything but the model's FQNs (parameter ids, another model) would convert into a
    checkpoint no model loads."""
    model = view.section("model")
    if not model:
        return  # an optimizer-only checkpoint: nothing to check against
    for path in view.leaves:
        if path[:2] == ("optim", "state") and len(path) > 2 and path[2] not in model:
            raise CheckpointError(
                f"{dotted(path)} in {view.location}: the optimizer state names a parameter the model section does not "
                "have. Save the optimizer with FSDP.optim_state_dict(model, optim) (keyed by FQN) next to the "
                "model's state dict."
            )


def verify_conversion(
    expected: Checkpoint, destination: str, progress: Progress | None = None, layout: str | None = None
) -> int:
    """Read `destination` back (as `layout`, one of sources.SOURCE_LAYOUTS; detected when None) and compare every
    leaf with `expected` (what was meant to be written), tensors bit for bit; returns the number of tensors
    compared."""
    progress = progress or (lambda *_: None)
    with open_checkpoint(destination, layout) as written:
        if expected.leaves.keys() != written.leaves.keys():
            missing = sorted(dotted(p) for p in expected.leaves.keys() - written.leaves.keys())
            extra = sorted(dotted(p) for p in written.leaves.keys() - expected.leaves.keys())
            raise CheckpointError(f"Verification of {destination} failed: missing {missing}, unexpected {extra}.")
        if dict(written.side_records) != dict(expected.side_records):  # (a LOCAL output's records: its side file)
            raise CheckpointError(f"Verification of {destination} failed: its layout records differ from the source's.")
        total = sum(leaf.nbytes for _, leaf in expected.tensors())
        done = count = 0
        for path, leaf in expected.leaves.items():
            if not isinstance(leaf, TensorMeta):
                if written.leaves[path] != leaf:
                    raise CheckpointError(
                        f"Verification of {destination} failed: {dotted(path)} is "
                        f"{written.leaves[path]!r}, expected {leaf!r}."
                    )
                continue
            if written.leaves[path] != leaf or not _same_bits(written.read(path), expected.read(path)):
                raise CheckpointError(f"Verification of {destination} failed: {dotted(path)} differs from the source.")
            count += 1
            done += leaf.nbytes
            progress("verify", done, total, dotted(path))
    return count


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality, NaNs and signed zeros included."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
