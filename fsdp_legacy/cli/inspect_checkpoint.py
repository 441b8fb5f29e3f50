"""`fsdp-legacy inspect PATH`: what a checkpoint holds, once every seal its writer made is checked.

The layout is detected as the converter detects sources (fsdp_legacy.convert.detect_layout). Every seal is checked
first, as the converter checks a source (convert/seals.py): the CRC-32s of every torch.save archive, the side file's
CRC-32s of a DCP directory saved through fsdp_legacy (or, for a plain dcp.save, every item's archive, dtype and shape),
the CRC-32s in our safetensors headers; that reads every byte once. Then the descriptions are read: a DCP directory's
`.metadata` (with the converter's restricted unpickler, every value checked) and its non-tensor items, safetensors
headers, and the pickles of torch.save archives, memory-mapped, through the converter's weights_only load or, for
per-rank files of ShardedTensors and DTensors, its restricted unpickler (no code from the file runs, no process
group). What was verified, and what the format carries no seal for, is part of the description.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..convert import SOURCE_LAYOUTS, CheckpointError, detect_layout
from ..convert.checkpoint import Checkpoint, Path, TensorMeta, dotted, flatten
from ..convert.dcp_files import DcpCheckpoint
from ..convert.flat import Unflattened, is_local, records_in
from ..convert.framework_layouts import accelerate_entries, is_trainer_file, sections_of
from ..convert.integrity import check_archive
from ..convert.loading import LocalShards, load_rank_file, safe_load
from ..convert.rank_files import check_one_save, rank_file_seals, rank_files_in
from ..convert.record import FlatParamRecord, is_flat_key, records_in_metadata
from ..convert.safetensors_files import SafetensorsDirectory
from ..convert.seals import ARCHIVE, Seals
from ..convert.torch_file import load_tree
from ..convert.verl_files import clean_fqn, verl_files
from ..convert.views import Composite, Rename, renamed
from .common import EXIT_CODES, EXIT_OK, UsageError, check_source, human_bytes, progress
from .latest_checkpoint import run_latest

HELP = "show what a checkpoint holds (format, world size, parameters, dtypes, size), its seals checked first"

DESCRIPTION = f"""Show what a checkpoint holds: its format, the world size it was saved at (where it has one), every
model tensor by name with its shape and dtype (a LOCAL checkpoint's original parameters, named by its layout
records), the optimizer state, and the sizes.

Reads the layouts `convert` reads (--from, detected by default): {", ".join(SOURCE_LAYOUTS)}. Every seal the
checkpoint's writer made is checked first (CRC-32s of torch.save archives, of our DCP files and safetensors data and
headers): a damaged checkpoint is refused with one line naming the file and tensor. The output says what was
verified and what the format carries no seal for. Pickles are read through weights_only or the converter's
restricted unpickler: never code from the file."""

EXAMPLES = f"""examples:
  fsdp-legacy inspect ckpt/local                      # a DCP directory (LOCAL or FSDP2's layout)
  fsdp-legacy inspect ckpt/model.pt                   # one torch.save file
  fsdp-legacy inspect 'ckpt/rank*.pt'                 # per-rank torch.save files (quoted glob, or their directory)
  fsdp-legacy inspect out/checkpoint-100 --json       # Accelerate's save_state directory, as JSON
  fsdp-legacy inspect global_step_50/actor            # verl's per-rank files
  fsdp-legacy inspect --latest ckpt                   # the newest complete checkpoint under ckpt/, what was skipped

{EXIT_CODES}"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "inspect",
        help=HELP,
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "path", nargs="?", help="the checkpoint: a directory, a torch.save file, or a quoted glob of per-rank files"
    )
    p.add_argument(
        "--latest",
        metavar="ROOT",
        help="instead: which checkpoint under the folder ROOT a restarted job resumes from (the newest complete and "
        "intact one), and why each newer one was skipped; exit code 1 when none is usable",
    )
    p.add_argument(
        "--from",
        dest="source_layout",
        default="auto",
        choices=("auto", *SOURCE_LAYOUTS),
        help="the checkpoint's layout (default: detected from its file names)",
    )
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar while per-rank files are read")
    p.set_defaults(run=run)


# --------------------------------------------------------------------------------------------------------------------
# Reading descriptions


class _Described(Checkpoint):
    """Leaves read from pickles: tensor descriptions, plus the plain (memory-mapped) tensors to read records from."""

    def __init__(self, location: str, leaves: Mapping[Path, Any]) -> None:
        self.location = location
        self._tensors = {p: v for p, v in leaves.items() if isinstance(v, torch.Tensor)}
        self.leaves = {}
        for path, value in leaves.items():
            if isinstance(value, LocalShards):
                self.leaves[path] = TensorMeta(value.shape, value.dtype)
            elif isinstance(value, torch.Tensor):
                self.leaves[path] = TensorMeta.of(value)
            else:
                self.leaves[path] = value

    def read(self, path: Path) -> torch.Tensor:
        if path not in self._tensors:
            raise CheckpointError(f"{dotted(path)} in {self.location} is stored in pieces over the ranks' files.")
        return self._tensors[path]


@dataclass
class Opened:
    checkpoint: Checkpoint  # "model", "optim" and other sections, as stored
    storage: str  # how the model is stored: "dcp", "full", "per-rank files", "safetensors"
    kind: str  # the layout, in words
    world_size: int | None = None
    notes: list[str] = field(default_factory=list)
    optimizer: dict[str, Any] | None = None  # for an optimizer state keyed by index, summarised from its pickles
    seals: Seals = field(default_factory=Seals)  # what of the writer's seals was checked, and what has none


def _checked(path: str, damaged: str = "") -> None:
    """The archive's CRC-32s, before its pickle is read (`damaged`: a prefix for the error)."""
    try:
        with open(path, "rb") as file:
            check_archive(file, path)
    except CheckpointError as error:
        raise CheckpointError(f"{damaged}{error}") from None


def _str_keys(value: Any, changed: list[bool]) -> Any:
    """`value` with every dict key a str (an optimizer state keyed by parameter index has int keys)."""
    if isinstance(value, Mapping):
        if any(not isinstance(key, str) for key in value):
            changed.append(True)
        return {str(key): _str_keys(item, changed) for key, item in value.items()}
    if isinstance(value, list):
        return [_str_keys(item, changed) for item in value]
    return value


def _indexed_note(changed: list[bool]) -> list[str]:
    if not changed:
        return []
    return ["the optimizer state is keyed by parameter index (optim.state_dict()), not by name"]


def _torch_file(path: str) -> Opened:
    _checked(path)
    tree = load_tree(path)
    changed: list[bool] = []
    tree = _str_keys(tree, changed)
    opened = Opened(_Described(path, flatten(tree, path)), "full", "one torch.save file", notes=_indexed_note(changed))
    opened.seals = Seals((ARCHIVE,))
    top = {str(p[0]) for p in opened.checkpoint.leaves}
    if "model" not in top and "optim" not in top:  # the user's keys (Lightning Fabric's save, ...)
        try:
            opened.checkpoint = sections_of(opened.checkpoint, "a torch.save file")
        except CheckpointError:
            opened.notes.append(f"no model state dict found among the top-level keys ({', '.join(sorted(top))})")
    return opened


def _rank_files(files: Sequence[str], location: str, quiet: bool) -> Opened:
    """Per-rank torch.save files of a LOCAL or SHARDED state dict (ShardedTensors or DTensors): every file's pickle
    is read (for its rank and world size), rank 0's leaves are described."""
    ranks: dict[int, tuple[str, dict[Path, Any]]] = {}
    world_sizes: set[int] = set()
    changed: list[bool] = []
    records: dict[str, list[FlatParamRecord]] = {}
    for file in progress(files, len(files), "reading rank files", quiet):
        _checked(file, "One of the per-rank files is there but damaged: ")
        tree = load_rank_file(file)
        if not isinstance(tree, Mapping):
            raise CheckpointError(f"{file} holds a {type(tree).__name__}, not a state dict.")
        if "model" not in tree:
            tree = {"model": tree}
        records[file] = records_in_metadata(getattr(tree["model"], "_metadata", None), file)
        leaves = flatten(_str_keys(tree, changed), file)
        saved = {(v.rank, v.world_size) for v in leaves.values() if isinstance(v, LocalShards)}
        if len(saved) != 1:
            raise CheckpointError(
                f"{file} holds {'no ShardedTensor or DTensor' if not saved else 'pieces saved by several ranks'}, so "
                "it is not one rank's file of a LOCAL or SHARDED state dict: inspect it by itself (--from full)."
            )
        rank, world_size = saved.pop()
        if rank in ranks:
            raise CheckpointError(
                f"{file} and {ranks[rank][0]} are both rank {rank}'s (by the tensors they hold): the files mix saves "
                "or hold a copy. Pass the files of one save."
            )
        ranks[rank] = (file, leaves)
        world_sizes.add(world_size)
    check_one_save(records, location)  # the save identities in the files' layout records
    if len(world_sizes) > 1:
        raise CheckpointError(f"{location}: the files were saved at different world sizes {sorted(world_sizes)}.")
    world_size = world_sizes.pop()
    notes = _indexed_note(changed)
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing:  # refused as the converter and latest() refuse it: a listing would look like a whole checkpoint
        found = ", ".join(os.path.basename(ranks[r][0]) for r in sorted(ranks))
        raise CheckpointError(
            f"{location}: the state dict was saved by {world_size} ranks, but the file of rank(s) {missing} is "
            f"missing (found ranks {sorted(ranks)}: {found}): the checkpoint is incomplete. Copy every rank's file, "
            "and pass their directory, a glob pattern or the list of them."
        )
    first_file, first = ranks[min(ranks)]
    described = _Described(location, first)
    described.side_records = {r.flat_key: r for r in records[first_file]}
    opened = Opened(described, "per-rank files", "per-rank torch.save files", world_size, notes)
    opened.seals = rank_file_seals(all(found and all(r.save_id for r in found) for found in records.values()))
    return opened


def _index_optimizer(raws: Sequence[Any], where: str) -> dict[str, Any]:
    """The summary of optimizer.state_dict()s keyed by parameter index (one per rank, or the optimizers of a
    Lightning Trainer checkpoint)."""
    indices: set[str] = set()
    names: set[str] = set()
    tensors = nbytes = groups = 0
    for raw in raws:
        if not (isinstance(raw, Mapping) and isinstance(raw.get("state"), Mapping)):
            raise CheckpointError(f"{where} holds an optimizer state without 'state': not an optimizer.state_dict().")
        groups = max(groups, len(raw.get("param_groups") or []))
        for index, state in raw["state"].items():
            indices.add(str(index))
            for name, value in state.items() if isinstance(state, Mapping) else ():
                names.add(str(name))
                if isinstance(value, LocalShards):
                    tensors += 1
                    nbytes += sum(t.numel() for _, t in value.pieces) * value.dtype.itemsize
                elif isinstance(value, torch.Tensor):
                    tensors += 1
                    nbytes += value.numel() * value.element_size()
    return {
        "present": True,
        "parameters": len(indices),
        "states": sorted(names),
        "tensors": tensors,
        "bytes": nbytes,
        "groups": groups,
    }


def _verl(source: str, quiet: bool) -> Opened:
    files = verl_files(sorted(glob.glob(source)) if glob.has_magic(source) else source)
    if "model" not in files:
        raise CheckpointError(f"{source} has no model_world_size_<W>_rank_<r>.pt files: not a verl checkpoint.")
    model = files["model"]
    opened = _rank_files([model[r] for r in sorted(model)], source, quiet)
    cleaned = {
        (("model", clean_fqn(p[1]), *p[2:]) if p[0] == "model" and isinstance(p[1], str) else p): leaf
        for p, leaf in opened.checkpoint.leaves.items()
    }
    opened.checkpoint.leaves = cleaned
    opened.kind = "verl's per-rank files"
    if "optim" in files:
        paths = [files["optim"][r] for r in sorted(files["optim"])]
        for path in paths:
            _checked(path)
        raws = [load_rank_file(path) for path in progress(paths, len(paths), "reading optimizer files", quiet)]
        opened.optimizer = _index_optimizer(raws, source)
        opened.notes.append("the optimizer state is keyed by parameter index (optimizer.state_dict() on each rank)")
    if "extra_state" in files:
        opened.notes.append("extra_state_* (the LR scheduler's and RNG states) is not described")
    return opened


def _dcp(path: str, kind: str = "a DCP directory") -> Opened:
    stored = DcpCheckpoint(path)
    try:
        return Opened(stored, "dcp", kind, seals=stored.verify_seals())
    except BaseException:
        stored.close()
        raise


def _part(paths: list[str], directory: str, quiet: bool) -> Opened:
    if len(paths) == 1 and os.path.isdir(paths[0]):
        return _dcp(paths[0])
    if len(paths) == 1 and "_rank" not in os.path.basename(paths[0]):
        return _torch_file(paths[0])
    return _rank_files(paths, directory, quiet)


def _under_optim(path: Path) -> Path | None:
    return ("optim", *path) if path[0] in ("state", "param_groups") else None


def _accelerate(directory: str, quiet: bool) -> Opened:
    model, optim = accelerate_entries(directory)
    if len(model) != 1 or len(optim) > 1:
        raise CheckpointError(
            f"{directory} holds Accelerate's model state in {len(model)} layouts and its optimizer state in "
            f"{len(optim)} ({', '.join([*model, *optim])}): saves with different state_dict_type settings were written "
            "to one directory. Keep the files of one save."
        )
    ((kind, paths),) = model.items()
    opened = _part(paths, directory, quiet)
    parts: list[tuple[Checkpoint, Rename]] = [(opened.checkpoint, renamed({"model": "model"}))]
    if optim:
        ((optim_kind, optim_paths),) = optim.items()
        part = _part(optim_paths, directory, quiet)
        opened.seals = opened.seals + part.seals
        rename = _under_optim if optim_kind == "full file" else renamed({"optimizer": "optim", "model": "optim"})
        parts.append((part.checkpoint, rename))
    opened.checkpoint = Composite(directory, parts)
    opened.kind = f"Accelerate's save_state directory ({kind})"
    return opened


def _lightning(path: str) -> Opened:
    if os.path.isdir(path):
        opened = _dcp(path, "Lightning's sharded FSDP checkpoint (a DCP directory)")
        opened.checkpoint = sections_of(opened.checkpoint, "a sharded Lightning checkpoint")
        return opened
    if not is_trainer_file(path):
        opened = _torch_file(path)
        opened.kind = "Lightning's full FSDP checkpoint (one torch.save file)"
        return opened
    _checked(path)
    tree = safe_load(path, path, mmap=True)
    model = tree.get("state_dict") if isinstance(tree, Mapping) else None
    if not isinstance(model, Mapping):
        raise CheckpointError(f"{path} is a Lightning Trainer checkpoint without a state_dict: it is damaged.")
    opened = Opened(
        _Described(path, flatten({"model": dict(model)}, path)),
        "full",
        "a Lightning Trainer checkpoint (one torch.save file)",
        notes=["the names are the LightningModule's (convert --strip-prefix takes its attribute off)"],
        seals=Seals((ARCHIVE,)),
    )
    optimizers = tree.get("optimizer_states") or []
    if optimizers:
        opened.optimizer = _index_optimizer(optimizers, path)
        opened.notes.append(f"{len(optimizers)} optimizer state(s), keyed by parameter index")
    return opened


def open_description(path: str, layout: str, quiet: bool = False) -> tuple[Opened, str]:
    """The checkpoint at `path` read as `layout` ("auto": detected), described; and the layout."""
    if layout == "auto":
        try:
            layout = detect_layout(path)
        except CheckpointError as error:  # not a checkpoint of a layout this reads: a bad path
            raise UsageError(str(error)) from None
    if layout == "dcp":
        if not os.path.isdir(path):
            raise UsageError(f"{path} is not a DCP checkpoint directory.")
        return _dcp(path), layout
    if layout == "full":
        if not os.path.isfile(path):
            raise UsageError(f"{path} is not a file (--from full reads one torch.save file).")
        return _torch_file(path), layout
    if layout == "local":
        files = rank_files_in(path)
        if not files:
            raise UsageError(f"{path} names no per-rank torch.save files of a LOCAL or SHARDED state dict.")
        return _rank_files(files, path, quiet), layout
    if layout == "safetensors":
        stored = SafetensorsDirectory(path)
        kind = "a Hugging Face safetensors directory"
        return Opened(stored, "safetensors", kind, seals=stored.verify_seals()), layout
    if layout == "accelerate":
        if not os.path.isdir(path):
            raise UsageError(f"{path} is not a directory: an Accelerate checkpoint is the directory save_state wrote.")
        return _accelerate(path, quiet), layout
    if layout == "lightning":
        return _lightning(path), layout
    return _verl(path, quiet), layout


# --------------------------------------------------------------------------------------------------------------------
# The description


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
    if os.path.isfile(path):
        return [path]
    return sorted(name for name in glob.glob(path) if os.path.isfile(name))


def describe(path: str, layout: str = "auto", quiet: bool = False) -> dict[str, Any]:
    """What the checkpoint at `path` holds, as plain data (what `--json` prints)."""
    opened, layout = open_description(path, layout, quiet)
    with opened.checkpoint as stored:
        notes = list(opened.notes)
        model = stored.section("model")
        flats = [key for key in model if is_flat_key(key)]
        world_size, view = opened.world_size, stored
        if is_local(stored):
            records = records_in(stored)
            if set(flats) <= set(records):
                view = Unflattened(stored)
                world_size = world_size or max((r.world_size for r in records.values()), default=None)
            else:
                notes.append(
                    f"{len(set(flats) - set(records))} of the {len(flats)} flat parameters have no layout record "
                    "(saved by torch's FSDP1, by a plain dcp.save, or without the state dict's _metadata): the "
                    "parameters they hold are not recorded; listed as stored (convert them with --layout-from a "
                    "LOCAL checkpoint of the same model saved by fsdp_legacy; save through "
                    "fsdp_legacy.dcp_checkpoint.save, or with FSDP_LEGACY_LAYOUT_KEYS=1, to keep the records)"
                )
        parameters = [
            {"name": str(key), "shape": list(leaf.shape), "dtype": _dtype(leaf.dtype), "bytes": leaf.nbytes}
            for key, leaf in view.section("model").items()
            if isinstance(leaf, TensorMeta)
        ]
        tensors = list(stored.tensors())
        chunks = max((len(stored.chunks(p) or ()) for p, _ in tensors), default=0)
        optimizer = opened.optimizer or _optimizer(stored)
        total = sum(leaf.nbytes for _, leaf in tensors) + (opened.optimizer or {}).get("bytes", 0)
        sections = sorted({str(p[0]) for p in stored.leaves} - {"model", "optim", "layout"})
        carried = sum(1 for p in stored.leaves if p[0] == "layout")
        if carried:
            notes.append(
                f"carries the layout records of {carried} flat parameters: converts back to LOCAL (--to local, any "
                "--world-size) by itself"
            )
        files = _files(path)
        if is_local(stored):
            form = "local"
        else:
            form = {"dcp": "dcp", "full": "full", "per-rank files": "sharded", "safetensors": "safetensors"}[
                opened.storage
            ]
        return {
            "path": path,
            "layout": layout,
            "format": form,
            "description": f"{opened.kind}, {_FORMATS[form]}",
            "world_size": world_size,
            "max_chunks": chunks if opened.storage == "dcp" else None,
            "parameters": parameters,
            "model_bytes": sum(p["bytes"] for p in parameters),
            "flat_parameters": len(flats) if flats else None,
            "optimizer": optimizer,
            "other_sections": sections,
            "tensor_bytes": total,
            "files": len(files),
            "disk_bytes": sum(os.path.getsize(f) for f in files),
            "verified": list(opened.seals.verified),
            "not_verified": list(opened.seals.unverified),
            "notes": notes,
        }


_FORMATS = {
    "local": "a LOCAL state dict (flat parameters, one per FSDP unit)",
    "dcp": "parameters by name (FSDP2's layout; SHARDED_STATE_DICT)",
    "full": "full state dicts",
    "sharded": "a SHARDED state dict (ShardedTensors or DTensors)",
    "safetensors": "model weights",
}


def _optimizer(stored: Checkpoint) -> dict[str, Any]:
    leaves = [(p, leaf) for p, leaf in stored.leaves.items() if p[0] == "optim"]
    if not leaves:
        return {"present": False}
    state = [(p, leaf) for p, leaf in leaves if p[1:2] == ("state",) and len(p) >= 4]
    tensors = [leaf for _, leaf in leaves if isinstance(leaf, TensorMeta)]
    return {
        "present": True,
        "parameters": len({p[2] for p, _ in state}),
        "states": sorted({str(p[3]) for p, _ in state}),
        "tensors": len(tensors),
        "bytes": sum(leaf.nbytes for leaf in tensors),
        "groups": len({p[2] for p, _ in leaves if p[1:2] == ("param_groups",) and len(p) > 2}),
    }


def as_json(found: dict[str, Any]) -> str:
    """Indented JSON, one line per parameter."""
    head = json.dumps({k: v for k, v in found.items() if k != "parameters"}, indent=2)
    rows = ",\n".join(f"    {json.dumps(p)}" for p in found["parameters"])
    return f'{head[:-2]},\n  "parameters": [\n{rows}\n  ]\n}}' if rows else f'{head[:-2]},\n  "parameters": []\n}}'


def as_text(found: dict[str, Any]) -> str:
    optimizer = found["optimizer"]
    lines = [f"{found['path']}: {found['description']}"]
    if found["world_size"]:
        lines.append(f"  world size:  {found['world_size']}")
    if (found["max_chunks"] or 0) > 1:
        lines.append(f"  stored in:   up to {found['max_chunks']} pieces per tensor (DCP loads at any world size)")
    flat = f" (stored as {found['flat_parameters']} flat parameters)" if found["flat_parameters"] else ""
    lines.append(f"  model:       {len(found['parameters'])} tensors, {human_bytes(found['model_bytes'])}{flat}")
    if optimizer["present"]:
        lines.append(
            f"  optimizer:   {', '.join(optimizer['states']) or 'no state'} for {optimizer['parameters']} parameters "
            f"({optimizer['tensors']} tensors, {human_bytes(optimizer['bytes'])}), {optimizer['groups']} param "
            f"group{'s' if optimizer['groups'] != 1 else ''}"
        )
    else:
        lines.append("  optimizer:   none")
    if found["other_sections"]:
        lines.append(f"  also:        {', '.join(found['other_sections'])}")
    lines.append(
        f"  size:        {human_bytes(found['tensor_bytes'])} of tensors; {human_bytes(found['disk_bytes'])} on disk "
        f"in {found['files']} file{'s' if found['files'] != 1 else ''}"
    )
    lines.append(f"  verified:    {'; '.join(found['verified']) or 'nothing: the format carries no seal'}")
    lines += [f"  unverified:  {what}" for what in found["not_verified"]]
    lines += [f"  note:        {note}" for note in found["notes"]]
    rows = [(p["name"], str(tuple(p["shape"])), p["dtype"]) for p in found["parameters"]]
    if rows:
        widths = [max(len(row[i]) for row in [("name", "shape", "dtype"), *rows]) for i in range(3)]
        lines.append("")
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in
                  [("name", "shape", "dtype"), *rows]]  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if (args.path is None) == (args.latest is None):
        raise UsageError("pass either a checkpoint PATH or --latest ROOT (the folder that holds the checkpoints).")
    if args.latest is not None:
        return run_latest(args.latest, args.json)
    check_source(args.path, "checkpoint")
    if os.path.isfile(args.path) and args.path.endswith(".safetensors"):
        raise UsageError(
            f"{args.path} is one safetensors file: pass the directory that holds it (Hugging Face's layout)."
        )
    found = describe(args.path, args.source_layout, args.quiet)
    print(as_json(found) if args.json else as_text(found))
    return EXIT_OK
