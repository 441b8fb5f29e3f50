"""QLoRA, as `fsdp-legacy mem-report --qlora` estimates it: frozen 4-bit base weights packed two per uint8 byte with
per-group scales, beside trainable low-rank adapters (LoRA), in the same FSDP unit (one flat parameter per dtype).

A stand-in for bitsandbytes' NF4 layer that dequantizes with torch ops (symmetric 4-bit codes, one absmax scale per
group): the same bytes per weight as NF4 (half a byte, plus the scales), so the same memory, on any device and under
FakeTensorMode. The packed weight is a Parameter subclass carrying its quantization state as an attribute, as
bitsandbytes' Params4bit does: dequantizing reads it, so the layer fails unless FSDP hands it the subclass with its
attributes. test/mixed_dtype_models.py builds its models from these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class QuantState:
    shape: tuple[int, int]  # the dequantized weight's shape
    group_size: int  # elements per scale


class PackedWeight(nn.Parameter):
    """uint8 codes, two 4-bit values per byte; `quant_state` says how to unpack them."""

    quant_state: QuantState

    def __deepcopy__(self, memo: dict) -> PackedWeight:
        result = super().__deepcopy__(memo)
        result.quant_state = self.quant_state
        return result


def quantize(weight: torch.Tensor, group_size: int) -> tuple[PackedWeight, torch.Tensor]:
    """(packed codes, per-group scales) of a float weight: symmetric 4-bit, absmax per group of `group_size`."""
    rows, cols = weight.shape
    if weight.device.type == "meta":  # shapes only (mem-report's wrap plan): the same tensors without the arithmetic
        packed = PackedWeight(torch.empty(rows, cols // 2, dtype=torch.uint8, device="meta"), requires_grad=False)
        packed.quant_state = QuantState((rows, cols), group_size)
        return packed, torch.empty(rows, cols // group_size, dtype=weight.dtype, device="meta")
    groups = weight.reshape(rows, cols // group_size, group_size)
    scales = groups.abs().amax(-1).clamp_min(1e-6) / 7
    codes = (groups / scales[..., None]).round().clamp(-8, 7).to(torch.int16) + 8  # 0..15
    pairs = codes.reshape(rows, cols // 2, 2).to(torch.uint8)
    packed = PackedWeight(pairs[..., 0] | (pairs[..., 1] << 4), requires_grad=False)
    packed.quant_state = QuantState((rows, cols), group_size)
    return packed, scales


def dequantize(packed: torch.Tensor, scales: torch.Tensor, state: QuantState) -> torch.Tensor:
    rows, cols = state.shape
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(rows, cols // state.group_size, state.group_size)
    return ((codes.to(scales.dtype) - 8) * scales[..., None]).reshape(rows, cols)


class QLoRALinear(nn.Module):
    def __init__(
        self,
        d_in: int,
        d_out: int,
        rank: int = 4,
        group_size: int = 8,
        adapter_dtype: torch.dtype = torch.float32,
        scale_dtype: torch.dtype = torch.float32,
        weight_as_buffer: bool = False,
    ) -> None:
        super().__init__()
        packed, scales = quantize(torch.randn(d_out, d_in) / d_in**0.5, group_size)
        self.weight_as_buffer = weight_as_buffer
        self.state = packed.quant_state
        if weight_as_buffer:  # the same layer as torch's FSDP1 can hold it (integer parameters refused): an oracle
            self.register_buffer("weight", packed.detach())
        else:
            self.weight = packed
        self.scales = nn.Parameter(scales.to(scale_dtype), requires_grad=False)
        self.lora_a = nn.Parameter((torch.randn(rank, d_in) / d_in**0.5).to(adapter_dtype))
        self.lora_b = nn.Parameter((torch.randn(d_out, rank) * 0.1).to(adapter_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        # A buffer, or under FakeTensorMode (the memory estimator), where every parameter is a FakeTensor: the layer
        # supplies the state itself. Otherwise it must come with the parameter (an AttributeError without it).
        fake = type(weight).__name__ == "FakeTensor"
        state = self.state if self.weight_as_buffer or fake else weight.quant_state
        base = x @ dequantize(weight, self.scales, state).to(x.dtype).T
        adapter = (x.to(self.lora_a.dtype) @ self.lora_a.T) @ self.lora_b.T
        return base + adapter.to(x.dtype)


def to_qlora(
    model: nn.Module,
    rank: int = 64,
    group_size: int = 64,
    skip: tuple[str, ...] = ("lm_head",),
    frozen_dtype: torch.dtype = torch.bfloat16,
) -> nn.Module:
    """QLoRA's recipe on `model`: every nn.Linear (but those named in `skip`: the output head) replaced by a
    QLoRALinear of its shape (frozen 4-bit base, bf16 scales, trainable rank-`rank` adapters in fp32, as PEFT keeps
    them), and everything else frozen in `frozen_dtype` (a model loaded in bf16). Returns `model`."""
    for param in model.parameters():
        param.requires_grad_(False)
        if param.is_floating_point():
            param.data = param.data.to(frozen_dtype)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name not in skip:
                layer = QLoRALinear(
                    child.in_features, child.out_features, rank=rank, group_size=group_size, scale_dtype=torch.bfloat16
                )
                setattr(module, child_name, layer)
    return model
