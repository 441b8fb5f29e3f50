"""Public enums and configuration dataclasses, with torch FSDP1's names, values and defaults."""

import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "ShardedStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
]


class FSDPEnum(Enum):
    """An enum whose members also equal torch FSDP1's members of the same enum and name, both ways (torch's enums
    define no equality of their own, so Python asks ours): code written for torch passes torch's members, and torch's
    code (its DSD helpers, say) compares ours against its own."""

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is type(self):  # (members are singletons: another of ours is another member)
            return False
        return (
            isinstance(other, Enum)
            and other.name == self.name
            and type(other).__name__ == type(self).__name__
            and type(other).__module__.startswith("torch.distributed.fsdp")
        )

    def __hash__(self) -> int:
        return hash(self._name_)  # what Enum hashes, so ours and torch's members share dict and set slots


class ShardingStrategy(FSDPEnum):
    """How parameters, gradients and optimizer state are split across ranks.

    FULL_SHARD shards everything and re-gathers parameters for backward; SHARD_GRAD_OP keeps them gathered from
    forward to the end of backward; NO_SHARD replicates (like DDP); the HYBRID variants shard inside a group and
    replicate across groups.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(FSDPEnum):
    """When backward issues the next unit's all-gather: before (PRE) or after (POST) the current unit's gradient."""

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


class StateDictType(FSDPEnum):
    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


class OptimStateKeyType(FSDPEnum):
    PARAM_NAME = auto()
    PARAM_ID = auto()


@dataclass
class MixedPrecision:
    """Dtypes for compute (param_dtype), gradient reduction (reduce_dtype) and buffers (buffer_dtype)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[torch.nn.Module]] = (_BatchNorm,)


@dataclass
class CPUOffload:
    """offload_params=True keeps sharded parameters and gradients on CPU; the optimizer then steps there."""

    offload_params: bool = False


@dataclass
class StateDictConfig:
    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    offload_to_cpu: bool = True  # unlike the model config, torch defaults to offloading optimizer state


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


def full_precision_eval_requested() -> bool:
    """torch FSDP1's switch FSDP_USE_FULL_PREC_IN_EVAL=1: in eval mode, mixed-precision units compute in full
    precision. Read at each root forward, as torch reads it."""
    return os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL") == "1"
