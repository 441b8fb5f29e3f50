"""What an FSDP unit is, below the wrapper that builds one: its type, its training state, its naming, and how to find
the units of a model.

The runtime, state dicts, optimizer state and summon_full_params all work on units. They import this module, never
fully_sharded_data_parallel.py, which imports them to assemble the public methods; so the import graph stays acyclic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import auto
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable_state import _State

from .api import BackwardPrefetch, CPUOffload, FSDPEnum, MixedPrecision, ShardingStrategy, StateDictType
from .handle import FlatParamHandle
from .naming import CHECKPOINT_WRAPPED_MODULE, FLAT_PARAM, FSDP_PREFIX, FSDP_WRAPPED_MODULE, clean_fqn

__all__ = ["FLAT_PARAM", "FSDP_PREFIX", "FSDP_WRAPPED_MODULE", "FSDPUnit", "TrainingState", "clean_fqn", "fsdp_modules"]


class TrainingState(FSDPEnum):
    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


@dataclass
class PrefetchLimits:
    """torch's `_exec_order_data` as code sets it (Composer's forward/backward prefetch limits): how many units ahead
    a unit's forward (with forward_prefetch) and backward (with a backward_prefetch) start the all-gathers of. Every
    unit has one; at lazy init the units under a root share the root's, as in torch."""

    _forward_prefetch_limit: int = 1
    _backward_prefetch_limit: int = 1


class FSDPUnit(nn.Module, _State):
    """The type of every FSDP unit; FullyShardedDataParallel is its one subclass. It declares the state the other
    layers read, set by the wrapper's constructor.

    A unit is its own composable state, as torch's wrapper is (`_State`): code that asks torch's
    `_composable_state._get_module_state(unit)` gets the unit back, not None (LLaMA2-Accessory's parameter groups walk
    a model that way; compat.py makes `isinstance(unit, _common_utils._FSDPState)` hold too)."""

    # Sharding
    process_group: dist.ProcessGroup
    rank: int
    world_size: int
    compute_device: torch.device
    sharding_strategy: ShardingStrategy
    cpu_offload: CPUOffload
    mixed_precision: MixedPrecision
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    limit_all_gathers: bool
    _use_orig_params: bool
    _device_mesh: Any
    _handles: list[FlatParamHandle]  # one per dtype among the unit's parameters (one, as in torch, or none)
    _registration_order: dict[str, int]  # clean relative FQN of each managed parameter reference -> nn.Module order
    # Per step
    training_state: TrainingState
    _is_root: bool | None  # None until the first forward decides the root
    _exec_order_data: PrefetchLimits  # torch's name; the root's is shared by its units
    _sync_gradients: bool  # False inside no_sync()
    _comm_hook: Callable | None
    _comm_hook_state: object
    _buffer_dtypes: dict[str, torch.dtype]  # original dtypes of buffers cast to MixedPrecision.buffer_dtype
    # State dicts (state_dict.py)
    _state_dict_type: StateDictType
    _state_dict_config: Any
    _optim_state_dict_config: Any
    _fsdp_wrapped_module: nn.Module  # a registered submodule, found by nn.Module.__getattr__

    def _hook_post_backward(self, handle: FlatParamHandle) -> None:
        """Register the hook that reduces `handle`'s gradient, once its flat parameter requires grad (the wrapper's)."""
        raise NotImplementedError

    def _lazy_init(self) -> Any:
        """Decide the root and start the runtime, once (the wrapper's; returns its Runtime)."""
        raise NotImplementedError

    def _cast_buffers(self, full_precision: bool = False) -> None:
        """Cast the floating-point buffers to MixedPrecision.buffer_dtype, or back to their own (the wrapper's)."""
        raise NotImplementedError

    @property
    def _handle(self) -> FlatParamHandle | None:
        """torch's name: the unit's (first) handle, None when it manages no parameter."""
        return self._handles[0] if self._handles else None

    @property
    def module(self) -> nn.Module:
        """The module this unit was built around, which holds the flat parameter: the wrapped module, or the module
        inside the activation-checkpoint wrapper put around it after wrapping (apply_activation_checkpointing)."""
        wrapped = self._fsdp_wrapped_module
        while CHECKPOINT_WRAPPED_MODULE in wrapped._modules:
            wrapped = wrapped._modules[CHECKPOINT_WRAPPED_MODULE]  # type: ignore[assignment]
        return wrapped


def set_training_state(unit: FSDPUnit, state: TrainingState) -> None:
    """`unit.training_state = state`, without nn.Module.__setattr__'s checks for a parameter, buffer or module (a state
    is none of them, and that attribute lives in the instance's dict either way): the runtime sets it several times per
    unit and step."""
    unit.__dict__["training_state"] = state


def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FSDPUnit]:
    """All FSDP units in `module` (itself included) in pre-order, or only the outermost ones."""
    units = [m for m in module.modules() if isinstance(m, FSDPUnit)]
    if not root_only:
        return units
    nested = {id(inner) for unit in units for inner in unit.modules() if inner is not unit}
    return [unit for unit in units if id(unit) not in nested]
