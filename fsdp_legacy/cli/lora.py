"""LoRA as fine-tuning recipes apply it (PEFT's default, without dropout): every linear layer of the model frozen,
with trainable low-rank adapters beside it in the same module, so that an FSDP unit holds frozen and trainable
parameters of one dtype in one flat parameter (FSDP1 needs use_orig_params=True for that). What tools/bench_scale.py
`--lora` measures; its shapes are the model's, its values whatever the model's initialisation gives them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Module):
    """`x W^T + b + (x A^T) B^T`: W (out, in) and b frozen, A (rank, in) and B (out, rank) trainable, in W's dtype
    and on its device (the meta device too: the model is materialised later)."""

    def __init__(self, weight: torch.Tensor, rank: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        d_out, d_in = weight.shape
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.lora_a = nn.Parameter(torch.empty(rank, d_in, dtype=weight.dtype, device=weight.device))
        self.lora_b = nn.Parameter(torch.empty(d_out, rank, dtype=weight.dtype, device=weight.device))
        nn.init.normal_(self.lora_a, std=d_in**-0.5)
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b)


def to_lora(model: nn.Module, rank: int, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Every parameter of `model` frozen, and every nn.Linear (but those named in `skip`: the output head) given
    rank-`rank` adapters (a LoRALinear holding the same weight). Returns `model`."""
    if rank < 1:
        raise ValueError(f"LoRA rank {rank}: expected a rank of 1 or more")
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and name not in skip:
                setattr(module, name, LoRALinear(child.weight, rank, child.bias))
    return model
