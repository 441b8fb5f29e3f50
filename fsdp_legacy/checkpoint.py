"""fsdp_legacy.checkpoint, the public checkpoint API: drop-ins for torch.distributed.checkpoint.state_dict's helpers
that work on fsdp_legacy models, and the streamed full-model save/load. The code lives in state/ (checkpoint.py,
hf_checkpoint.py); this module keeps the import path users have. `latest(root)` finds the newest complete checkpoint
under a folder, agreed by every rank (state/latest.py). `load_rank_state(path)` reads one rank's torch.save file of a
LOCAL or SHARDED state dict without running pickled code (state/rank_file.py). `save_full_model_async` saves in the
background (state/async_save.py)."""

from .state.async_save import AsyncSave, save_full_model_async
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
from .state.latest import LatestCheckpoint, SkippedCheckpoint, latest
from .state.rank_file import load_rank_state

__all__ = [
    "AsyncSave",
    "LatestCheckpoint",
    "Optimizers",
    "SkippedCheckpoint",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "latest",
    "load_full_model",
    "load_rank_state",
    "save_full_model",
    "save_full_model_async",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]
