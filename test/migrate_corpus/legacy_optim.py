"""An FSDP1 program on the legacy optimizer-state API: Adam over two wrapped blocks, FSDP.set_state_dict_type once
after wrapping (FULL, rank0_only), a checkpoint of model.state_dict() and FSDP.full_optim_state_dict written by rank 0
with torch.save (the optimizer state also re-keyed by parameter id for an unwrapped copy of the model, whose checksum
rank 0 prints), and a resume that loads the model state and scatters the optimizer state from rank 0 or shards it on
every rank. Rank 0 prints its loss per step.

    --steps N --save PATH --save-after K                        train N steps, saving after step K
    --steps N --resume PATH --first-step K [--load scatter|shard]   load PATH, then train steps K..N-1
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, OptimStateKeyType, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def build() -> nn.Module:
    return nn.Sequential(Block(16), Block(16), nn.Linear(16, 4))


def checksum(by_id: dict) -> float:
    """The optimizer state, weighted by its key: another key for a parameter changes it."""
    return sum(
        (key + 1) * sum(float(value.double().sum()) for value in state.values())
        for key, state in by_id["state"].items()
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save")
    parser.add_argument("--save-after", type=int, default=-1)
    parser.add_argument("--resume")
    parser.add_argument("--first-step", type=int, default=0)
    parser.add_argument("--load", choices=["scatter", "shard"], default="scatter")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = FSDP(build(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    FSDP.set_state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    )
    if args.resume:
        checkpoint = torch.load(args.resume, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        if args.load == "shard":  # every rank holds the full optimizer state
            optim.load_state_dict(FSDP.shard_full_optim_state_dict(checkpoint["optim"], model, optim=optim))
        else:  # rank 0's is sent to the others
            full_osd = checkpoint["optim"] if rank == 0 else None
            sharded_osd = FSDP.scatter_full_optim_state_dict(full_osd, model, optim=optim)
            optim.load_state_dict(sharded_osd)
    for step in range(args.first_step, args.steps):
        data = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"loss {loss.item()!r}")
        if step == args.save_after:
            states = model.state_dict()  # rank 0's full state dict, under the type set above
            full_osd = FSDP.full_optim_state_dict(model, optim)  # rank 0's, keyed by parameter name
            if rank == 0:
                torch.save({"model": states, "optim": full_osd}, args.save)
                plain = build()
                plain_optim = torch.optim.Adam(plain.parameters(), lr=1e-2)
                by_id = FSDP.rekey_optim_state_dict(full_osd, OptimStateKeyType.PARAM_ID, plain, optim=plain_optim)
                print(f"rekeyed {checksum(by_id)!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
