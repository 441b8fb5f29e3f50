"""An FSDP1 program in the README's style: blocks wrapped by ModuleWrapPolicy, the weights initialized after wrapping
with `model.apply(init_weights)` (FSDP1's apply: on the full parameters), AdamW, fp32; rank 0 prints its loss per
step. test_migrate_corpus.py migrates it with `fsdp-legacy migrate` and runs both versions with torchrun."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.2)
        module.bias.data.fill_(0.01)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    # torch's FSDP1 needs device_id on the CPU
    model = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    model.apply(init_weights)  # the same draws as on the plain model: FSDP1 gathers the full parameters first
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 1, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"loss {loss.item()!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
