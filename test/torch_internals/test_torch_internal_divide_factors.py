"""A unit's `_gradient_predivide_factor` / `_gradient_postdivide_factor`, read and rescaled as VeOmni does for its
expert-parallel units (`_get_module_fsdp_state_if_fully_sharded_module(unit)._gradient_postdivide_factor *= ep_size`),
on ours next to torch's FSDP1 (through the switch, the same code): the factors read, the gradients after the
rescaled reduction (also against the analytic oracle: the rescaled unit's gradients are the plain ones divided by
the factor), and training on."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from torch import nn

from torch_side_by_side import _FSDP, _flat, _fsdp, _full_params, _run, _units


def _grads(model: nn.Module) -> list[list[float]]:
    return [_flat(unit._handle.flat_param.grad) for unit in _units(model)[1:]]


def _rescaled(strategy: str, factor: float) -> dict[str, Any]:
    fsdp = _fsdp()
    common_utils = importlib.import_module("torch.distributed.fsdp._common_utils")
    torch.manual_seed(0)
    model = _FSDP(
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
        auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Linear}),
        sharding_strategy=getattr(fsdp.ShardingStrategy, strategy),
    )
    expert = common_utils._get_module_fsdp_state_if_fully_sharded_module(_units(model)[2])
    factors = [expert._gradient_predivide_factor, expert._gradient_postdivide_factor]
    expert._gradient_postdivide_factor *= factor
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(2):
        model(torch.full((4, 8), 0.1 * (step + 1))).square().sum().backward()
        grads.append(_grads(model))
        optim.step()
        optim.zero_grad()
    return {"factors": factors, "grads": grads, "params": _full_params(model)}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_rescaled_postdivide_factor_as_in_torch(strategy: str) -> None:
    plain = _run(_rescaled, strategy, 1.0)
    for rank, observed in enumerate(_run(_rescaled, strategy, 4.0)):
        assert observed["factors"] == [2.0, 1.0]  # two ranks: the mean taken before the sum, nothing after
        first, expert = plain[rank]["grads"][0], observed["grads"][0]
        torch.testing.assert_close(expert[0], first[0])  # the other unit untouched
        torch.testing.assert_close(expert[1], [g / 4 for g in first[1]])
