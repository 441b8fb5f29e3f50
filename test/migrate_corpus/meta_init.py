"""An FSDP1 program that builds its model on the meta device and lets FSDP1 materialize it unit by unit:
param_init_fn (to_empty, then reset_parameters) on each module of a unit just before it is sharded, then
sync_module_states to make every rank's values rank 0's (each rank seeds its own generator, as programs that seed
per rank for their data do), ModuleWrapPolicy, SGD with momentum, gradient clipping. Rank 0 prints its loss per
step."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.Sequential(Block(width), Block(width), Block(width))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def init_weights(module: nn.Module) -> None:
    module.to_empty(device=torch.device("cpu"), recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)
    with torch.device("meta"):
        model = Net()
    model = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        param_init_fn=init_weights,
        sync_module_states=True,
        device_id=torch.device("cpu"),
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(6):
        x = torch.randn(8, 8)
        loss = (model(x) - x.sum(dim=1, keepdim=True).sin()).pow(2).mean()
        loss.backward()
        model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"loss {loss.item()!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
