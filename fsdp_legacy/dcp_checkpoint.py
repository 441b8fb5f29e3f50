"""fsdp_legacy.dcp_checkpoint, the public DCP save/load: `dcp.save` / `dcp.load` plus the side file (layout records,
save identity, CRC-32s) that lets a LOCAL checkpoint convert offline and a damaged one be refused. The code lives in
state/dcp_checkpoint.py; this module keeps the import path users have.

    from fsdp_legacy import dcp_checkpoint
    dcp_checkpoint.save(state, "ckpt/step100")      # every rank, as dcp.save
    dcp_checkpoint.load(state, "ckpt/step100")      # every rank, as dcp.load
    pending = dcp_checkpoint.async_save(state, "ckpt/step100")  # in the background (state/async_save.py)
    pending = dcp_checkpoint.async_save_sharded(model, optim, "ckpt/step100")  # SHARDED, gathers in the background
    pending.wait()
"""

from .state.async_save import AsyncSave, async_save, async_save_sharded
from .state.dcp_checkpoint import load, save

__all__ = ["AsyncSave", "async_save", "async_save_sharded", "load", "save"]
