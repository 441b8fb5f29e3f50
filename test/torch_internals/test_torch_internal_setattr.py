"""test_fsdp_misc's test_unsafe_setattr, on ours next to torch's FSDP1 (through the switch, the same code): a module
whose class overrides `__setattr__` sees the unit's writes of its parameter views in forward, unless
FSDP_USE_UNSAFE_SETATTR is "1" when the unit is built (torch's `_flat_param._FSDP_USE_UNSAFE_SETATTR`). Also: such
a module trains as under torch's, and its override is called in the same phases (forward; backward with
use_orig_params=True only) with tensors and parameters. (Which writes torch makes within a phase is its own: with
use_orig_params=True it sets the sharded Parameter again before each forward's views, ours after backward.)"""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest
import torch
from torch import nn

from torch_side_by_side import _FSDP, _each, _run


class _SetattrLinear(nn.Module):
    """torch's test module: its __setattr__ records what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 5))
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "seen" and "seen" in self.__dict__:
            kind = "Parameter" if isinstance(value, nn.Parameter) else type(value).__name__
            self.seen.append(f"{name}:{kind}")
        super().__setattr__(name, value)


def _case(uop: bool, variable: str | None) -> dict[str, Any]:
    name = importlib.import_module("torch.distributed.fsdp._flat_param")._FSDP_USE_UNSAFE_SETATTR
    before = os.environ.pop(name, None)
    try:
        if variable is not None:
            os.environ[name] = variable
        module = _SetattrLinear()
        model = _FSDP(module, use_orig_params=uop)
    finally:
        os.environ.pop(name, None)
        if before is not None:
            os.environ[name] = before
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    writes = []
    for _ in range(2):
        module.seen.clear()
        loss = model(torch.randn(8, 5)).sum()
        writes.append(sorted(set(module.seen)))
        module.seen.clear()
        loss.backward()
        optim.step()
        writes.append(sorted(set(module.seen)))
    with _FSDP.__globals__["_fsdp"]().FullyShardedDataParallel.summon_full_params(model):
        weight = module.weight.detach().clone()
    return {
        "called": [bool(seen) for seen in writes],  # forward, backward + step, twice
        "kinds": sorted({kind.split(":")[1] for seen in writes for kind in seen}),
        "loss": loss.item(),
        "weight": weight.sum().item(),
    }


@pytest.mark.parametrize("uop", [False, True])
def test_unsafe_setattr_gates_the_modules_setattr_as_in_torch(uop: bool) -> None:
    cases = [(uop, None), (uop, "1"), (uop, "0")]
    for observed in _run(_each, _case, cases):
        unset, unsafe, zero = observed
        assert unset["called"][0] and zero["called"][0] and not any(unsafe["called"])  # what torch's test asserts
        assert set(unset["kinds"]) <= {"Tensor", "Parameter"}
