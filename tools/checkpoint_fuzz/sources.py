"""The checkpoints the fuzzer mutates, written once per run by 2 gloo ranks on the CPU with the project's savers: the
streamed full save in safetensors (one file and sharded), dcp_checkpoint.save of SHARDED and of LOCAL state with the
optimizer, a plain dcp.save, per-rank LOCAL torch.save files and a full torch.save file. Each is saved twice, after
one and after two optimizer steps (save `a` and save `b`), so that a mutation can mix files of two saves."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # fsdp_legacy from the checkout

# name -> (a directory or a file, whether the format carries seals our readers check)
FORMATS: dict[str, bool] = {
    "full_one": True,  # save_full_model: one model.safetensors, sealed header and data
    "full_sharded": True,  # save_full_model with a small max_shard_size: several files and an index
    "dcp_sharded": True,  # dcp_checkpoint.save of SHARDED model and optimizer state: side file, stamps
    "dcp_local": True,  # dcp_checkpoint.save of LOCAL model and optimizer state
    "dcp_plain": False,  # torch's dcp.save: no seal of ours, only the items' torch.save CRC-32s
    "ranks": True,  # per-rank LOCAL torch.save files: CRC-32s and save ids in the layout records
    "full.pt": True,  # one torch.save of the FULL model and optimizer state: torch's CRC-32s
}
SAVES = ("a", "b")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """Three FSDP units (two blocks and the root), a buffer, parameters of several shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)
        self.register_buffer("scale", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.scale


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    data = torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
    model(data).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _save_all(root: Path, save: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    from fsdp_legacy import FullyShardedDataParallel as FSDP
    from fsdp_legacy import StateDictType, dcp_checkpoint
    from fsdp_legacy.checkpoint import save_full_model

    rank = dist.get_rank()
    at = root / save
    os.makedirs(at / "ranks", exist_ok=True)
    dist.barrier()
    save_full_model(model, str(at / "full_one"))
    save_full_model(model, str(at / "full_sharded"), max_shard_size=400)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp_checkpoint.save(sharded, str(at / "dcp_sharded"))
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(at / "dcp_plain"))
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp_checkpoint.save(local, str(at / "dcp_local"))
    torch.save(local, at / "ranks" / f"rank{rank}.pt")
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
    if rank == 0:
        torch.save(full, at / "full.pt")
    dist.barrier()


def _rank(rank: int, port: int, root: str) -> None:
    from fsdp_legacy import FullyShardedDataParallel as FSDP
    from fsdp_legacy.wrap import ModuleWrapPolicy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    warnings.simplefilter("ignore")  # FSDP.state_dict_type's FutureWarning, kept for parity with torch
    torch.manual_seed(0)
    model = FSDP(Net(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for step, save in enumerate(SAVES):
        _step(model, optim, step)
        _save_all(Path(root), save, model, optim)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown after gloo collectives (tools/process_exit.py)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_sources(root: Path, timeout: float = 300.0) -> None:
    """Save every format twice under root/a and root/b, on 2 gloo ranks in fresh processes."""
    context = mp.get_context("spawn")
    port = _free_port()
    processes: list[Any] = [context.Process(target=_rank, args=(rank, port, str(root))) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout)
    failed = [p.exitcode for p in processes if p.exitcode != 0]
    for process in processes:
        if process.is_alive():
            process.kill()
    if failed:
        raise RuntimeError(f"saving the fuzzer's checkpoints failed (exit codes {failed})")
    missing = [f"{s}/{name}" for s in SAVES for name in FORMATS if not (root / s / name).exists()]
    if missing:
        raise RuntimeError(f"the savers did not write {missing}")
