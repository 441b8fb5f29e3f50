"""Run at interpreter start by fsdp_legacy_autoinstall.pth (installed with the package) when FSDP_LEGACY is set to 1:
puts fsdp_legacy under torch's FSDP1 names (fsdp_legacy.install()) as soon as torch.distributed.fsdp is imported.
Not before: a process that never imports it (pip, say) never imports torch or fsdp_legacy on its account.
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

TARGET = "torch.distributed.fsdp"
PACKAGE = "fsdp_legacy"
# Set when torch.distributed.fsdp was imported by fsdp_legacy's own import (convert/ imports DCP, which imports it):
# install() must wait for the package to finish; its __init__ then calls it.
pending = False


def enabled() -> bool:
    return os.environ.get("FSDP_LEGACY", "").strip().lower() in ("1", "true", "yes", "on")


class InstallAfterImport(MetaPathFinder):
    """Finds torch.distributed.fsdp as the other finders would, and runs fsdp_legacy.install() once it has executed."""

    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once is enough
        spec = _find_with_other_finders(name, path, target)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def execute_then_install(module: ModuleType) -> None:
            execute(module)
            install_when_ready()

        loader.exec_module = execute_then_install  # type: ignore[method-assign]  # this spec's own loader
        return spec


def _find_with_other_finders(name: str, path: Any, target: ModuleType | None) -> ModuleSpec | None:
    """The spec the rest of the import system would find (another import hook included), as the import statement
    would ask: each finder of sys.meta_path in turn."""
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(name, path, target) if find_spec is not None else None
        if spec is not None:
            return spec
    return None


def install_when_ready() -> None:
    """fsdp_legacy.install(), or, while fsdp_legacy is itself being imported, a note for its __init__ to call it."""
    global pending
    package = sys.modules.get(PACKAGE)
    if package is not None and getattr(getattr(package, "__spec__", None), "_initializing", False):
        pending = True
        return
    import fsdp_legacy

    fsdp_legacy.install()


def hook() -> None:
    if not enabled() or any(isinstance(f, InstallAfterImport) for f in sys.meta_path):
        return
    if TARGET in sys.modules:  # already imported (by a sitecustomize, say): install now
        install_when_ready()
    else:
        sys.meta_path.insert(0, InstallAfterImport())
