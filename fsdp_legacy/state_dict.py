"""Model state dicts of FSDP units: FULL_STATE_DICT, SHARDED_STATE_DICT and LOCAL_STATE_DICT (torch FSDP1 formats)."""

from typing import Any

from torch import nn

from .api import FullOptimStateDictConfig, FullStateDictConfig, StateDictType


def init_unit(unit: nn.Module) -> None:
    """Give a new FSDP unit torch's default settings (FULL_STATE_DICT) and its state-dict hooks."""
    unit._state_dict_type = StateDictType.FULL_STATE_DICT
    unit._state_dict_config = FullStateDictConfig()
    unit._optim_state_dict_config = FullOptimStateDictConfig()


def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config: Any = None,
                        optim_state_dict_config: Any = None) -> Any:
    raise NotImplementedError("FSDP.set_state_dict_type() is not implemented in fsdp_legacy yet")


def get_state_dict_type(module: nn.Module) -> Any:
    raise NotImplementedError("FSDP.get_state_dict_type() is not implemented in fsdp_legacy yet")


def state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config: Any = None,
                    optim_state_dict_config: Any = None) -> Any:
    raise NotImplementedError("FSDP.state_dict_type() is not implemented in fsdp_legacy yet")
