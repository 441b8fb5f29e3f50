"""A QLoRA-style model for the mixed-dtype tests: frozen 4-bit weights packed two per uint8 byte, with per-group scales,
beside trainable low-rank adapters, all in one FSDP unit per block.

The packed weight is a Parameter subclass carrying its quantization state as an attribute (as bitsandbytes' Params4bit
does): dequantizing reads it, so the layer fails unless FSDP hands it the subclass with its attributes.
"""

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

    def __deepcopy__(self, memo: dict) -> "PackedWeight":
        result = super().__deepcopy__(memo)
        result.quant_state = self.quant_state
        return result


def quantize(weight: torch.Tensor, group_size: int) -> tuple[PackedWeight, torch.Tensor]:
    """(packed codes, per-group scales) of a float weight: symmetric 4-bit, absmax per group of `group_size`."""
    rows, cols = weight.shape
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
        state = self.state if self.weight_as_buffer or fake else weight.quant_state  # type: ignore[attr-defined]
        base = x @ dequantize(weight, self.scales, state).to(x.dtype).T
        adapter = (x.to(self.lora_a.dtype) @ self.lora_a.T) @ self.lora_b.T
        return base + adapter.to(x.dtype)


class QLoRABlock(nn.Module):
    def __init__(self, width: int, **kwargs) -> None:
        super().__init__()
        self.proj = QLoRALinear(width, width, **kwargs)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class QLoRANet(nn.Module):
    """Two QLoRA blocks and a QLoRA head; each block (and the root) holds uint8, scale and adapter parameters."""

    def __init__(self, width: int = 32, **kwargs) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(QLoRABlock(width, **kwargs) for _ in range(2))
        self.head = QLoRALinear(width, 4, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    @staticmethod
    def batch(seed: int, width: int = 32) -> torch.Tensor:
        return torch.randn(6, width, generator=torch.Generator().manual_seed(seed))
