"""fsdp_legacy.checkpoint, the public checkpoint API: drop-ins for torch.distributed.checkpoint.state_dict's helpers
that work on fsdp_legacy models, and the streamed full-model save/load. The code lives in state/ (checkpoint.py,
hf_checkpoint.py); this module keeps the import path users have."""

from .state.checkpoint import (
    Optimizers,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from .state.hf_checkpoint import load_full_model, save_full_model

__all__ = [
    "Optimizers",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "load_full_model",
    "save_full_model",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]
