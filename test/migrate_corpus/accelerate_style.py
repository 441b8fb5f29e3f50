"""An FSDP1 program in the style of Accelerate's FSDP utilities (accelerate/utils/fsdp_utils.py) as a trainer calls
them: a small Trainer holding the model (use_orig_params, AdamW), the SHARDED helpers save_fsdp_model /
save_fsdp_optimizer with torch.distributed.checkpoint, and the resume through load_fsdp_model and load_fsdp_optimizer
(load_sharded_optimizer_state_dict, then optim_state_dict_to_load with keywords). Rank 0 prints its loss per step.

    --steps N --output DIR [--save-after K]              train, saving a SHARDED checkpoint after step K
    --steps N --output DIR --resume DIR --first-step K   resume from DIR's SHARDED checkpoint
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dist_cp
import torch.nn as nn
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

MODEL_NAME = "pytorch_model"
OPTIMIZER_NAME = "optimizer"


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class Trainer:
    def __init__(self, model, optimizer, output_dir):
        self.model = model
        self.optimizer = optimizer
        self.output_dir = output_dir

    def training_step(self, inputs, labels):
        loss = nn.functional.mse_loss(self.model(inputs), labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()


def save_fsdp_model(model, output_dir):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict()}
        ckpt_dir = os.path.join(output_dir, f"{MODEL_NAME}_0")
        dist_cp.save(state_dict=state_dict, storage_writer=dist_cp.FileSystemWriter(ckpt_dir))


def load_fsdp_model(model, input_dir):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        ckpt_dir = os.path.join(input_dir, f"{MODEL_NAME}_0")
        state_dict = {"model": model.state_dict()}
        dist_cp.load(state_dict=state_dict, storage_reader=dist_cp.FileSystemReader(ckpt_dir))
        model.load_state_dict(state_dict["model"])


def save_fsdp_optimizer(optimizer, model, output_dir):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        optim_state = FSDP.optim_state_dict(model, optimizer)
        ckpt_dir = os.path.join(output_dir, f"{OPTIMIZER_NAME}_0")
        dist_cp.save(state_dict={"optimizer": optim_state}, storage_writer=dist_cp.FileSystemWriter(ckpt_dir))


def load_fsdp_optimizer(optimizer, model, input_dir):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        ckpt_dir = os.path.join(input_dir, f"{OPTIMIZER_NAME}_0")
        optim_state = load_sharded_optimizer_state_dict(
            model_state_dict=model.state_dict(),
            optimizer_key="optimizer",
            storage_reader=dist_cp.FileSystemReader(ckpt_dir),
        )
        flattened_osd = FSDP.optim_state_dict_to_load(
            model=model, optim=optimizer, optim_state_dict=optim_state["optimizer"]
        )
        optimizer.load_state_dict(flattened_osd)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--output")
    parser.add_argument("--save-after", type=int, default=-1)
    parser.add_argument("--resume")
    parser.add_argument("--first-step", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), Block(12), Block(12), nn.Linear(12, 3))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    trainer = Trainer(model, optimizer, args.output)
    if args.resume:
        load_fsdp_model(model, args.resume)
        load_fsdp_optimizer(optimizer, model, args.resume)

    generator = torch.Generator().manual_seed(3 + rank)
    batches = [
        (torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator)) for _ in range(args.steps)
    ]
    for step in range(args.first_step, args.steps):
        loss = trainer.training_step(*batches[step])
        if rank == 0:
            print(f"loss {loss.item()!r}")
        if step == args.save_after:
            save_fsdp_model(model, args.output)
            save_fsdp_optimizer(optimizer, model, args.output)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
