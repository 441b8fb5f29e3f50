"""No silent partial resume: an optimizer state dict taken from an optimizer that has no state yet, used as a load
target, then loaded into the optimizer.

    osd = FSDP.optim_state_dict(model, fresh_optimizer)      # {"state": {}, "param_groups": [...]}
    dcp.load({"optim": osd}, checkpoint_id=...)                # fills only the keys the target has: param_groups
    FSDP.optim_state_dict_to_load(model, fresh_optimizer, osd) # torch's FSDP1: no state, no error

With torch's FSDP1 the resumed run trains on from zeroed optimizer state (no momentum, no Adam moments). What is
returned cannot be changed without changing what a normal save writes, and dcp.load is torch's, so the loss is caught
where the target comes back: `optim_state_dict` remembers the dicts it returned for an optimizer with no state, and
`optim_state_dict_to_load` refuses such a dict once a loader has replaced its param_groups (dcp.load does) while its
state is still empty. A dict saved and loaded with torch.save, or passed straight back, is a new object or unchanged,
so a run that truly never stepped saves and loads as with torch's. `fsdp_legacy.dcp_checkpoint.load` checks the
checkpoint itself and marks the targets it found complete (a checkpoint saved before the first step) as loaded.
"""

import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..unit import FSDPUnit

_KEPT = 4  # targets remembered per optimizer: a resume takes one


@dataclass
class _Target:
    """A dict `optim_state_dict` returned for an optimizer with no state (held strongly: plain dicts take no weak
    references; they are small, a few per optimizer, and die with it)."""

    osd: dict[str, Any]
    state: Any
    param_groups: Any  # the list returned: a loader replaces it
    checked: bool = False  # fsdp_legacy.dcp_checkpoint.load found no state for it in the checkpoint


_targets: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[_Target]]" = weakref.WeakKeyDictionary()


def _trained(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optim.param_groups for p in group["params"] if p.requires_grad]


def note_returned(optim: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
    """`osd` was returned by optim_state_dict for `optim`: remember it if `optim` has no state yet."""
    if not isinstance(osd, dict) or "param_groups" not in osd or osd.get("state"):
        return
    if any(p in optim.state and optim.state[p] for p in _trained(optim)):
        return
    kept = _targets.setdefault(optim, [])
    kept.append(_Target(osd, osd.get("state"), osd["param_groups"]))
    del kept[:-_KEPT]


def mark_checked(tree: Any) -> None:
    """The targets inside `tree` were loaded by a loader that found no state for them in the checkpoint."""
    found = {id(value) for value in _dicts(tree)}
    for kept in _targets.values():
        for target in kept:
            if id(target.osd) in found:
                target.checked = True


def _dicts(tree: Any) -> list[Any]:
    out = [tree]
    if isinstance(tree, Mapping):
        for value in tree.values():
            if isinstance(value, Mapping):
                out += _dicts(value)
    return out


def _problem(optim: torch.optim.Optimizer, osd: Any) -> str | None:
    if not isinstance(osd, dict) or osd.get("state") or not _trained(optim):
        return None
    for target in _targets.get(optim, ()):
        same = osd is target.osd or (target.state is not None and osd.get("state") is target.state)
        if same and not target.checked and osd.get("param_groups") is not target.param_groups:
            return (
                "optim_state_dict_to_load was given an optimizer state dict with no state for any parameter, taken "
                "with FSDP.optim_state_dict from an optimizer that had not stepped yet and since filled by a load "
                "(dcp.load replaces its param_groups): a load target without state entries receives no state, so "
                "the optimizer would resume from zeroed state (no momentum, no Adam moments) although the "
                "checkpoint may hold it. Build the target from the checkpoint instead: torch.distributed.checkpoint."
                "optimizer.load_sharded_optimizer_state_dict(model_state_dict, 'optim', storage_reader), or "
                "fsdp_legacy.checkpoint.get_optimizer_state_dict(model, optimizer) (it creates the state first) "
                "and set_optimizer_state_dict; or load with fsdp_legacy.dcp_checkpoint.load, which checks the "
                "checkpoint (and lets a checkpoint saved before the first optimizer step load as it is)."
            )
    return None


def check_load_target(
    model: nn.Module, optim: torch.optim.Optimizer, osd: Any, group: dist.ProcessGroup | None
) -> None:
    """Warn on every rank if any rank passes a load target that lost the checkpoint's state. The ranks agree over
    `group`, else the model's root unit's group (every rank that holds the model calls this).

    A warning, not an error: torch's FSDP1 runs this flow, and frameworks resume through it (transformers' Trainer,
    through Accelerate, with SHARDED_STATE_DICT), so refusing it would stop their users' resumes; what was lost
    cannot be recovered here (the checkpoint is not known). fsdp_legacy.dcp_checkpoint.load, which reads the
    checkpoint, refuses such a load."""
    problem = _problem(optim, osd)
    if group is None:
        group = next((m.process_group for m in model.modules() if isinstance(m, FSDPUnit)), None)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, problem, group=group)
        rank, problem = next(((r, p) for r, p in enumerate(everyone) if p), (0, None))
        if problem and rank != dist.get_rank(group):
            problem = f"{problem} (on rank {rank})"
    if problem:
        warnings.warn(problem, UserWarning, stacklevel=3)
