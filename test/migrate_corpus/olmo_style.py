"""An FSDP1 program in the style of OLMo's trainer (olmo/train.py, olmo/checkpoint.py): a Trainer holding the
wrapped model as self._model, the optimizer and a trainer state, the wrap policy a method of the model
(get_fsdp_wrap_policy, a plain function FSDP1 calls), SHARD_GRAD_OP with use_orig_params, an unsharded (FULL)
checkpoint saved inside a method with the configs written as keywords of the block (rank0_only, offload_to_cpu),
torch.save'd by rank 0, and restored by every rank under a FULL type. Rank 0 prints its loss per step.

    --steps N [--save PATH --save-after K]       train, saving after step K
    --steps N --resume PATH                      restore PATH (the trainer state says where to go on)
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class OLMoBlock(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model, elementwise_affine=False)
        self.ff_proj = nn.Linear(d_model, 4 * d_model, bias=False)
        self.ff_out = nn.Linear(2 * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_up, gate = self.ff_proj(self.attn_norm(x)).chunk(2, dim=-1)
        return x + self.ff_out(nn.functional.silu(gate) * x_up)


class OLMo(nn.Module):
    def __init__(self, vocab: int = 48, d_model: int = 16, n_layers: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(OLMoBlock(d_model) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # weight tying, inside the root unit

    def get_fsdp_wrap_policy(self, wrap_strategy: str = "by_block"):
        def fsdp_wrap_fn(module, recurse: bool = True, nonwrapped_numel: int = 0):
            del nonwrapped_numel
            if recurse:
                return True  # always recurse
            return isinstance(module, OLMoBlock)

        assert wrap_strategy == "by_block"
        return fsdp_wrap_fn


class Trainer:
    def __init__(self, model, optim, scheduler):
        self._model = model
        self.optim = optim
        self.scheduler = scheduler
        self.global_step = 0

    def train_step(self, batch: torch.Tensor) -> float:
        self.optim.zero_grad(set_to_none=True)
        logits = self._model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        self.optim.step()
        self.scheduler.step()
        self.global_step += 1
        return loss.item()

    def save_unsharded_checkpoint(self, path: str) -> None:
        with FSDP.state_dict_type(
            self._model,
            state_dict_type=StateDictType.FULL_STATE_DICT,
            state_dict_config=FullStateDictConfig(rank0_only=True, offload_to_cpu=True),
            optim_state_dict_config=FullOptimStateDictConfig(rank0_only=True, offload_to_cpu=True),
        ):
            model_state_dict = self._model.state_dict()
            optim_state_dict = FSDP.optim_state_dict(self._model, self.optim)
        trainer_state = {"global_step": self.global_step, "scheduler": self.scheduler.state_dict()}
        if dist.get_rank() == 0:
            torch.save({"model": model_state_dict, "optim": optim_state_dict, "trainer": trainer_state}, path)
        dist.barrier()

    def restore_unsharded_checkpoint(self, path: str) -> None:
        state = torch.load(path, weights_only=True)
        with FSDP.state_dict_type(
            self._model,
            state_dict_type=StateDictType.FULL_STATE_DICT,
            state_dict_config=FullStateDictConfig(rank0_only=False, offload_to_cpu=True),
            optim_state_dict_config=FullOptimStateDictConfig(rank0_only=False, offload_to_cpu=True),
        ):
            self._model.load_state_dict(state["model"])
            self.optim.load_state_dict(FSDP.optim_state_dict_to_load(self._model, self.optim, state["optim"]))
        self.global_step = state["trainer"]["global_step"]
        self.scheduler.load_state_dict(state["trainer"]["scheduler"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save")
    parser.add_argument("--save-after", type=int, default=-1)
    parser.add_argument("--resume")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    olmo_model = OLMo()
    wrap_policy = olmo_model.get_fsdp_wrap_policy("by_block")
    fsdp_model = FSDP(
        olmo_model,
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        auto_wrap_policy=wrap_policy,
        use_orig_params=True,  # needed for compile and for the optimizer's parameter groups
        limit_all_gathers=True,
        device_id=torch.device("cpu"),
    )
    optim = torch.optim.AdamW(fsdp_model.parameters(), lr=4e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / 3))
    trainer = Trainer(fsdp_model, optim, scheduler)
    if args.resume:
        trainer.restore_unsharded_checkpoint(args.resume)

    generator = torch.Generator().manual_seed(7 + rank)
    batches = [torch.randint(0, 48, (4, 10), generator=generator) for _ in range(args.steps)]
    while trainer.global_step < args.steps:
        loss = trainer.train_step(batches[trainer.global_step])
        if rank == 0:
            print(f"loss {loss!r}")
        if trainer.global_step - 1 == args.save_after:
            trainer.save_unsharded_checkpoint(args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
