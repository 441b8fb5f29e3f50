"""torch's dcp.load, seen by fsdp_legacy: before it loads, a fresh optimizer's state dict among its targets is given
the state entries the checkpoint holds (fresh_optim.py), so that a resume through

    dcp.load({"optim": FSDP.optim_state_dict(model, fresh_optimizer)}, checkpoint_id=...)

(Accelerate's for SHARDED_STATE_DICT) restores the optimizer's state instead of none, as torch's FSDP1 silently does.

`install()` wraps `torch.distributed.checkpoint.load` (the module attribute, as `dcp.load` looks it up) when
fsdp_legacy is imported, or at the latest when optim_state_dict returns such a dict. Any other load passes straight
through: the wrapper only looks for the dicts our optim_state_dict returned for optimizers without state. The
checkpoint's metadata is read with our own reader, which runs no pickled code; a checkpoint it cannot read (or a
storage reader that is not a directory) is left to torch's load, and to the refusal in optim_state_dict_to_load.
"""

import functools
import inspect
import os
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_loader

from ..convert.dcp_files import METADATA_FILE, read_metadata
from ..convert.errors import CheckpointError
from .fresh_optim import fill_from_checkpoint, has_pending_targets

_MARK = "_fsdp_legacy_fills_fresh_optimizers"


def _directory(arguments: inspect.BoundArguments) -> str | None:
    checkpoint_id = arguments.arguments.get("checkpoint_id")
    if checkpoint_id is None:  # a FileSystemReader knows its directory
        checkpoint_id = getattr(arguments.arguments.get("storage_reader"), "path", None)
    if isinstance(checkpoint_id, (str, os.PathLike)) and os.path.isdir(checkpoint_id):
        return os.fspath(checkpoint_id)
    return None


def _before_load(load: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        arguments = inspect.signature(load).bind(*args, **kwargs)
    except TypeError:
        return  # torch's own call raises its error
    state = arguments.arguments.get("state_dict")
    if not has_pending_targets(state):
        return
    directory = _directory(arguments)
    if directory is None or not os.path.isfile(os.path.join(directory, METADATA_FILE)):
        return
    try:
        metadata = read_metadata(os.path.join(directory, METADATA_FILE))
    except CheckpointError:
        return  # torch's load reports the damage
    fill_from_checkpoint(state, metadata)


def install() -> None:
    """Wrap torch.distributed.checkpoint.load (once). Called when fsdp_legacy is imported and again by
    optim_state_dict: under FSDP_LEGACY=1, torch's own import of torch.distributed.checkpoint may import fsdp_legacy
    before it has defined `load`, and the wrapper then comes at the first optimizer state dict."""
    original = getattr(state_dict_loader, "load", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        _before_load(original, args, kwargs)
        return original(*args, **kwargs)

    setattr(load, _MARK, True)
    for module in (dcp, state_dict_loader):
        if getattr(module, "load", None) is original:
            module.load = load  # type: ignore[attr-defined]
