"""Which layout a source is, and opening it as a checkpoint with "model" and (where it has one) "optim" sections.

Layouts (`--from`):
  local        per-rank torch.save files of a LOCAL (or SHARDED) state dict: a directory of them, a glob or a list
  dcp          a DCP directory (a LOCAL one is told apart by its flat parameters afterwards, see converter.format_of)
  full         one torch.save file
  accelerate   the directory Accelerate's save_state writes with its FSDP plugin
  lightning    Lightning's FSDP checkpoint: the sharded DCP directory with meta.pt, or a full file
  verl         verl's model/optim_world_size_{W}_rank_{r}.pt files (their directory, a glob or a list)
  safetensors  a directory in Hugging Face's layout
Detection goes by names (files and directories a layout always writes) and, for a lone file, by what its pickle
names (read as bytes, nothing unpickled); a source that looks like more than one layout, or none, is refused with
an error naming --from.
"""

import glob
import os
from collections.abc import Mapping, Sequence

from .checkpoint import Checkpoint
from .dcp_files import METADATA_FILE, DcpCheckpoint, is_dcp
from .errors import CheckpointError
from .framework_layouts import is_accelerate, is_lightning_directory, is_trainer_file, open_accelerate, open_lightning
from .framework_layouts import sections_of as _sections_of
from .rank_files import RankFiles, rank_files_in
from .record import FlatParamRecord
from .safetensors_files import SafetensorsDirectory, is_safetensors_directory
from .torch_file import TorchFile
from .verl_files import VerlCheckpoint, is_verl
from .views import find_sections

SOURCE_LAYOUTS = ("local", "dcp", "full", "accelerate", "lightning", "verl", "safetensors")
Source = str | Sequence[str]


def detect_layout(source: Source) -> str:
    """The layout of `source` by its names, or a CheckpointError naming --from."""
    if not isinstance(source, str):
        return "verl" if is_verl(source) else "local"
    if os.path.isdir(source):
        found = []
        if is_dcp(source):
            found.append("lightning" if is_lightning_directory(source) else "dcp")
        if is_accelerate(source):
            found.append("accelerate")
        if is_verl(source):
            found.append("verl")
        if is_safetensors_directory(source):
            found.append("safetensors")
        if len(found) > 1:
            raise CheckpointError(
                f"{source} looks like checkpoints of several layouts ({', '.join(found)}): pass --from "
                "(source_layout=) to say which to read, or keep the files of one checkpoint per directory."
            )
        if found:
            return found[0]
        if rank_files_in(source):
            return "local"
        raise CheckpointError(
            f"{source} is a directory without a DCP {METADATA_FILE} file, per-rank torch.save files of a LOCAL state "
            "dict, or the files of a layout --from names (Accelerate, Lightning, verl, safetensors): the save did not "
            "finish, or this is not a checkpoint. Pass a DCP checkpoint directory, a torch.save file, the directory of "
            "every rank's file, or --from to name the layout."
        )
    if os.path.isfile(source):
        if is_trainer_file(source):
            return "lightning"
        return "local" if rank_files_in(source) else "full"
    if glob.has_magic(source):
        matches = sorted(n for n in glob.glob(source) if os.path.isfile(n))
        if not matches:
            raise CheckpointError(f"{source} matches no files: pass a pattern that matches every rank's file.")
        return "verl" if is_verl(matches) else "local"
    raise CheckpointError(f"{source} does not exist.")


def open_source(
    source: Source,
    layout: str | None = None,
    records: Mapping[str, FlatParamRecord] | None = None,
    optimizer: bool = True,
) -> tuple[Checkpoint, str]:
    """`source` opened as the layout given (None or "auto": detected), and that layout. `records` lay out verl's
    FSDP1 flat optimizer state; without `optimizer`, the framework layouts do not read their optimizer state (which
    may not be readable without more information: the model alone converts)."""
    if layout in (None, "auto"):
        layout = detect_layout(source)
        auto = True
    elif layout not in SOURCE_LAYOUTS:
        raise CheckpointError(f"Unknown source layout {layout!r}: choose one of auto, {', '.join(SOURCE_LAYOUTS)}.")
    else:
        auto = False
    if layout == "verl":
        files = sorted(glob.glob(source)) if isinstance(source, str) and glob.has_magic(source) else source
        return VerlCheckpoint(files, records, optimizer), layout
    if layout == "local":
        return _rank_files(source), layout
    if not isinstance(source, str):
        raise CheckpointError(f"A list of files is read as per-rank files (--from local or verl), not as {layout}.")
    if layout == "accelerate":
        return open_accelerate(source, optimizer), layout
    if layout == "lightning":
        return open_lightning(source, optimizer), layout
    if layout == "safetensors":
        return SafetensorsDirectory(source), layout
    if layout == "dcp":
        if not is_dcp(source):
            raise CheckpointError(f"{source} is not a DCP checkpoint directory (it has no {METADATA_FILE} file).")
        return DcpCheckpoint(source), layout
    if not os.path.isfile(source):
        raise CheckpointError(f"{source} is not a file (--from full reads one torch.save file).")
    stored = TorchFile(source)
    if auto and _is_fabric_file(stored):  # fabric.save(path, {"net": model, "opt": optim}): the user's keys
        return _sections_of(stored, "a full Lightning Fabric checkpoint"), "lightning"
    return stored, layout


def _rank_files(source: Source) -> Checkpoint:
    files = rank_files_in(source)
    if isinstance(source, str):
        if not files:
            raise CheckpointError(f"{source} names no per-rank torch.save files of a state dict.")
        return RankFiles(files, source)
    return RankFiles(files, os.path.commonpath([os.path.abspath(f) for f in files]) if files else "[]")


def _is_fabric_file(stored: Checkpoint) -> bool:
    """A torch.save file without "model" whose model state dict is under another top-level key."""
    top = {path[0] for path in stored.leaves}
    if "model" in top or "optim" in top:
        return False
    try:
        model, _ = find_sections(stored, "a torch.save file")
    except CheckpointError:
        return False
    return model is not None
