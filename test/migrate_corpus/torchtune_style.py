"""An FSDP1 program in the style of torchtune's FSDP1 recipes (full_finetune_distributed before FSDP2): a builder
function that wraps the model (FSDP(module=...), ModuleWrapPolicy, FULL_SHARD, CPUOffload without offloading),
sets its state-dict type (FULL, rank0_only, offload_to_cpu) and returns it, and the recipe's code in the caller:
the optimizer state loaded through optim_state_dict_to_load, the model and optimizer state dicts of a FULL
checkpoint taken under the type the builder set and written by rank 0. Rank 0 prints its loss per step.

    --epochs N [--save PATH --save-epoch K]   train epochs 0..N-1, saving after epoch K
    --epochs N --resume PATH                  load PATH (every rank) and train the epochs after it
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import (
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class TransformerDecoderLayer(nn.Module):
    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.sa_norm = nn.RMSNorm(embed_dim)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, 3 * embed_dim), nn.SiLU(), nn.Linear(3 * embed_dim, embed_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.sa_norm(x))


class TransformerDecoder(nn.Module):
    def __init__(self, vocab_size: int = 40, embed_dim: int = 16, num_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, embed_dim)
        self.layers = nn.ModuleList(TransformerDecoderLayer(embed_dim) for _ in range(num_layers))
        self.norm = nn.RMSNorm(embed_dim)
        self.output = nn.Linear(embed_dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def setup_model(device, fsdp_cpu_offload=False):
    with torch.device("cpu"):
        model = TransformerDecoder()
    model = FSDP(
        module=model,
        auto_wrap_policy=ModuleWrapPolicy({TransformerDecoderLayer}),
        cpu_offload=CPUOffload(offload_params=False),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=device,
    )
    # Ensure no params and buffers are on meta device
    FSDP.set_state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    )
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save")
    parser.add_argument("--save-epoch", type=int, default=-1)
    parser.add_argument("--resume")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = setup_model(torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, foreach=False)
    epochs_run = 0
    if args.resume:
        ckpt_dict = torch.load(args.resume, weights_only=True)
        model.load_state_dict(ckpt_dict["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, ckpt_dict["optimizer"]))
        epochs_run = ckpt_dict["epochs_run"]

    generator = torch.Generator().manual_seed(5 + rank)
    data = [torch.randint(0, 40, (3, 2, 9), generator=generator) for _ in range(args.epochs)]
    for curr_epoch in range(epochs_run, args.epochs):
        for tokens in data[curr_epoch]:
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                print(f"loss {loss.item()!r}")
        if curr_epoch == args.save_epoch:
            cpu_state_dict = model.state_dict()
            opt_state_dict = FSDP.optim_state_dict(model, optimizer)
            if rank == 0:
                torch.save(
                    {"model": cpu_state_dict, "optimizer": opt_state_dict, "epochs_run": curr_epoch + 1}, args.save
                )
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
