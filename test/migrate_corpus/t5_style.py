"""An FSDP1 program in the style of pytorch/examples' FSDP T5 trainer (distributed/FSDP/T5_training.py, its policies
and configs inlined): a small transformer whose blocks transformer_auto_wrap_policy wraps, bf16 MixedPrecision
(param, reduce and buffer dtypes), activation checkpointing applied after wrapping through a helper
(apply_activation_checkpointing + checkpoint_wrapper, NO_REENTRANT), AdamW with StepLR, a train function per epoch,
and at the end a look at the full parameters, which summon_full_params gives in full precision. Rank 0 prints its
loss per step."""

import argparse
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.optim.lr_scheduler import StepLR

VOCAB, WIDTH, HEADS, LENGTH = 64, 32, 2, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.register_buffer("gate", torch.full((WIDTH,), 0.5))  # cast to buffer_dtype under mixed precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).view(x.shape[0], LENGTH, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        x = x + self.out(attention)
        return x + self.gate * self.mlp(self.norm2(x))


class TinyT5(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# policies/mixed_precision.py
bfSixteen = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)

# policies/activation_checkpointing_functions.py
non_reentrant_wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def check_fn(submodule: nn.Module) -> bool:
    return isinstance(submodule, Block)


def apply_fsdp_checkpointing(model):
    """apply activation checkpointing to model"""
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=non_reentrant_wrapper, check_fn=check_fn)


def train(model, rank, batches, optimizer, epoch):
    model.train()
    fsdp_loss = torch.zeros(2)
    for tokens in batches:
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        fsdp_loss[0] += loss.item()
        fsdp_loss[1] += 1
        if rank == 0:
            print(f"loss {loss.item()!r}")
    dist.all_reduce(fsdp_loss, op=dist.ReduceOp.SUM)
    if rank == 0:
        print(f"Train Epoch: {epoch} \tLoss: {fsdp_loss[0] / fsdp_loss[1]:.4f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = torch.Generator().manual_seed(10 + rank)
    batches = [torch.randint(0, VOCAB, (4, LENGTH + 1), generator=data) for _ in range(3)]

    t5_auto_wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    torch.manual_seed(0)
    model = TinyT5()
    model = FSDP(
        model,
        auto_wrap_policy=t5_auto_wrap_policy,
        mixed_precision=bfSixteen,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=torch.device("cpu"),
        limit_all_gathers=True,
    )
    if args.activation_checkpointing:
        apply_fsdp_checkpointing(model)

    optimizer = optim.AdamW(model.parameters(), lr=2e-3)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.85)
    for epoch in range(1, args.epochs + 1):
        train(model, rank, batches, optimizer, epoch)
        scheduler.step()

    with FSDP.summon_full_params(model, writeback=False):
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the full precision, not bf16
        if rank == 0:
            print(f"norm {sum(p.double().pow(2).sum().item() for p in model.parameters())!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
