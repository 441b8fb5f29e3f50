"""The runtime's steps that torch's FSDP1 runs through names of `torch.distributed.fsdp._runtime_utils`, which code
replaces to count, log or extend them (torch's own tests wrap `_register_pre_backward_hooks`,
`_register_post_backward_hook` and `_post_backward_reshard` to count their calls; Galvatron replaces
`_register_post_backward_hook`). Under the switch (compat.py) those names hold fsdp_legacy's steps, and the runtime
calls each through the name whenever code has put something else there since, so the replacement sees every call (and
what it calls back, ours, does the work); without the switch, or while the name holds what the switch put there, the
runtime runs its own step directly. No torch FSDP1 code runs either way.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

# What the runtime calls through (the switch installs these names; patch_watch does not warn of their replacement).
CALLED_THROUGH = ("_register_pre_backward_hooks", "_register_post_backward_hook", "_post_backward_reshard")

_module: types.ModuleType | None = None  # torch's `_runtime_utils` while the switch is installed
_installed: dict[str, Any] = {}  # name -> what the switch put there


def installed(module: types.ModuleType) -> None:
    """The switch has put its helpers under `module`'s names (called by compat.install)."""
    global _module
    _module = module
    _installed.clear()
    _installed.update((name, getattr(module, name, None)) for name in CALLED_THROUGH)


def uninstalled() -> None:
    global _module
    _module = None
    _installed.clear()


def replacement(name: str) -> Callable[..., Any] | None:
    """What code put under torch's `_runtime_utils.<name>` in place of the switch's helper (to be called instead of
    the runtime's own step), or None."""
    if _module is None:
        return None
    current = getattr(_module, name, None)
    return None if current is _installed.get(name) or current is None else current
