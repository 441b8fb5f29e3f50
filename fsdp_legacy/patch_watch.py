"""Patches of torch's FSDP1 internals that would silently change nothing on fsdp_legacy.

Libraries change torch's FSDP1 by replacing its private functions and methods: ColossalAI's FP8 all-gather replaces
`FlatParamHandle._all_gather_flat_param`, Galvatron `_runtime_utils._finalize_params`, ByteCheckpoint and VeOmni the
state-dict hooks of `_state_dict_utils`, an ODC-style gradient service `_runtime_utils._reduce_grad` and the handle's
`_get_shard` / `prepare_gradient_for_optim`. Under the switch
their code runs on ours, whose runtime never calls torch's functions, so each such patch would do nothing (the values
stay right, without the library's change). The switch (compat.py) takes a snapshot of those modules' functions when it
installs; each root's lazy init compares and names, in one warning per name and process, what was replaced since.
(The runtime's steps it calls through torch's names, runtime_names.CALLED_THROUGH, are not among them: a
replacement of those runs.)
"""

from __future__ import annotations

import sys
import types
import warnings
from dataclasses import dataclass

from . import runtime_names

# torch's FSDP1 files whose functions libraries replace (FSDP2's `_fully_shard` is not among them).
WATCHED_MODULES = (
    "_runtime_utils",
    "_state_dict_utils",
    "_optim_utils",
    "_unshard_param_utils",
    "_init_utils",
    "_exec_order_utils",
    "_fsdp_extensions",
    "_common_utils",
    "_traversal_utils",
    "_flat_param",
)


@dataclass
class _Snapshot:
    functions: dict[tuple[str, str], object]  # (module, name) -> the function there at install
    handle_class: type  # ours, as the switch put it under torch's `_flat_param.FlatParamHandle`
    handle_names: frozenset[str]  # torch's FlatParamHandle methods ours does not define


_snapshot: _Snapshot | None = None
_warned: set[str] = set()  # the names warned of since the switch's last install (once each)


def take(package: str, handle_class: type, torch_handle_class: type | None) -> None:
    """Remember the functions of torch's FSDP1 files in `package` as they are now (the switch just installed)."""
    global _snapshot
    _warned.clear()
    functions: dict[tuple[str, str], object] = {}
    for short in WATCHED_MODULES:
        module = sys.modules.get(f"{package}.{short}")
        if module is None:
            continue
        for name, value in vars(module).items():
            if isinstance(value, types.FunctionType):
                functions[(module.__name__, name)] = value
    torch_names = set(vars(torch_handle_class)) if torch_handle_class is not None else set()
    ours = set(dir(handle_class))
    handle_names = frozenset(name for name in torch_names - ours if not name.startswith("__"))
    _snapshot = _Snapshot(functions, handle_class, handle_names)


def forget() -> None:
    global _snapshot
    _snapshot = None


def replaced() -> list[str]:
    """What was replaced since the snapshot: `module.function` and `FlatParamHandle.method` names, sorted."""
    if _snapshot is None:
        return []
    found = []
    for (module_name, name), value in _snapshot.functions.items():
        module = sys.modules.get(module_name)
        called_through = module_name.endswith("._runtime_utils") and name in runtime_names.CALLED_THROUGH
        if module is not None and getattr(module, name, value) is not value and not called_through:
            found.append(f"{module_name.rpartition('.')[2]}.{name}")
    added = _snapshot.handle_names & set(vars(_snapshot.handle_class))
    found.extend(f"FlatParamHandle.{name}" for name in added)
    return sorted(found)


def warn_of_extensions(units: list) -> None:
    """`_fsdp_extension` set on a unit (torch's FSDP1 calls its flatten and state-dict transforms): ours flattens
    DTensor parameters itself and never calls them. Once per process."""
    if not any(getattr(unit, "_fsdp_extension", None) is not None for unit in units) or "_fsdp_extension" in _warned:
        return
    _warned.add("_fsdp_extension")
    warnings.warn(
        "An FSDP unit has an `_fsdp_extension` set (torch's FSDP1 calls its flatten and state-dict transforms), but "
        "fsdp_legacy flattens and shards DTensor parameters itself and never calls an extension's transforms: "
        "parameters and state dicts are as without it.",
        UserWarning,
        stacklevel=3,
    )


def warn_of_replaced() -> None:
    """One warning per process naming the torch internals replaced since the switch was installed (not named yet)."""
    if _snapshot is None:
        return
    new = [name for name in replaced() if name not in _warned]
    if not new:
        return
    _warned.update(new)
    warnings.warn(
        f"torch's FSDP1 {', '.join(new)} {'was' if len(new) == 1 else 'were'} replaced (ColossalAI's FP8 all-gather, "
        "Galvatron's post-backward hooks and ByteCheckpoint's state-dict hooks do this), but fsdp_legacy runs its own "
        "runtime and never calls it: training and checkpoints go on as without the replacement (values unchanged, "
        "without the library's change). Turn the library's option off (ColossalAI: fp8_communication=False), or use "
        "torch's FSDP1 for it.",
        UserWarning,
        stacklevel=3,
    )
