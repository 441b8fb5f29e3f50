"""FSDP1's state-dict configs built at run time as the StateDictOptions of torch.distributed.checkpoint.state_dict
(imported by migrated programs through runtime.py): a config whose values the source does not show
(`FullStateDictConfig(offload_to_cpu=device.type != "cpu", rank0_only=True)`) becomes a call with the same
arguments, evaluated where FSDP1's config was, and the options follow the values as FSDP1's state dicts would."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = ["full_state_dict_options", "sharded_state_dict_options", "state_dict_type_options"]


def full_state_dict_options(offload_to_cpu: bool = False, rank0_only: bool = False) -> StateDictOptions:
    """FSDP1's FULL_STATE_DICT with `Full[Optim]StateDictConfig(offload_to_cpu, rank0_only)`: with rank0_only, rank
    0's full state dict on the CPU and an empty one elsewhere (DSD's full_state_dict + cpu_offload); without it,
    every rank's full copy, which DSD keeps on the device where FSDP1's offload_to_cpu put it on the CPU (the same
    values)."""
    return StateDictOptions(full_state_dict=True, cpu_offload=bool(rank0_only))


def sharded_state_dict_options(offload_to_cpu: bool = False) -> StateDictOptions:
    """FSDP1's SHARDED_STATE_DICT with `Sharded[Optim]StateDictConfig(offload_to_cpu)`: each rank's shards, on the
    CPU with offload_to_cpu."""
    return StateDictOptions(cpu_offload=bool(offload_to_cpu))


# FSDP1's state-dict types -> the config classes each takes (for the model, for the optimizer), by name: the configs
# may be torch's or fsdp_legacy's, which a migrated file imports instead.
_CONFIGS = {
    "FULL_STATE_DICT": ("FullStateDictConfig", "FullOptimStateDictConfig"),
    "SHARDED_STATE_DICT": ("ShardedStateDictConfig", "ShardedOptimStateDictConfig"),
}


def _check(config: Any, expected: str, state_dict_type: str) -> None:
    if config is not None and type(config).__name__ != expected:
        raise RuntimeError(f"Expected state_dict_config of type {expected} for {state_dict_type}, got {config}")


def state_dict_type_options(
    state_dict_type: Any, state_dict_config: Any = None, optim_state_dict_config: Any = None
) -> tuple[StateDictOptions, StateDictOptions]:
    """`with FSDP.state_dict_type(model, state_dict_type, state_dict_config, optim_state_dict_config):` where the
    source does not show the type or the configs (`state_dict_type=StateDictType.SHARDED_STATE_DICT if sharded else
    StateDictType.FULL_STATE_DICT`): the StateDictOptions the block's model calls and optimizer calls take, decided
    when the block starts, as FSDP1 decides it there. A config of the wrong class raises RuntimeError as FSDP1 does;
    LOCAL_STATE_DICT, which FSDP2 has no counterpart for, raises NotImplementedError before anything is saved."""
    name = getattr(state_dict_type, "name", state_dict_type)
    if name not in _CONFIGS:
        raise NotImplementedError(
            f"state_dict_type {name}: FSDP2 (torch.distributed.checkpoint.state_dict) has only full and sharded "
            "state dicts; save FULL_STATE_DICT or SHARDED_STATE_DICT instead"
        )
    model_class, optim_class = _CONFIGS[name]
    _check(state_dict_config, model_class, name)
    _check(optim_state_dict_config, optim_class, name)
    # FSDP1's defaults: the model's config does not offload, the optimizer's does; neither is rank0_only.
    model_offload = bool(getattr(state_dict_config, "offload_to_cpu", False))
    optim_offload = bool(getattr(optim_state_dict_config, "offload_to_cpu", True))
    if name == "FULL_STATE_DICT":
        return (
            full_state_dict_options(model_offload, bool(getattr(state_dict_config, "rank0_only", False))),
            full_state_dict_options(optim_offload, bool(getattr(optim_state_dict_config, "rank0_only", False))),
        )
    return sharded_state_dict_options(model_offload), sharded_state_dict_options(optim_offload)
