"""The switch that puts fsdp_legacy under torch's FSDP1 names, for code that never names fsdp_legacy (Accelerate,
Lightning, transformers' Trainer, TRL, verl, and torch's own DSD helpers):

    import fsdp_legacy
    fsdp_legacy.install()        # or FSDP_LEGACY=1 in the environment, no code change (see autoinstall.py)
    from torch.distributed.fsdp import FullyShardedDataParallel   # fsdp_legacy's

`install()` replaces, in torch's FSDP1 modules (`torch.distributed.fsdp` and its submodules), the FSDP1 names by
fsdp_legacy's: the wrapper, enums, configs, wrap policies, `enable_wrap`/`wrap`, `ShardedGradScaler`,
`FlatParameter`, and the private helpers code imports from torch's FSDP1 files (torch_helpers.py: `_lazy_init`,
`_unshard`, `_reshard`, `_get_fsdp_states`, `_get_fsdp_handles`, `_get_module_fsdp_state`; each calls torch's own for
objects that are not ours). Modules that imported those names before (torch's DSD helpers hold `FSDP` as a module
global; a framework may have imported it at start) get ours too: every loaded module's globals that are torch's
objects are swapped. Where torch no longer has an FSDP1 module, a stand-in module with our names takes its place.
`uninstall()` restores every name exactly; both are idempotent.

This module is the one place in the package that imports torch's FSDP1 modules, and only to replace names in them.
"""

from __future__ import annotations

import abc
import importlib
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import api, patch_watch, runtime_names, torch_helpers, wrap
from .flat_param import FlatParameter
from .flat_param_metadata import FlatParamShardMetadata
from .fully_sharded_data_parallel import FullyShardedDataParallel
from .handle import FlatParamHandle, HandleTrainingState
from .handle_torch_names import HandleShardingStrategy
from .sharded_grad_scaler import ShardedGradScaler
from .torch_helpers import NOT_OURS
from .unit import TrainingState

_FSDP1 = "torch.distributed.fsdp"
_WRAP_NAMES = (*wrap.__all__, "_or_policy", "_module_wrap_policy", "_Policy", "_wrap")
_MISSING = object()


@dataclass
class _Installed:
    """What install() changed, to undo it: (namespace, name, previous value or _MISSING)."""

    replaced: list[tuple[Any, str, Any]] = field(default_factory=list)
    loaded: set[str] = field(default_factory=set)  # the modules loaded when install() swept them
    stand_ins: list[str] = field(default_factory=list)  # modules install() created where torch has none
    originals: dict[str, Any] = field(default_factory=dict)  # torch's functions our wrappers fall back to


_state: _Installed | None = None


def installed() -> bool:
    """Whether torch's FSDP1 names resolve to fsdp_legacy's now."""
    return _state is not None


def install() -> None:
    """Make torch's FSDP1 names resolve to fsdp_legacy's everywhere (see the module docstring). Idempotent."""
    global _state
    if _state is not None:
        return
    state = _Installed()
    swaps: dict[int, Any] = {}  # id(torch's object) -> ours, for the sweep of other modules' globals
    targets = _targets(state)
    for module_name, names in targets.items():
        module = _import_or_stand_in(module_name, state)
        for name, ours in names.items():
            previous = getattr(module, name, _MISSING)
            if previous is ours:
                continue
            if previous is not _MISSING and callable(previous):
                swaps[id(previous)] = ours
            state.replaced.append((module, name, previous))
            setattr(module, name, ours)
    _state = state  # before the sweep: code it triggers may ask installed()
    runtime_names.installed(importlib.import_module(f"{_FSDP1}._runtime_utils"))
    _sweep(swaps, state, skip=set(targets))
    torch_handle = next((value for module, name, value in state.replaced if name == "FlatParamHandle"), None)
    patch_watch.take(_FSDP1, FlatParamHandle, torch_handle if isinstance(torch_handle, type) else None)


def uninstall() -> None:
    """Put torch's own FSDP1 names back. Idempotent."""
    global _state
    if _state is None:
        return
    patch_watch.forget()
    runtime_names.uninstalled()
    back: dict[int, Any] = {}  # id(ours) -> torch's object it stood for
    for namespace, name, previous in _state.replaced:
        if previous is not _MISSING and callable(previous):
            back.setdefault(id(getattr(namespace, name, None)), previous)
    for namespace, name, previous in reversed(_state.replaced):
        if previous is _MISSING:
            _delattr(namespace, name)
        else:
            setattr(namespace, name, previous)
    _unsweep_torch_modules_loaded_since(_state, back)
    for module_name in reversed(_state.stand_ins):
        sys.modules.pop(module_name, None)
        parent, _, child = module_name.rpartition(".")
        if parent in sys.modules:
            _delattr(sys.modules[parent], child)
    _state = None


def _targets(state: _Installed) -> dict[str, dict[str, Any]]:
    """torch module -> the names install() sets in it (added where torch's module lacks one; uninstall removes it)."""
    configs = {name: getattr(api, name) for name in api.__all__}
    wrapper = {"FullyShardedDataParallel": FullyShardedDataParallel}

    def helpers(module: str, *names: str) -> dict[str, Any]:
        return {name: _falls_back(state, f"{_FSDP1}.{module}", name) for name in names}

    return {
        _FSDP1: {**wrapper, **configs},
        f"{_FSDP1}.api": configs,
        f"{_FSDP1}.fully_sharded_data_parallel": {**wrapper, **configs, "TrainingState": TrainingState},
        f"{_FSDP1}.wrap": {name: getattr(wrap, name) for name in _WRAP_NAMES},
        f"{_FSDP1}.sharded_grad_scaler": {"ShardedGradScaler": ShardedGradScaler},
        f"{_FSDP1}._flat_param": {
            "FlatParameter": FlatParameter,
            "FlatParamHandle": FlatParamHandle,  # (isinstance checks on `_handle`)
            "HandleTrainingState": HandleTrainingState,
            "HandleShardingStrategy": HandleShardingStrategy,
            "FlatParamShardMetadata": FlatParamShardMetadata,  # (what `shard_metadata()` returns)
        },
        f"{_FSDP1}._common_utils": {
            "TrainingState": TrainingState,
            "HandleTrainingState": HandleTrainingState,
            "_FSDPState": _fsdp_state_type(),
            **helpers("_common_utils", "_get_module_fsdp_state", "_get_module_fsdp_state_if_fully_sharded_module"),
        },
        # (torch's helpers there look a module's state up by their own binding of `_get_module_fsdp_state`)
        f"{_FSDP1}._runtime_utils": helpers(
            "_runtime_utils",
            "_lazy_init",
            "_unshard",
            "_reshard",
            "_post_backward_hook",
            "_post_backward_final_callback",
            "_post_backward_reshard",
            "_register_pre_backward_hooks",
            "_register_post_backward_hook",
            "_reduce_grad",
            "_reduce_grad_no_shard",
            "_low_precision_hook_enabled",
            "_get_module_fsdp_state",
        ),
        f"{_FSDP1}._traversal_utils": helpers(
            "_traversal_utils", "_get_fsdp_states", "_get_fsdp_handles", "_get_module_fsdp_state"
        ),
    }


def _fsdp_state_type() -> type:
    """torch's `_common_utils._FSDPState` as code tests it, `isinstance(unit, _FSDPState)`: true of our units and of
    whatever torch's own class covers (its wrapper), so torch's helpers that test it still find torch's units."""

    class _FSDPState(abc.ABC):  # noqa: B024 (no abstract methods: it only answers isinstance)
        """An FSDP1 unit's state: fsdp_legacy's units, and torch's own FSDP1 states."""

    _FSDPState.register(FullyShardedDataParallel)
    try:
        _FSDPState.register(importlib.import_module(f"{_FSDP1}._common_utils")._FSDPState)
    except (ImportError, AttributeError):
        pass
    return _FSDPState


def _falls_back(state: _Installed, module_name: str, name: str) -> Callable[..., Any]:
    """torch_helpers' `name` for fsdp_legacy's objects; torch's original (kept in `state`) for anything else (torch's
    FSDP1, FSDP2, plain modules). Where torch has no such helper (a stand-in module), what torch's answered for a
    model without FSDP1: an empty list from the traversals, None from the rest."""
    key = f"{module_name}.{name}"
    try:
        state.originals[key] = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        pass
    ours = getattr(torch_helpers, name)

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        result = ours(*args, **kwargs)
        if result is not NOT_OURS:
            return result
        original = state.originals.get(key)
        if original is not None:
            return original(*args, **kwargs)
        return [] if name.startswith("_get_fsdp_") else None

    dispatch.__name__ = dispatch.__qualname__ = name
    dispatch.__doc__ = ours.__doc__
    return dispatch


def _import_or_stand_in(module_name: str, state: _Installed) -> types.ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError:
        pass
    module = types.ModuleType(module_name, f"fsdp_legacy's stand-in for {module_name}, which this torch lacks")
    sys.modules[module_name] = module
    state.stand_ins.append(module_name)
    parent, _, child = module_name.rpartition(".")
    setattr(_import_or_stand_in(parent, state), child, module)
    return module


def _sweep(swaps: dict[int, Any], state: _Installed, skip: set[str]) -> None:
    """Swap torch's FSDP1 objects for ours in the globals of every module loaded now, except fsdp_legacy's, the
    targets (done), and torch's FSDP1 internals (which only torch's own FSDP1 uses)."""
    state.loaded = set(sys.modules)

    def swept(module_name: str) -> bool:
        internal = module_name.startswith(f"{_FSDP1}.") and module_name.rpartition(".")[2].startswith("_")
        return not (module_name in skip or module_name.split(".")[0] == __name__.split(".")[0] or internal)

    state.replaced.extend(_swap_globals(swept, swaps))


def _unsweep_torch_modules_loaded_since(state: _Installed, back: dict[int, Any]) -> None:
    """torch's own modules first imported while the switch was on (torch's DSD helpers, say) bound our names as they
    found them under torch's: give them torch's objects back, as the sweep's record does for the modules it saw.
    Only torch's modules: another module imported meanwhile may name fsdp_legacy's objects on purpose."""
    _swap_globals(lambda name: name not in state.loaded and name.split(".")[0] == "torch", back)


def _swap_globals(select: Callable[[str], bool], mapping: dict[int, Any]) -> list[tuple[Any, str, Any]]:
    """In the globals of every loaded module `select` accepts, replace each object that `mapping` has (by identity)
    with its value there; returns (module, name, previous value) of each replacement."""
    swapped = []
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if module is None or not isinstance(namespace, dict) or not select(module_name):
            continue
        for name, value in list(namespace.items()):
            new = mapping.get(id(value))
            if new is not None:
                swapped.append((module, name, value))
                namespace[name] = new
    return swapped


def _delattr(namespace: Any, name: str) -> None:
    try:
        delattr(namespace, name)
    except AttributeError:
        pass
