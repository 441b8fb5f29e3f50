"""A QLoRA-style model for the mixed-dtype tests: frozen 4-bit weights packed two per uint8 byte, with per-group scales,
beside trainable low-rank adapters, all in one FSDP unit per block.

The packed weight is a Parameter subclass carrying its quantization state as an attribute (as bitsandbytes' Params4bit
does): dequantizing reads it, so the layer fails unless FSDP hands it the subclass with its attributes.
"""

import torch
from torch import nn

from fsdp_legacy.cli.qlora import PackedWeight, QLoRALinear, QuantState, dequantize, quantize

__all__ = ["PackedWeight", "QLoRABlock", "QLoRALinear", "QLoRANet", "QuantState", "dequantize", "quantize"]


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
