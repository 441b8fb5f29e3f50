"""FSDP1's `_exec_order_data._forward_prefetch_limit` / `_backward_prefetch_limit`, which Composer sets on every
FSDP root it builds (and warns on every model without them): how many units ahead a unit starts all-gathers. On ours
next to torch's FSDP1 (through the switch, the same code): which units hold gathered parameters while the first inner
unit runs forward and while the last one starts its backward, and training itself. (Ours groups small units into one
all-gather by default; the bucket is turned off here so that each unit's gather is its own, as in torch.)"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from torch_side_by_side import _FSDP, _fsdp, _full_params, _run, _units


def _gathered(unit: nn.Module) -> bool:
    padded = unit._handle.flat_param._full_param_padded
    return padded.untyped_storage().size() > 0


def _prefetching(limit: int) -> dict[str, Any]:
    fsdp = _fsdp()
    before = os.environ.get("FSDP_LEGACY_BUCKET_MB")
    os.environ["FSDP_LEGACY_BUCKET_MB"] = "0"
    try:
        layers = [nn.Linear(8, 8) for _ in range(5)]
        model = _FSDP(
            nn.Sequential(*layers),
            auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Linear}),
            forward_prefetch=True,
            backward_prefetch=fsdp.BackwardPrefetch.BACKWARD_PRE,
        )
        model._exec_order_data._forward_prefetch_limit = limit  # Composer's prepare_fsdp_module
        model._exec_order_data._backward_prefetch_limit = limit
        units = _units(model)[1:]
        seen: list[list[bool]] = []
        seen_in_backward: list[list[bool]] = []
        layers[4].register_full_backward_pre_hook(
            lambda *_: seen_in_backward.append([_gathered(unit) for unit in units])
        )
        layers[0].register_forward_hook(lambda *_: seen.append([_gathered(unit) for unit in units]))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            loss = model(torch.full((4, 8), 0.1 * (step + 1))).square().sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    finally:
        os.environ.pop("FSDP_LEGACY_BUCKET_MB")
        if before is not None:
            os.environ["FSDP_LEGACY_BUCKET_MB"] = before
    return {"seen": seen, "seen_in_backward": seen_in_backward, "losses": losses, "params": _full_params(model)}


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_prefetch_limits_as_composer_sets_them(limit: int) -> None:
    for observed in _run(_prefetching, limit):
        # from the second iteration on (the first records the order): the unit itself and the one `limit` places
        # after it (torch's meaning of the limit: the one in between was gathered by the unit before)
        assert observed["seen"][1] == [True] + [False] * (limit - 1) + [True] + [False] * (4 - limit)
        # the last unit's backward: itself and the one `limit` places before it
        assert observed["seen_in_backward"][1] == [index in (4, 4 - limit) for index in range(5)]
