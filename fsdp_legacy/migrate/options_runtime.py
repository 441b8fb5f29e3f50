"""FSDP1's state-dict configs built at run time as the StateDictOptions of torch.distributed.checkpoint.state_dict
(imported by migrated programs through runtime.py): a config whose values the source does not show
(`FullStateDictConfig(offload_to_cpu=device.type != "cpu", rank0_only=True)`) becomes a call with the same
arguments, evaluated where FSDP1's config was, and the options follow the values as FSDP1's state dicts would."""

from __future__ import annotations

from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = ["full_state_dict_options", "sharded_state_dict_options"]


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
