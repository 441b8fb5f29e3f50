"""The save identity in a LOCAL state dict's layout records, so that per-rank files of two saves are told apart
(convert/rank_files.py) without a collective. Each FSDP unit has its own:

    <token>-<optimizer steps>-<loads>

It names the training state a unit's save holds rather than the `state_dict()` call, so it is the same on every rank
however often each rank calls `state_dict()` (calls that hold the same state may share it: files mixed from them are
one consistent checkpoint):

* `token` is agreed once per process group through the group's store (the first rank to ask sets it, every other
  reads it: nobody waits for anybody), so it differs between jobs (and between torchrun restarts, whose stores are
  prefixed per attempt);
* `optimizer steps` counts the `optimizer.step()` calls of optimizers holding the unit's parameters (a global
  post-step hook), the same on every rank of a data-parallel job; optimizers of other models (a probe trained on one
  rank only, say) do not count;
* `loads` counts `load_state_dict` calls into the unit, which every rank makes alike.

A unit that no optimizer stepped between two saves holds the same values in both, so its files agree whichever save
they come from. What it cannot see (docs/failures.md): parameters changed in place by hand between two saves. Where
the group has no usable store, records carry no identity (as torch's files) rather than one that could differ
between ranks.
"""

import uuid
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

_KEY = "fsdp_legacy/save_token"
_tokens: "weakref.WeakKeyDictionary[dist.ProcessGroup, str | None]" = weakref.WeakKeyDictionary()


@dataclass
class _Counts:
    """One unit's history, as far as its saved values go."""

    steps: int = 0
    loads: int = 0


_by_unit: "weakref.WeakKeyDictionary[object, _Counts]" = weakref.WeakKeyDictionary()
_by_param = WeakIdKeyDictionary()  # a unit's parameter (flat or original) -> its unit's _Counts
# An optimizer -> (the sizes of its param groups when looked at, the units its parameters belong to).
_units_of: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[tuple[int, ...], list[_Counts]]]" = (
    weakref.WeakKeyDictionary()
)


def track(unit: object, params: Iterable[torch.Tensor]) -> None:
    """Count the optimizer steps that update `params` (the unit's flat parameters and, with use_orig_params, its
    original ones) towards the unit's identity."""
    counts = _by_unit.setdefault(unit, _Counts())
    for param in params:
        _by_param[param] = counts
    _units_of.clear()  # an optimizer built before this unit's parameters existed is looked at again


def _count_step(optimizer: torch.optim.Optimizer, *_: object) -> None:
    sizes = tuple(len(group["params"]) for group in optimizer.param_groups)
    known = _units_of.get(optimizer)
    if known is None or known[0] != sizes:
        found = {id(c): c for g in optimizer.param_groups for p in g["params"] if (c := _by_param.get(p)) is not None}
        known = _units_of[optimizer] = (sizes, list(found.values()))
    for counts in known[1]:
        counts.steps += 1


register_optimizer_step_post_hook(_count_step)


def note_load(unit: object) -> None:
    """A state dict was loaded into the unit: the state it saves next differs from the one saved before."""
    _by_unit.setdefault(unit, _Counts()).loads += 1


def save_id(unit: object, group: dist.ProcessGroup) -> str | None:
    """The identity of what a LOCAL state dict of `unit` (sharded over `group`) holds now."""
    if group not in _tokens:
        _tokens[group] = _agree_token(group)
    token = _tokens[group]
    counts = _by_unit.setdefault(unit, _Counts())
    return None if token is None else f"{token}-{counts.steps}-{counts.loads}"


def _agree_token(group: dist.ProcessGroup) -> str | None:
    try:
        store = group.get_group_store()
        token = store.compare_set(_KEY, "", uuid.uuid4().hex)  # the first writer's value, for everyone
    except (AttributeError, RuntimeError, NotImplementedError, ValueError):  # a group without a store (a fake one)
        return None
    text = token.decode() if isinstance(token, bytes) else str(token)
    return text or None
