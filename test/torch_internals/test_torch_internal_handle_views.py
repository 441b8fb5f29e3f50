"""`FlatParamHandle._use_unsharded_views(as_params)`, which torch's test_fsdp_core (TestAutograd's
test_unshard_params_as_tensors) replaces on `torch.distributed.fsdp._flat_param.FlatParamHandle` to check that
forward and backward compute on tensor views, never parameter views. Under the switch that class is ours: the runtime
must call the step through the class attribute, so a wrapper sees the calls torch's FSDP1 makes, with the same
`as_params`, and training through the wrapper goes on as torch's."""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Any

import torch
from parameterized import parameterized
from torch import nn

from torch_side_by_side import _FSDP, _full_params, _run, _wrap_api


def _views_seen(strategy: str, use_orig_params: bool) -> dict[str, Any]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    handle_class = importlib.import_module("torch.distributed.fsdp._flat_param").FlatParamHandle
    model = _FSDP(
        nn.Sequential(*[nn.Linear(3, 3) for _ in range(5)]),
        auto_wrap_policy=_wrap_api().ModuleWrapPolicy({nn.Linear}),
        sharding_strategy=fsdp.ShardingStrategy[strategy],
        use_orig_params=use_orig_params,
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    original = handle_class._use_unsharded_views
    calls: Counter[tuple[str, bool]] = Counter()
    phase = "forward"

    def recorded(self: Any, as_params: bool) -> None:
        calls[(phase, as_params)] += 1
        return original(self, as_params)

    handle_class._use_unsharded_views = recorded
    try:
        for step in range(2):
            phase = "forward"
            loss = model(torch.randn(2, 3, generator=torch.Generator().manual_seed(step))).sum()
            phase = "backward"
            loss.backward()
            optim.step()
            optim.zero_grad()
    finally:
        handle_class._use_unsharded_views = original
    return {
        "phases": sorted({name for name, _ in calls}),
        "as_params": sorted({as_params for _, as_params in calls}),
        "forward calls": calls[("forward", False)],
        "params": _full_params(model),
    }


CASES = [(strategy, uop) for strategy in ("FULL_SHARD", "SHARD_GRAD_OP") for uop in (False, True)]


@parameterized.expand(CASES)
def test_unsharded_views_are_tensor_views_seen_through_the_class(strategy: str, use_orig_params: bool) -> None:
    for observed in _run(_views_seen, strategy, use_orig_params):
        assert observed["as_params"] == [False], observed
        assert observed["forward calls"] == 2 * 5, observed  # each Linear unit in each forward (the root has none)
