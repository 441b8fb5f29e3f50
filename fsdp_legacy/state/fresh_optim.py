"""No silent partial resume: an optimizer state dict taken from an optimizer that has no state yet, used as a load
target, then loaded into the optimizer.

    osd = FSDP.optim_state_dict(model, fresh_optimizer)      # {"state": {}, "param_groups": [...]}
    dcp.load({"optim": osd}, checkpoint_id=...)                # fills only the keys the target has: param_groups
    FSDP.optim_state_dict_to_load(model, fresh_optimizer, osd) # torch's FSDP1: no state, no error

With torch's FSDP1 the resumed run trains on from zeroed optimizer state (no momentum, no Adam moments); Accelerate
resumes SHARDED_STATE_DICT optimizers this way. Ours restores the state: `optim_state_dict` remembers the dicts it
returned for an optimizer with no state, and a load that reads the checkpoint (torch's dcp.load through
dcp_load_hook.py, or fsdp_legacy.dcp_checkpoint.load) first gives such a target an entry for every state the
checkpoint holds for its parameters (`fill_from_checkpoint`), built by the same save code from zeros of the saved
dtypes, so the load fills them. A checkpoint with no state for it (saved before the first step) leaves it as it is.
Where no such load ran (a loader bound before fsdp_legacy was imported, a storage reader that is not a directory),
`optim_state_dict_to_load` refuses a target whose param_groups a loader replaced while its state stayed empty, on
each rank that passes one, without a collective (see load_target_problem). A dict saved and loaded with torch.save,
or passed straight back, is a new object or unchanged, so a run that truly never stepped saves and loads as with
torch's.
"""

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

_KEPT = 4  # targets remembered per optimizer: a resume takes one


@dataclass(frozen=True)
class Refill:
    """How to build a target's state: the optimizer's parameters in its state-dict order, with the FQNs each stands
    for (read when a load fills the target, not on every save), and the save that turns an id-keyed optimizer state
    dict into the target's format (a collective: every rank holding the model runs it)."""

    params: Callable[[], list[tuple[torch.Tensor, tuple[str, ...]]]]
    build: Callable[[dict[str, Any]], dict[str, Any]]
    uses_orig_params: bool


@dataclass
class _Target:
    """A dict `optim_state_dict` returned for an optimizer with no state (held strongly: plain dicts take no weak
    references; they are small, a few per optimizer, and die with it)."""

    osd: dict[str, Any]
    state: Any
    param_groups: Any  # the list returned: a loader replaces it
    refill: Refill | None
    checked: bool = False  # a loader that read the checkpoint found no state for it there


_targets: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[_Target]]" = weakref.WeakKeyDictionary()


def _trained(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optim.param_groups for p in group["params"] if p.requires_grad]


def note_returned(optim: torch.optim.Optimizer, osd: dict[str, Any], refill: Refill | None) -> None:
    """`osd` was returned by optim_state_dict for `optim`: remember it if `optim` has no state yet. `refill` is None
    where not every rank holds a target (FULL with rank0_only)."""
    if not isinstance(osd, dict) or "param_groups" not in osd or osd.get("state"):
        return
    if any(p in optim.state and optim.state[p] for p in _trained(optim)):
        return
    kept = _targets.setdefault(optim, [])
    kept.append(_Target(osd, osd.get("state"), osd["param_groups"], refill))
    del kept[:-_KEPT]


def _found(tree: Any, want: Callable[[_Target], bool]) -> list[tuple[_Target, tuple[str, ...]]]:
    """The remembered targets inside `tree` that `want`, with their paths (the keys down to them)."""
    by_id = {id(t.osd): t for kept in _targets.values() for t in kept if want(t)}
    found: list[tuple[_Target, tuple[str, ...]]] = []

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if id(node) in by_id:
            found.append((by_id[id(node)], path))
        elif isinstance(node, Mapping):
            for key, value in node.items():
                if isinstance(value, Mapping):
                    walk(value, (*path, key))

    if by_id:
        walk(tree, ())
    return found


def _pending(target: _Target) -> bool:
    return target.refill is not None and not target.checked and not target.osd.get("state")


def has_pending_targets(tree: Any) -> bool:
    """Whether `tree` (a state dict about to be loaded) holds a fresh optimizer's target that a load could fill."""
    return bool(_found(tree, _pending))


def fill_from_checkpoint(tree: Any, metadata: Metadata) -> None:
    """Give each fresh optimizer's target inside `tree` the state entries the checkpoint holds for its parameters (so
    that a load fills them), or mark it checked where the checkpoint holds none. The same on every rank: all read
    the same metadata."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    for target, path in _found(tree, _pending):
        held: dict[str, dict[str, Any]] = {}  # fqn -> state name -> storage metadata
        for key, entry in metadata.state_dict_metadata.items():
            parts = _parts(key, paths, path)
            if len(parts) == len(path) + 3 and parts[: len(path)] == path and parts[len(path)] == "state":
                held.setdefault(str(parts[-2]), {})[str(parts[-1])] = entry
        refill = target.refill
        assert refill is not None
        if not held:
            target.checked = True  # saved before the first step: nothing to restore
            continue
        params = enumerate(refill.params())
        state = {i: _zeros(param, fqns, held, refill.uses_orig_params) for i, (param, fqns) in params}
        built = refill.build({"state": {i: s for i, s in state.items() if s}})
        target.osd["state"].update(built["state"])


def _parts(key: str, paths: Mapping[str, Any], path: tuple[str, ...]) -> tuple[Any, ...]:
    """The keys down to a checkpoint entry: DCP's record of them, else (a save that did not flatten) read from the
    dotted key under `path`, whose FQN may hold dots but whose state name does not."""
    if key in paths:
        return tuple(paths[key])
    prefix = ".".join((*path, "state", ""))
    if not key.startswith(prefix) or "." not in key[len(prefix) :]:
        return ()
    return (*path, "state", *key[len(prefix) :].rsplit(".", 1))


def _zeros(param: torch.Tensor, fqns: tuple[str, ...], held: dict[str, dict[str, Any]], orig: bool) -> dict[str, Any]:
    """What the optimizer's state for `param` would hold, as zeros of the saved dtypes: states the size of the
    parameters take `param`'s (local) shape, 0-d ones (Adam's step) stay 0-d; non-tensors are placeholders the load
    replaces."""
    names: dict[str, Any] = {}
    for fqn in fqns:
        for name, entry in held.get(fqn, {}).items():
            names.setdefault(name, entry)
    if orig and param.numel() == 0:
        return {}  # a rank that holds no element of the parameter keeps no state for it, as after a step
    state: dict[str, Any] = {}
    for name, entry in names.items():
        if isinstance(entry, TensorStorageMetadata):
            dtype = entry.properties.dtype
            scalar = len(entry.size) == 0
            state[name] = torch.zeros((), dtype=dtype) if scalar else torch.zeros_like(param, dtype=dtype)
        elif isinstance(entry, BytesStorageMetadata):
            state[name] = None
    return state


def mark_checked(tree: Any) -> None:
    """The targets inside `tree` were loaded by a loader that checked the checkpoint: no refusal later."""
    for target, _ in _found(tree, lambda _: True):
        target.checked = True


def _problem(optim: torch.optim.Optimizer, osd: Any) -> str | None:
    if not isinstance(osd, dict) or osd.get("state") or not _trained(optim):
        return None
    for target in _targets.get(optim, ()):
        same = osd is target.osd or (target.state is not None and osd.get("state") is target.state)
        if same and not target.checked and osd.get("param_groups") is not target.param_groups:
            return (
                "optim_state_dict_to_load was given an optimizer state dict with no state for any parameter, taken "
                "with FSDP.optim_state_dict from an optimizer that had not stepped yet and since filled by a load "
                "that fsdp_legacy could not see into (its param_groups were replaced): a load target without state "
                "entries receives no state, so the optimizer would resume from zeroed state (no momentum, no Adam "
                "moments) although the checkpoint may hold it. Load with torch.distributed.checkpoint.load (as "
                "dcp.load, looked up after fsdp_legacy is imported) or fsdp_legacy.dcp_checkpoint.load, which fill "
                "such a target from the checkpoint; or build the target from the checkpoint: torch.distributed."
                "checkpoint.optimizer.load_sharded_optimizer_state_dict(model_state_dict, 'optim', storage_reader), "
                "or fsdp_legacy.checkpoint.get_optimizer_state_dict(model, optimizer) (it creates the state first) "
                "and set_optimizer_state_dict."
            )
    return None


def load_target_problem(optim: torch.optim.Optimizer, osd: Any) -> str | None:
    """Why `osd` must not be loaded into `optim` (a load target that lost the checkpoint's state), or None.

    Local by design: torch's optim_state_dict_to_load of a FULL dict runs no collective, and programs call it one
    rank at a time (OLMo's full checkpointer loads turn by turn, with a barrier after each), so asking the other
    ranks here would hang them. A dict with this problem holds no state, so the load that follows runs no collective
    either: a rank that raises leaves none of the others waiting in this call. With rank0_only, rank 0's verdict
    travels with its dict in the broadcast that load already makes."""
    return _problem(optim, osd)
