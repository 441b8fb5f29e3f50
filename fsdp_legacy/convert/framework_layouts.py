"""The FSDP1 checkpoints Accelerate and Lightning write, as one checkpoint with "model" and "optim" sections.

Accelerate (`accelerator.save_state(dir)`, accelerate/utils/fsdp_utils.py), by the plugin's state_dict_type:
  FULL_STATE_DICT   pytorch_model_fsdp.bin (the model state dict), optimizer.bin (FSDP.optim_state_dict)
  SHARDED_STATE_DICT pytorch_model_fsdp_0/ (DCP of {"model": ...}), optimizer_0/ (DCP of {"optimizer": ...}); with
                    use_dcp=False, pytorch_model_fsdp_0_rank{r}.bin and optimizer_0_rank{r}.bin (ShardedTensors)
  LOCAL_STATE_DICT  pytorch_model_fsdp_rank{r}.bin (flat parameters), optimizer_0/ as above
The optimizer state is keyed by FQN in all of them. Model 0 and optimizer 0 are read (a second prepared model saves
under `_1` names beside them).

Lightning (lightning/fabric/strategies/fsdp.py and lightning/pytorch/strategies/fsdp.py):
  sharded  a DCP directory with `meta.pt` (the non-tensor state, not converted): Fabric stores the model and the
           optimizer under the user's keys (`fabric.save(path, {"model": model, "optimizer": optim})`), the Trainer
           under "model" and "optimizer_0"
  full     one torch.save file: Fabric's with the user's keys; the Trainer's with "state_dict" and "optimizer_states",
           whose optimizer state is keyed by parameter index (FSDP.rekey_optim_state_dict to PARAM_ID)
The Trainer's keys are the LightningModule's (its attribute names included: "model.layers.0...").
"""

import glob
import os
import zipfile
from collections.abc import Mapping

from .checkpoint import Checkpoint, Path
from .dcp_files import METADATA_FILE, DcpCheckpoint, is_dcp
from .errors import CheckpointError
from .integrity import ZIP_ERRORS, check_archive
from .loading import safe_load
from .optim_keys import check_shapes, index_names, keyed_by_name
from .rank_files import RankFiles
from .seals import ARCHIVE, Seals
from .torch_file import TorchFile
from .views import Composite, Rename, Tree, find_sections, renamed

ACCELERATE_MODEL, ACCELERATE_OPTIM = "pytorch_model_fsdp", "optimizer"
LIGHTNING_META = "meta.pt"
_TRAINER_MARK = b"pytorch-lightning_version"  # a key of every Trainer checkpoint


# --------------------------------------------------------------------------------------------------------------------
# Accelerate


def accelerate_entries(directory: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """What of Accelerate's model 0 and optimizer 0 `directory` holds: {kind: [paths]} for each."""

    def ranks(pattern: str) -> list[str]:
        return sorted(glob.glob(os.path.join(glob.escape(directory), pattern)))

    model = {
        "FULL_STATE_DICT file": [p for p in [os.path.join(directory, f"{ACCELERATE_MODEL}.bin")] if os.path.isfile(p)],
        "SHARDED_STATE_DICT DCP directory": [
            p for p in [os.path.join(directory, f"{ACCELERATE_MODEL}_0")] if is_dcp(p)
        ],
        "SHARDED_STATE_DICT per-rank files": ranks(f"{ACCELERATE_MODEL}_0_rank*.bin"),
        "LOCAL_STATE_DICT per-rank files": ranks(f"{ACCELERATE_MODEL}_rank*.bin"),
    }
    optim = {
        "full file": [p for p in [os.path.join(directory, f"{ACCELERATE_OPTIM}.bin")] if os.path.isfile(p)],
        "DCP directory": [p for p in [os.path.join(directory, f"{ACCELERATE_OPTIM}_0")] if is_dcp(p)],
        "per-rank files": ranks(f"{ACCELERATE_OPTIM}_0_rank*.bin"),
    }
    return {k: v for k, v in model.items() if v}, {k: v for k, v in optim.items() if v}


def is_accelerate(directory: str) -> bool:
    return os.path.isdir(directory) and any(accelerate_entries(directory)[0])


def open_accelerate(directory: str, optimizer: bool = True) -> Checkpoint:
    if not os.path.isdir(directory):
        raise CheckpointError(
            f"{directory} is not a directory: an Accelerate checkpoint is the directory save_state wrote (pass it, "
            "or --from full for a single pytorch_model_fsdp.bin)."
        )
    model, optim = accelerate_entries(directory)
    for what, found in (("model", model), ("optimizer", optim)):
        if len(found) > 1:
            listed = "; ".join(f"{kind}: {', '.join(map(os.path.basename, paths))}" for kind, paths in found.items())
            raise CheckpointError(
                f"{directory} holds Accelerate's {what} state in more than one layout ({listed}): saves with different "
                "state_dict_type settings were written to one directory. Keep the files of one save."
            )
    if not model:
        raise CheckpointError(
            f"{directory} holds no model state Accelerate's save_state writes ({ACCELERATE_MODEL}.bin, "
            f"{ACCELERATE_MODEL}_0/, {ACCELERATE_MODEL}_rank*.bin): not an Accelerate FSDP checkpoint (pass --from)."
        )
    parts: list[tuple[Checkpoint, Rename]] = []
    try:
        parts.append((_open_part(next(iter(model.values())), directory), renamed({"model": "model"})))
        if optim and optimizer:
            kind, paths = next(iter(optim.items()))
            opened = _open_part(paths, directory)
            if kind == "full file":  # {"state": ..., "param_groups": ...} at the top level
                parts.append((opened, _under_optim))
            else:  # DCP: {"optimizer": ...}; per-rank files: read as a bare state dict, under "model"
                parts.append((opened, renamed({"optimizer": "optim", "model": "optim"})))
        return Composite(directory, parts)
    except BaseException:
        for part, _ in parts:
            part.close()
        raise


def _under_optim(path: Path) -> Path | None:
    return ("optim", *path) if path[0] in ("state", "param_groups") else None


def _open_part(paths: list[str], directory: str) -> Checkpoint:
    if len(paths) == 1 and os.path.isdir(paths[0]):
        return DcpCheckpoint(paths[0])
    if len(paths) == 1 and "_rank" not in os.path.basename(paths[0]):
        return TorchFile(paths[0])
    return RankFiles(paths, directory)


# --------------------------------------------------------------------------------------------------------------------
# Lightning


def is_lightning_directory(path: str) -> bool:
    return is_dcp(path) and os.path.isfile(os.path.join(path, LIGHTNING_META))


def is_trainer_file(path: str) -> bool:
    """Whether `path` is a torch.save archive of a Trainer checkpoint (its pickle read as bytes, nothing unpickled)."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("/data.pkl") or name == "data.pkl"]
            return len(pickles) == 1 and _TRAINER_MARK in archive.read(pickles[0])
    except ZIP_ERRORS:  # (damaged: integrity.py)
        return False


def open_lightning(path: str, optimizer: bool = True) -> Checkpoint:
    if os.path.isdir(path):
        if not is_dcp(path):
            raise CheckpointError(
                f"{path} is a directory without {METADATA_FILE}: a sharded Lightning checkpoint is the DCP directory "
                f"its save wrote (with {METADATA_FILE} and {LIGHTNING_META}); the save did not finish, or this is not "
                "one."
            )
        return sections_of(DcpCheckpoint(path), "a sharded Lightning checkpoint")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist.")
    if is_trainer_file(path):
        return _trainer_file(path, optimizer)
    return sections_of(TorchFile(path), "a full Lightning Fabric checkpoint")


def sections_of(checkpoint: Checkpoint, what: str) -> Checkpoint:
    """`checkpoint` with its model state dict as "model" and its optimizer state as "optim", wherever they are."""
    try:
        model, optim = find_sections(checkpoint, what)
        if model is None:
            raise CheckpointError(
                f"{checkpoint.location} ({what}) has no model state dict among its top-level keys "
                f"({', '.join(sorted({str(p[0]) for p in checkpoint.leaves}))}): not a checkpoint of a model."
            )
        sections = {model: "model"} | ({optim: "optim"} if optim is not None else {})
        return Composite(checkpoint.location, [(checkpoint, renamed(sections))])
    except BaseException:
        checkpoint.close()
        raise


def _trainer_file(path: str, optimizer: bool) -> Checkpoint:
    with open(path, "rb") as file:
        check_archive(file, path)
    tree = safe_load(path, path, mmap=True)
    model = tree.get("state_dict") if isinstance(tree, Mapping) else None
    if not isinstance(model, Mapping):
        raise CheckpointError(f"{path} is a Lightning Trainer checkpoint without a state_dict: it is damaged.")
    optimizers = (tree.get("optimizer_states") or []) if optimizer else []
    if len(optimizers) > 1:
        raise CheckpointError(
            f"{path} holds the states of {len(optimizers)} optimizers: converting several into one checkpoint is not "
            "supported. Convert the model alone with --model-only."
        )
    converted: dict = {"model": dict(model)}
    if optimizers:
        optim = optimizers[0]
        if any(isinstance(key, int) for key in optim.get("state", {})) or _indexed_groups(optim):
            names = index_names(
                optim,
                list(model),
                path,
                "Convert the model alone with --model-only, or save with FSDPStrategy(state_dict_type='sharded'), "
                "whose optimizer state is keyed by name.",
            )
            optim = keyed_by_name(optim, names)
            shapes = {name: tuple(model[name].shape) for name in names.values()}
            check_shapes(
                {n: {k: tuple(getattr(v, "shape", ())) for k, v in s.items()} for n, s in optim["state"].items()},
                shapes,
                path,
            )
        converted["optim"] = optim
    return Tree(path, converted, Seals((ARCHIVE,)))


def _indexed_groups(optim: Mapping) -> bool:
    return any(isinstance(i, int) for group in optim.get("param_groups", []) for i in group.get("params", []))
