"""The runtime's steps that torch's tests (test_fsdp_core's TestHooks, test_fsdp_fine_tune's reshard-hooks test) and
libraries wrap through torch's names to count or extend them: `_runtime_utils._register_pre_backward_hooks`,
`_register_post_backward_hook` and `_post_backward_reshard`. With a counting wrapper that calls the original in place
(as those tests patch them), ours under the switch must make the same calls as torch's FSDP1, train the same, and a
wrapper's return value must be what the forward returns."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from parameterized import parameterized
from torch import nn

from torch_side_by_side import _FSDP, _full_params, _run, _wrap_api

_NAMES = ("_register_pre_backward_hooks", "_register_post_backward_hook", "_post_backward_reshard")


@contextmanager
def _counting() -> Iterator[dict[str, int]]:
    """Each name of torch's `_runtime_utils` wrapped by a counter that calls what was there."""
    runtime_utils = importlib.import_module("torch.distributed.fsdp._runtime_utils")
    counts = dict.fromkeys(_NAMES, 0)
    with ExitStack() as stack:
        for name in _NAMES:
            original = getattr(runtime_utils, name)

            def counted(*args: Any, __name: str = name, __original: Any = original, **kwargs: Any) -> Any:
                counts[__name] += 1
                return __original(*args, **kwargs)

            setattr(runtime_utils, name, counted)
            stack.callback(setattr, runtime_utils, name, original)
        yield counts


def _frozen_sequence(frozen: tuple[int, ...]) -> nn.Module:
    """Linear layers (each a unit under ModuleWrapPolicy) with ReLUs between, the `frozen` ones without gradient:
    torch's fine-tune test model."""
    layers: list[nn.Module] = []
    for index in range(6):
        linear = nn.Linear(5, 5)
        linear.requires_grad_(index not in frozen)
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers)


def _counts_of_a_step(strategy: str, use_orig_params: bool, input_requires_grad: bool) -> dict[str, Any]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    model = _FSDP(
        _frozen_sequence(frozen=(0, 2, 4)),
        auto_wrap_policy=_wrap_api().ModuleWrapPolicy({nn.Linear}),
        sharding_strategy=fsdp.ShardingStrategy[strategy],
        use_orig_params=use_orig_params,
    )
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    seen: dict[str, Any] = {}
    with _counting() as counts:
        for step in range(2):
            x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step), requires_grad=input_requires_grad)
            output = model(x)
            seen[f"forward {step}"] = dict(counts)
            output.sum().backward()
            optim.step()
            optim.zero_grad()
            seen[f"step {step}"] = dict(counts)
    seen["params"] = _full_params(model)
    return seen


CASES = [
    (strategy, uop, requires_grad)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    for uop in (False, True)
    for requires_grad in (False, True)
]


@parameterized.expand(CASES)
def test_runtime_steps_are_called_through_torch_names(strategy: str, uop: bool, input_requires_grad: bool) -> None:
    for observed in _run(_counts_of_a_step, strategy, uop, input_requires_grad):
        assert all(observed["step 1"][name] > 0 for name in _NAMES), observed["step 1"]


def _replaced_pre_backward_registration() -> dict[str, Any]:
    """A replacement that returns something else: the forward returns what it returned, as torch's does."""
    runtime_utils = importlib.import_module("torch.distributed.fsdp._runtime_utils")
    original = runtime_utils._register_pre_backward_hooks
    model = _FSDP(nn.Linear(3, 3))

    def doubled(state: Any, module: nn.Module, outputs: Any, handle: Any) -> Any:
        return original(state, module, outputs, handle) * 2

    runtime_utils._register_pre_backward_hooks = doubled
    try:
        output = model(torch.ones(1, 3))
    finally:
        runtime_utils._register_pre_backward_hooks = original
    return {"output": output.detach().flatten().tolist(), "plain": (model.module(torch.ones(1, 3)) * 2).tolist()}


def test_a_replacement_s_return_value_is_the_forward_s() -> None:
    for observed in _run(_replaced_pre_backward_registration):
        assert observed["output"] == observed["plain"][0]
