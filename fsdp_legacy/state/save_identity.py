"""The save identity in a LOCAL state dict's layout records, so that per-rank files of two saves are told apart
(convert/rank_files.py) without a collective:

    <token>-<optimizer steps>-<loads>

It names the training state a save holds rather than the `state_dict()` call, so it is the same on every rank
however often each rank calls `state_dict()` (calls that hold the same state may share it: files mixed from them are
one consistent checkpoint):

* `token` is agreed once per process group through the group's store (the first rank to ask sets it, every other
  reads it: nobody waits for anybody), so it differs between jobs (and between torchrun restarts, whose stores are
  prefixed per attempt);
* `optimizer steps` counts every `optimizer.step()` of the process (a global post-step hook), the same on every rank
  of a data-parallel job;
* `loads` counts `load_state_dict` calls into FSDP units, which every rank makes alike.

What it cannot see (docs/failures.md): parameters changed in place by hand between two saves, and ranks that step
optimizers the others do not. Where the group has no usable store, records carry no identity (as torch's files)
rather than one that could differ between ranks.
"""

import uuid
import weakref

import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

_KEY = "fsdp_legacy/save_token"
_tokens: "weakref.WeakKeyDictionary[dist.ProcessGroup, str | None]" = weakref.WeakKeyDictionary()
_counts = {"steps": 0, "loads": 0}


def _count_step(*_: object) -> None:
    _counts["steps"] += 1


register_optimizer_step_post_hook(_count_step)


def note_load() -> None:
    """A state dict was loaded into an FSDP unit: the state saved next differs from the one saved before."""
    _counts["loads"] += 1


def save_id(group: dist.ProcessGroup) -> str | None:
    """The identity of what a LOCAL state dict of a unit on `group` holds now."""
    if group not in _tokens:
        _tokens[group] = _agree_token(group)
    token = _tokens[group]
    return None if token is None else f"{token}-{_counts['steps']}-{_counts['loads']}"


def _agree_token(group: dist.ProcessGroup) -> str | None:
    try:
        store = group.get_group_store()
        token = store.compare_set(_KEY, "", uuid.uuid4().hex)  # the first writer's value, for everyone
    except (AttributeError, RuntimeError, NotImplementedError, ValueError):  # a group without a store (a fake one)
        return None
    text = token.decode() if isinstance(token, bytes) else str(token)
    return text or None
