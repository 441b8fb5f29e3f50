"""Offline conversion between the three checkpoint formats, on the CPU, without a process group or the model's code:

* "local": a DCP directory of {"model": LOCAL_STATE_DICT, "optim": optim_state_dict} (flat parameters with their
  layout records), one chunk per rank of the world size it is laid out for; read also from per-rank torch.save
  files of a LOCAL model state dict (rank_files.py);
* "dcp": a DCP directory in FSDP2's layout, every original parameter under its FQN (fully_shard models load it
  with dcp.load at any world size);
* "full": one torch.save file {"model": {fqn: tensor}, "optim": {"state": {fqn: {...}}, "param_groups": [...]}}.

The optimizer state is keyed by FQN in all three, so it is copied as it is. Tensors stream one at a time, and what
was written is read back and compared with the source bit for bit.
"""

import glob
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .checkpoint import Checkpoint, Path, TensorMeta, dotted
from .dcp_files import DcpCheckpoint, is_dcp, write_dcp
from .errors import CheckpointError
from .flat import Flattened, Unflattened, is_local, records_in
from .rank_files import RankFiles, rank_files_in
from .record import FlatParamRecord
from .torch_file import TorchFile, write_torch_file

FORMATS = ("local", "dcp", "full")

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

    def summary(self) -> str:
        check = f", verified {self.verified} tensors bit for bit" if self.verified else ", not verified"
        return (
            f"{self.source} ({self.source_format}) -> {self.destination} ({self.target_format}): "
            f"{self.tensors} tensors, {self.bytes / 2**20:.1f} MiB{check}, {self.seconds:.1f} s"
        )


def open_checkpoint(path: str | Sequence[str]) -> Checkpoint:
    """A DCP directory, a torch.save file, or the per-rank torch.save files of a LOCAL state dict (a directory of
    them, a glob pattern, or a list of paths), as it is stored."""
    if not isinstance(path, str):
        files = list(path)
        return RankFiles(files, os.path.commonpath([os.path.abspath(f) for f in files]) if files else "[]")
    if is_dcp(path):
        return DcpCheckpoint(path)
    files = rank_files_in(path)
    if files:
        return RankFiles(files, path)
    if os.path.isfile(path):
        return TorchFile(path)
    if os.path.isdir(path):
        raise CheckpointError(
            f"{path} is a directory without a DCP .metadata file or per-rank torch.save files of a "
            "LOCAL state dict: the save did not finish, or this is not a checkpoint. Pass a DCP "
            "checkpoint directory, a torch.save file, or the directory of every rank's file."
        )
    if glob.has_magic(path):
        raise CheckpointError(f"{path} matches no files: pass a pattern that matches every rank's file.")
    raise CheckpointError(f"{path} does not exist.")


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
) -> ConversionReport:
    """Convert the checkpoint at `source` (any of the three formats, detected; a LOCAL one also as per-rank
    torch.save files: their directory, a glob pattern or a list) to format `to` at `destination`, atomically.
    `to="local"` lays the flat parameters out for `world_size` (default: the world size of the layout),
    with the layout carried by the source or read from `layout_from` (a checkpoint of the same model and wrapping,
    also what reads LOCAL checkpoints saved without layout records, by torch's FSDP1)."""
    if to not in FORMATS:
        raise CheckpointError(f"Unknown target format {to!r}: choose one of {', '.join(FORMATS)}.")
    if world_size is not None and (to != "local" or world_size < 1):
        raise CheckpointError("world_size applies to --to local only, and must be at least 1.")
    if isinstance(source, str) and os.path.abspath(source) == os.path.abspath(destination):
        raise CheckpointError(f"{destination} is the source: write the conversion to another path.")
    start = time.perf_counter()
    progress = progress or (lambda *_: None)
    layout = _records_of(layout_from) if layout_from is not None else {}
    with open_checkpoint(source) as stored:
        source_format = format_of(stored)
        view = Unflattened(stored, layout) if is_local(stored) else stored  # by FQN, as the other formats are
        _check_optimizer(view)
        target, chunks = view, {}
        if to == "local":
            target = Flattened(view, _target_layout(view, layout, world_size))
            chunks = {path: pieces for path, _ in target.tensors() if (pieces := target.chunks(path)) is not None}
        total = sum(leaf.nbytes for _, leaf in target.tensors())
        written = 0

        def on_tensor(path: Path, nbytes: int) -> None:
            nonlocal written
            written += nbytes
            progress("write", written, total, dotted(path))

        if to == "full":
            write_torch_file(target, destination, on_tensor)
        else:
            write_dcp(target, destination, chunks, on_tensor)
        verified = verify_conversion(target, destination, progress) if verify else 0
        tensors = sum(1 for _ in target.tensors())
    return ConversionReport(
        stored.location, destination, source_format, to, tensors, total, verified, time.perf_counter() - start
    )


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


def verify_conversion(expected: Checkpoint, destination: str, progress: Progress | None = None) -> int:
    """Read `destination` back and compare every leaf with `expected` (what was meant to be written), tensors bit for
    bit; returns the number of tensors compared."""
    progress = progress or (lambda *_: None)
    with open_checkpoint(destination) as written:
        if expected.leaves.keys() != written.leaves.keys():
            missing = sorted(dotted(p) for p in expected.leaves.keys() - written.leaves.keys())
            extra = sorted(dotted(p) for p in written.leaves.keys() - expected.leaves.keys())
            raise CheckpointError(f"Verification of {destination} failed: missing {missing}, unexpected {extra}.")
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
