"""What the checkpoint benchmarks share (bench_checkpoint.py, and bench_async_save.py, which it runs with
--during-training): the model they save, and a free port for their ranks."""

from __future__ import annotations

import socket

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def build(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*(Block(width) for _ in range(layers)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
