"""FSDP1's stream attributes and device handle as code reads and sets them, on ours next to torch's FSDP1 (through
the switch, the same code): DINOv2 (`fsdp_synchronize_streams`) copies one root's `_unshard_stream`,
`_post_backward_stream`, `_pre_unshard_stream`, `_all_reduce_stream` and `_default_stream` onto the other roots after
their first forward, so that they share streams, and trains on; ByteCheckpoint walks a handle's parameter names."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torch_side_by_side import _FSDP, _fsdp, _full_params, _run

_STREAMS = ("_unshard_stream", "_post_backward_stream", "_pre_unshard_stream", "_all_reduce_stream", "_default_stream")


def _shared_streams() -> dict[str, Any]:
    policy = _fsdp().wrap.ModuleWrapPolicy({nn.Linear})
    teacher = _FSDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), auto_wrap_policy=policy)
    student = _FSDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), auto_wrap_policy=policy)
    before = [hasattr(teacher, name) for name in _STREAMS]  # set at lazy init, as torch's
    generator = torch.Generator().manual_seed(1)
    optim = torch.optim.SGD(student.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        x = torch.randn(4, 8, generator=generator)
        with torch.no_grad():
            target = teacher(x)
        loss = (student(x) - target).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
        if step == 0:  # DINOv2's fsdp_synchronize_streams
            for name in _STREAMS:
                setattr(student, name, getattr(teacher, name))
    current = torch.get_device_module("cpu").current_stream()
    return {
        "before": before,
        "kinds": [type(getattr(teacher, name)).__name__ for name in _STREAMS],
        "default_is_current": teacher._default_stream == current,
        "losses": losses,
        "student": _full_params(student),
    }


def test_stream_attributes_read_and_shared_between_roots_as_in_torch() -> None:
    for observed in _run(_shared_streams):
        assert observed["before"] == [False] * len(_STREAMS)
        assert observed["kinds"] == ["Stream"] * len(_STREAMS) and observed["default_is_current"]


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.proj = nn.Linear(4, 6, bias=False)
        self.proj.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(x))


def _names_and_device() -> dict[str, Any]:
    """ByteCheckpoint's walk over a handle's parameter names, and the device handle code asks for device counts and
    streams (ColossalAI, Galvatron)."""
    model = _FSDP(_Tied())
    model(torch.tensor([[1, 2]])).sum().backward()
    handle = model._handle
    return {
        "names": list(handle.param_module_names()),
        "shared": list(handle.shared_param_module_names()),
        "devices": [model._device_handle.device_count(), handle._device_handle.device_count()],
        "stream": type(handle._device_handle.current_stream()).__name__,
        "keep_low_precision_grads": handle._keep_low_precision_grads,
    }


def test_handle_names_and_device_handle_as_in_torch() -> None:
    for observed in _run(_names_and_device):
        assert observed["names"] == [("weight", "embed"), ("weight", "proj")]
        assert observed["shared"] == [("weight", "proj")]
