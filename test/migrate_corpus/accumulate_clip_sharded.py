"""An FSDP1 training loop with gradient accumulation under no_sync(), clip_grad_norm_, and a SHARDED checkpoint
(torch.distributed.checkpoint) that a later run resumes from. Rank 0 prints its loss per step.

    --steps N --save DIR --save-after K   train N steps, saving after step K
    --steps N --resume DIR --first-step K      load DIR, then train steps K..N-1
"""

import argparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def save(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=path)


def load(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save")
    parser.add_argument("--save-after", type=int, default=-1)
    parser.add_argument("--resume")
    parser.add_argument("--first-step", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(Block(16), Block(16), nn.Linear(16, 1))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if args.resume:
        load(model, optim, args.resume)
    for step in range(args.first_step, args.steps):
        data = torch.Generator().manual_seed(1000 * step + rank)
        micro = [(torch.randn(4, 16, generator=data), torch.randn(4, 1, generator=data)) for _ in range(2)]
        with model.no_sync():  # accumulate the first micro-batch without reducing
            nn.functional.mse_loss(model(micro[0][0]), micro[0][1]).backward()
        loss = nn.functional.mse_loss(model(micro[1][0]), micro[1][1])
        loss.backward()
        model.clip_grad_norm_(0.5)
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"loss {loss.item()!r}")
        if step == args.save_after:
            save(model, optim, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
