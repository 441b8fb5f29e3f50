"""An FSDP1 program in the style of Answer.AI's fsdp_qlora (train.py): a frozen base model with LoRA adapters on
its projections, built for real on rank 0 and on the meta device on the other ranks, materialized by a lambda
param_init_fn (to_empty) and made rank 0's by sync_module_states; the wrap policy built by a function
(functools.partial of _or_policy over a lambda policy for the trainable adapters and a transformer policy for the
layers), bf16 MixedPrecision with a buffer dtype, gradient accumulation under no_sync, clipping, AdamW, and the
trained LoRA weights taken from a FULL state dict (rank0_only) and written by rank 0. Rank 0 prints its loss per
step and the checksum of what it saved.

    --steps N [--save PATH]    train N steps, then save the LoRA weights to PATH
    --steps N --resume PATH    start from the LoRA weights in PATH (loaded by rank 0 before wrapping)
"""

import argparse
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy


class LORA(nn.Module):
    def __init__(self, base_layer: nn.Linear, lora_rank: int, lora_alpha: float) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_AB = nn.Sequential(
            nn.Linear(base_layer.in_features, lora_rank, bias=False),
            nn.Linear(lora_rank, base_layer.out_features, bias=False),
        )
        self.scaling = lora_alpha / lora_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_AB(x) * self.scaling


class DecoderLayer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.q_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.up_proj = nn.Linear(dim, 2 * dim)
        self.down_proj = nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        weights = torch.softmax(self.q_proj(x) @ x.transpose(1, 2) / x.shape[-1] ** 0.5, dim=-1)
        h = h + weights @ self.v_proj(x)
        return h + self.down_proj(torch.relu(self.up_proj(h)))


class TinyCausalLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim) for _ in range(layers))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("position_scale", torch.linspace(1.0, 0.5, 8))  # cast by buffer_dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids) * self.position_scale[: input_ids.shape[1], None]
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


def get_wrapping_policy():
    def lambda_policy_fn(module):
        # LORA trainable layers.
        return isinstance(module, nn.Sequential) and all(m.weight.requires_grad for m in module)

    lambda_policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda_policy_fn)
    transformer_wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=(DecoderLayer,))
    policies = [lambda_policy, transformer_wrap_policy]
    return functools.partial(_or_policy, policies=policies)


def build_model(lora_rank: int = 4) -> nn.Module:
    model = TinyCausalLM()
    model.requires_grad_(False)  # the base model is frozen
    for layer in model.layers:
        for name in ("q_proj", "v_proj", "down_proj"):
            setattr(layer, name, LORA(getattr(layer, name), lora_rank, lora_alpha=8.0))
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if rank == 0:
        model = build_model()
        if args.resume:
            model.load_state_dict(torch.load(args.resume, weights_only=True), strict=False)
    else:
        with torch.device("meta"):
            model = build_model()

    mp_policy = MixedPrecision(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.bfloat16,  # the gradients are reduced in bf16 as well
        buffer_dtype=torch.bfloat16,
    )
    model = FSDP(
        model,
        auto_wrap_policy=get_wrapping_policy(),
        mixed_precision=mp_policy,
        param_init_fn=lambda module: module.to_empty(device=torch.device("cpu"), recurse=False),
        sync_module_states=True,
        limit_all_gathers=True,
        use_orig_params=False,
        device_id=torch.device("cpu"),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)

    generator = torch.Generator().manual_seed(10 + rank)
    for _ in range(args.steps):
        for micro in range(args.gradient_accumulation_steps):
            input_ids = torch.randint(0, 32, (4, 8), generator=generator)
            if micro + 1 < args.gradient_accumulation_steps:
                with model.no_sync():
                    loss = nn.functional.cross_entropy(model(input_ids).flatten(0, 1).float(), input_ids.flatten())
                    (loss / args.gradient_accumulation_steps).backward()
            else:
                loss = nn.functional.cross_entropy(model(input_ids).flatten(0, 1).float(), input_ids.flatten())
                (loss / args.gradient_accumulation_steps).backward()
        model.clip_grad_norm_(1.0, norm_type=2.0)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"loss {loss.item()!r}")

    if args.save:
        dist.barrier()
        save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy):
            cpu_state_dict = model.state_dict()
            if rank == 0:
                lora_state = {k: v for k, v in cpu_state_dict.items() if "lora_AB" in k}
                print(f"saved {sum(v.double().pow(2).sum().item() for v in lora_state.values())!r}")
                torch.save(lora_state, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
