"""An FSDP1 program in the style of llama-recipes' finetuning script and its checkpoint handler: a config class of
plain attributes, a tiny decoder whose layer class is wrapped through functools.partial(transformer_auto_wrap_policy),
AdamW with StepLR, gradient accumulation and clipping in a train function that takes everything as parameters, and the
handler's functions: the FULL model state dict under a module-level FullStateDictConfig (rank 0 writes it), the full
optimizer state dict (rank 0 writes it), and the optimizer state loaded back through scatter_full_optim_state_dict.
Rank 0 prints its loss per step.

    --steps N [--save DIR --save-after K]   train steps 0..N-1, saving after step K
    --steps N --resume DIR --first-step K   load DIR's model (before wrapping) and optimizer, train steps K..N-1
"""

import argparse
import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.optim.lr_scheduler import StepLR

fullstate_save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)


class train_config:
    lr = 3e-3
    gamma = 0.85
    gradient_accumulation_steps = 2
    gradient_clipping_threshold = 1.0
    batch_size = 4
    seq_len = 12


class DecoderLayer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1])
        h = h + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(h)


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def save_model_checkpoint(model, optimizer, rank, cfg, epoch=1):
    """saving model via rank0 cpu streaming and full_state_dict"""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, fullstate_save_policy):
        cpu_state = model.state_dict()
    if rank == 0:
        torch.save(cpu_state, os.path.join(cfg.dist_checkpoint_folder, f"model-{epoch}.pt"))


def save_optimizer_checkpoint(model, optimizer, rank, cfg, epoch=1):
    """save optimizer state via full state dict"""
    optim_state = FSDP.full_optim_state_dict(model, optimizer)
    if rank == 0:
        torch.save(optim_state, os.path.join(cfg.dist_checkpoint_folder, f"optimizer-{epoch}.pt"))


def load_model_checkpoint(model, rank, cfg, epoch=1):
    """load local checkpoint to rank0 cpu; must be called *before* passing to FSDP"""
    model_checkpoint = torch.load(os.path.join(cfg.dist_checkpoint_folder, f"model-{epoch}.pt"), weights_only=True)
    model.load_state_dict(model_checkpoint)


def load_optimizer_checkpoint(model, optimizer, optimizer_checkpoint_path, rank):
    """load an fsdp optimizer full_state checkpoint using scatter method"""
    full_osd = None
    if rank == 0:
        full_osd = torch.load(optimizer_checkpoint_path, weights_only=True)
    sharded_osd = FSDP.scatter_full_optim_state_dict(full_osd, model, optim=optimizer)
    optimizer.load_state_dict(sharded_osd)


def train(model, batches, optimizer, lr_scheduler, gradient_accumulation_steps, train_config, rank, steps, on_step):
    model.train()
    for step, (input_ids, labels) in steps:
        for micro in range(gradient_accumulation_steps):
            logits = model(input_ids[micro])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels[micro].flatten())
            (loss / gradient_accumulation_steps).backward()
            if rank == 0:
                print(f"loss {loss.item()!r}")
        model.clip_grad_norm_(train_config.gradient_clipping_threshold)
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()
        on_step(step)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save")
    parser.add_argument("--save-after", type=int, default=-1)
    parser.add_argument("--resume")
    parser.add_argument("--first-step", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLlama()
    if args.resume:
        train_config.dist_checkpoint_folder = args.resume
        load_model_checkpoint(model, rank, train_config)
    my_auto_wrapping_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer})
    model = FSDP(model, auto_wrap_policy=my_auto_wrapping_policy, limit_all_gathers=True, device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_config.lr, weight_decay=0.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=train_config.gamma)
    if args.resume:
        for _ in range(args.first_step):  # the schedule's position; the saved learning rate comes with the state
            scheduler.step()
        load_optimizer_checkpoint(model, optimizer, os.path.join(args.resume, "optimizer-1.pt"), rank)

    generator = torch.Generator().manual_seed(1 + rank)
    shape = (train_config.gradient_accumulation_steps, train_config.batch_size, train_config.seq_len)
    data = [(torch.randint(0, 40, shape, generator=generator),) * 2 for _ in range(args.steps)]
    data = [(ids, ids.roll(-1, dims=-1)) for ids, _ in data]

    def on_step(step):
        if step == args.save_after:
            train_config.dist_checkpoint_folder = args.save
            os.makedirs(args.save, exist_ok=True)
            save_model_checkpoint(model, optimizer, rank, train_config)
            save_optimizer_checkpoint(model, optimizer, rank, train_config)
            dist.barrier()

    steps = list(enumerate(data))[args.first_step :]
    train(
        model, data, optimizer, scheduler, train_config.gradient_accumulation_steps, train_config, rank, steps, on_step
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
