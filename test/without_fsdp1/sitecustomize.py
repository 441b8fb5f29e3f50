"""Makes every Python process started with this folder on PYTHONPATH see a torch without FSDP1, as a future torch will
be: `torch.distributed.fsdp` keeps FSDP2 (`fully_shard` and its policies) but no longer has FSDP1's class, enums and
configs, and its modules `fully_sharded_data_parallel` and `wrap` are gone, the legacy optimizer-state methods with
the class. (`_flat_param`, `api` and `_common_utils` stay: torch 2.13's FSDP2 imports them.) test_without_fsdp1.py
runs fsdp_legacy in such processes."""

import importlib
import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any

PACKAGE = "torch.distributed.fsdp"
GONE = {f"{PACKAGE}.fully_sharded_data_parallel", f"{PACKAGE}.wrap"}
# What torch.distributed.fsdp still offers: FSDP2's public names.
FSDP2_NAMES = (
    "CPUOffloadPolicy",
    "FSDPModule",
    "fully_shard",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "register_fsdp_forward_method",
    "UnshardHandle",
)


class _Fsdp2OnlyPackage(Loader):
    def __init__(self, real: ModuleSpec) -> None:
        self.real = real

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__path__ = list(self.real.submodule_search_locations or [])
        importlib.import_module(f"{PACKAGE}._flat_param")  # first, as torch's own __init__ does (an import cycle)
        fully_shard = importlib.import_module(f"{PACKAGE}._fully_shard")
        for name in FSDP2_NAMES:
            setattr(module, name, getattr(fully_shard, name))
        module.__all__ = list(FSDP2_NAMES)


class WithoutFsdp1(MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name in GONE and name not in sys.modules:  # (fsdp_legacy.install() puts stand-ins there)
            raise ModuleNotFoundError(f"No module named {name!r} (this torch has no FSDP1)", name=name)
        if name != PACKAGE:
            return None
        real = PathFinder.find_spec(name, path, target)
        assert real is not None
        spec = ModuleSpec(PACKAGE, _Fsdp2OnlyPackage(real), origin=real.origin, is_package=True)
        spec.submodule_search_locations = real.submodule_search_locations
        return spec


# Where torch's own files would be found (before the path finder), so that import hooks placed ahead of it, the
# FSDP_LEGACY=1 switch's among them, see this torch.
sys.meta_path.insert(sys.meta_path.index(PathFinder), WithoutFsdp1())
