"""fsdp_legacy: an independent, drop-in implementation of PyTorch's FSDP1 API (FullyShardedDataParallel).

from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy.wrap import ModuleWrapPolicy
model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
"""

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from .api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .compat import install, installed, uninstall
from .flat_param import FlatParameter
from .fully_sharded_data_parallel import FullyShardedDataParallel
from .sharded_grad_scaler import ShardedGradScaler
from .state import dcp_load_hook

try:  # setup.cfg holds the version; an installed package (editable too) carries it in its metadata
    __version__ = version("fsdp_legacy")
except PackageNotFoundError:  # a checkout on sys.path without an install
    __version__ = "0+unknown"

dcp_load_hook.install()  # dcp.load restores a fresh optimizer's state from the checkpoint (state/fresh_optim.py)

# FSDP_LEGACY=1 with fsdp_legacy imported first: this import brought in torch.distributed.fsdp, and the switch's hook
# (_fsdp_legacy_autoinstall.py) left install() to the end of it.
_hook: Any = sys.modules.get("_fsdp_legacy_autoinstall")
if getattr(_hook, "pending", False):
    _hook.pending = False
    install()

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FlatParameter",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardedGradScaler",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "install",
    "installed",
    "uninstall",
]
