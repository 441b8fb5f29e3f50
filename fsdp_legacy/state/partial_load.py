"""No partial resume from a DCP checkpoint: a load whose target would receive fewer tensors than the checkpoint holds
is an error, not a silent skip (dcp.load fills only the keys the target has, so an optimizer state dict taken from an
optimizer that has not stepped yet, `{"state": {}, ...}`, receives no state at all).

The rule works per section (a top-level key of the saved state, such as "model" or "optim"): a section the target
leaves out is not loaded (loading the model alone from a model + optimizer checkpoint is fine); a section it has
must take every tensor the checkpoint holds under it.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..convert.errors import CheckpointError
from ..convert.record import is_record_key

_LISTED = 8  # missing keys named in the message


def _holds(tree: Any, path: Sequence[Any]) -> bool:
    """Whether the target has something at `path` (what dcp.load would fill). An object that is neither a mapping nor
    a list (a Stateful, whose state DCP asks for) counts as holding everything under it."""
    for part in path:
        if isinstance(tree, torch.Tensor):
            return True
        if isinstance(tree, Mapping):
            if part not in tree:
                return False
            tree = tree[part]
        elif isinstance(tree, (list, tuple)):
            if not (isinstance(part, int) and 0 <= part < len(tree)):
                return False
            tree = tree[part]
        else:
            return True
    return True


def missing_tensors(state: Mapping[str, Any], metadata: Metadata) -> list[str]:
    """The checkpoint's tensors (DCP keys) that `state` would not receive, in the sections `state` has."""
    mapping = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    top_level = [k for k, v in metadata.state_dict_metadata.items() if len(tuple(mapping.get(k, (k,)))) == 1]
    bare = any(key in state for key in top_level)  # the target is a bare state dict, as the checkpoint's top level
    missing = []
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        path = tuple(mapping.get(key, (key,)))
        if is_record_key(path[-1]):
            continue  # an earlier version's layout record stored as a tensor: a description, not state
        expected = path[0] in state if len(path) > 1 else bare
        if expected and not _holds(state, path):
            missing.append(key)
    return sorted(missing)


def check_complete_load(state: Mapping[str, Any], metadata: Metadata, where: str) -> None:
    """Raise CheckpointError naming what `state` would not receive from the checkpoint at `where`, and the fix."""
    missing = missing_tensors(state, metadata)
    if not missing:
        return
    listed = ", ".join(missing[:_LISTED]) + (f" and {len(missing) - _LISTED} more" if len(missing) > _LISTED else "")
    optimizer = any(".state." in key or key.startswith("state.") for key in missing)
    fix = (
        " An optimizer state dict taken from an optimizer that has not stepped yet has no state entries to load "
        "into: build it with fsdp_legacy.checkpoint.get_optimizer_state_dict(model, optimizer) (it creates the "
        "state first) or torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict(model_state_dict, "
        "'optim', storage_reader), or take an optimizer step before FSDP.optim_state_dict."
        if optimizer
        else " Load into a state dict of the model and optimizer that were saved."
    )
    raise CheckpointError(
        f"{where} holds {len(missing)} tensor(s) that the state to load has no place for, so they would be skipped "
        f"and the run would resume partly from the checkpoint: {listed}.{fix} To load only part of a checkpoint on "
        "purpose, leave its section out of the state, or pass strict=False."
    )
