"""torch's dcp.load, seen by fsdp_legacy: before it loads, a fresh optimizer's state dict among its targets is given
the state entries the checkpoint holds (fresh_optim.py), so that a resume through

    dcp.load({"optim": FSDP.optim_state_dict(model, fresh_optimizer)}, checkpoint_id=...)

(Accelerate's for SHARDED_STATE_DICT) restores the optimizer's state, where torch's FSDP1 silently restores none.

`install()` wraps `torch.distributed.checkpoint.load` (the module attribute, as `dcp.load` looks it up) when
fsdp_legacy is imported, or at the latest when optim_state_dict returns such a dict. Any other load passes straight
through: the wrapper only looks for the dicts our optim_state_dict returned for optimizers without state. The
checkpoint's metadata is read on the load's rank 0 with our own reader, which runs no pickled code, and shared with
the other ranks; a checkpoint it cannot read (or a storage reader that is not a directory) is left to torch's load,
and to the refusal in optim_state_dict_to_load.
"""

import contextlib
import functools
import inspect
import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_loader
from torch.distributed.checkpoint.metadata import Metadata

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
    if not has_pending_targets(state):  # (every rank holds one: optim_state_dict is a collective)
        return
    metadata = _shared_metadata(arguments)
    if metadata is not None:
        fill_from_checkpoint(state, metadata)


def _shared_metadata(arguments: inspect.BoundArguments) -> Metadata | None:
    """The checkpoint's metadata as the load's rank 0 reads it, on every rank (as DCP's own load reads it there and
    broadcasts it): filling the targets is a collective, so every rank must fill from the same metadata or none,
    also where the other ranks cannot see the directory."""
    group = arguments.arguments.get("process_group")
    distributed = dist.is_initialized() and not arguments.arguments.get("no_dist", False)
    metadata = None
    if not distributed or dist.get_rank(group) == 0:
        directory = _directory(arguments)
        if directory is not None and os.path.isfile(os.path.join(directory, METADATA_FILE)):
            with contextlib.suppress(CheckpointError):  # (torch's load reports the damage)
                metadata = read_metadata(os.path.join(directory, METADATA_FILE))
    if distributed and dist.get_world_size(group) > 1:
        holder = [metadata]
        dist.broadcast_object_list(holder, group=group, group_src=0)
        metadata = holder[0]
    return metadata


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
