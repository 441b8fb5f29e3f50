"""The rest of torch's FSDP1 semantics outside optimizer state (issue 20): hybrid-sharding argument errors,
`summon_full_params(with_grads=True)` with flat parameters, and execution-order checks at the DETAIL debug level.
Oracle: torch's FSDP1 on the same ranks (CPU, `device_id=torch.device("cpu")`)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from test_optim_semantics import nested_model
from torch import nn

import fsdp_legacy
import models
from fsdp_utils import Config, batch, build_ours, build_torch_fsdp, clean, loss_of
from harness import run_on_ranks


def outcome(fn: Any, *args: Any, **kwargs: Any) -> str:
    """What `fn` raised, as "Type: message" ("ok" when it returned)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fn(*args, **kwargs)
        except Exception as error:  # any type: the oracle compares them
            return f"{type(error).__name__}: {error}"
    return "ok"


# --------------------------------------------------------------------------------------------------------------------
# Part 15: HYBRID_SHARD given one group where a pair is needed


def _hybrid_errors() -> None:
    for group in (dist.group.WORLD, (dist.group.WORLD,), (dist.group.WORLD, "replicate")):
        ours, theirs = (
            outcome(
                lib.FullyShardedDataParallel,
                models.Net(),
                process_group=group,
                sharding_strategy=lib.ShardingStrategy.HYBRID_SHARD,
                device_id=torch.device("cpu"),
            )
            for lib in (fsdp_legacy, torch_fsdp)
        )
        assert theirs.startswith("ValueError: Expected process_group to be passed in as either None or"), theirs
        assert ours == theirs


@pytest.mark.parametrize("world_size", [1, 2])
def test_hybrid_shard_with_one_group_raises_torchs_error(world_size: int) -> None:
    run_on_ranks(_hybrid_errors, world_size)


# --------------------------------------------------------------------------------------------------------------------
# Part 13: summon_full_params(with_grads=True) with flat parameters


def _grads_in_summon(lib: Any, config: Config, uop: bool, nested: bool) -> dict[str, Any]:
    """{clean name: (parameter shape, gradient)} inside summon_full_params(with_grads=True) after one backward."""
    if nested:  # a root that is not FSDP, units inside it
        model = nested_model(lib, uop=uop)
        model(torch.randn(8, 5)).sum().backward()
    else:
        config = dataclasses.replace(config, use_orig_params=uop)
        model = build_ours(config)[1] if lib is fsdp_legacy else build_torch_fsdp(config)
        loss_of(model(batch(config, 0))).backward()
    with lib.FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        return {
            clean(name): (tuple(param.shape), None if param.grad is None else param.grad.clone())
            for name, param in model.named_parameters()
        }


def _with_grads(strategy: str, nested: bool) -> None:
    config = Config("net", strategy=strategy)
    ours = _grads_in_summon(fsdp_legacy, config, False, nested)
    # torch's FSDP1 refuses with_grads with flat parameters; with original parameters it shows the same gradients.
    assert outcome(_grads_in_summon, torch_fsdp, config, False, nested).startswith("NotImplementedError: ")
    theirs = _grads_in_summon(torch_fsdp, config, True, nested)
    assert list(ours) == list(theirs)
    for name, (shape, grad) in theirs.items():
        assert ours[name][0] == shape and grad is not None, name
        assert ours[name][1] is not None and ours[name][1].shape == shape, (name, ours[name][1])
        torch.testing.assert_close(ours[name][1], grad, msg=name)


@pytest.mark.parametrize(
    "strategy,nested,world_size", [("FULL_SHARD", False, 2), ("NO_SHARD", False, 2), ("FULL_SHARD", True, 4)]
)
def test_summon_with_grads_flat_params_shows_original_shapes(strategy: str, nested: bool, world_size: int) -> None:
    run_on_ranks(_with_grads, world_size, strategy, nested)


# --------------------------------------------------------------------------------------------------------------------
# Part 16: execution-order checks at the DETAIL debug level


class Ordered(nn.Module):
    """Two units of the same size whose forward order `swap` reverses (so a differing order does not hang)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer0, self.layer1, self.layer2 = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.layer2, self.layer1) if self.swap else (self.layer1, self.layer2)
        return second(torch.relu(first(torch.relu(self.layer0(x))))).sum()


def ordered(lib: Any, strategy: str) -> nn.Module:
    torch.manual_seed(0)
    model = Ordered()
    kwargs = {"sharding_strategy": lib.ShardingStrategy[strategy], "device_id": torch.device("cpu")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.layer1 = lib.FullyShardedDataParallel(model.layer1, **kwargs)
        model.layer2 = lib.FullyShardedDataParallel(model.layer2, **kwargs)
        return lib.FullyShardedDataParallel(model, **kwargs)


def order_warnings(model: nn.Module, backward: bool = True) -> list[str]:
    """One iteration; the execution-order warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = model(torch.randn(8, 5))
        if backward:
            loss.backward()
    return [str(w.message) for w in caught if str(w.message).startswith("Forward order differs")]


def at_level(level: Any, fn: Any, *args: Any) -> Any:
    previous = dist.get_debug_level()
    dist.set_debug_level(level)
    try:
        return fn(*args)
    finally:
        dist.set_debug_level(previous)


def _first_iteration(lib: Any, strategy: str) -> str:
    model = ordered(lib, strategy)
    model.module.swap = dist.get_rank() != 0
    return outcome(order_warnings, model)


def _first_iteration_raises(strategy: str) -> None:
    for level in (dist.DebugLevel.DETAIL, dist.DebugLevel.INFO):
        ours, theirs = (at_level(level, _first_iteration, lib, strategy) for lib in (fsdp_legacy, torch_fsdp))
        detail = level == dist.DebugLevel.DETAIL
        assert theirs.startswith("RuntimeError: Forward order differs across ranks") if detail else theirs == "ok"
        assert ours == theirs, level


@pytest.mark.parametrize("strategy,world_size", [("FULL_SHARD", 2), ("SHARD_GRAD_OP", 2), ("FULL_SHARD", 4)])
def test_first_iteration_order_differing_across_ranks_raises_on_every_rank(strategy: str, world_size: int) -> None:
    run_on_ranks(_first_iteration_raises, world_size, strategy)


def _later_iterations(lib: Any, strategy: str, same_iterations: int) -> list[list[str]]:
    model = ordered(lib, strategy)
    result = [order_warnings(model) for _ in range(same_iterations)]
    model.module.swap = dist.get_rank() != 0
    return result + [order_warnings(model) for _ in range(2)]


def _later_iteration_warns(strategy: str, same_iterations: int) -> None:
    ours, theirs = (
        at_level(dist.DebugLevel.DETAIL, _later_iterations, lib, strategy, same_iterations)
        for lib in (fsdp_legacy, torch_fsdp)
    )
    prefix = (
        f"Forward order differs from that of the first iteration on rank {dist.get_rank()}. Collectives are "
        "unchecked and may give incorrect results or hang"
    )
    deviating = ours[same_iterations]
    assert all(not warnings for i, warnings in enumerate(ours) if i != same_iterations), ours
    if dist.get_rank() == 0:
        assert not deviating and not any(theirs)
        return
    # torch warns at every difference within the deviating iteration (here two); ours once, with torch's first text.
    assert len(deviating) == 1 and deviating[0].startswith(prefix), deviating
    assert deviating[0] == theirs[same_iterations][0] and len(theirs[same_iterations]) == 2
    assert all(not warnings for i, warnings in enumerate(theirs) if i != same_iterations), theirs


@pytest.mark.parametrize("strategy,same_iterations", [("FULL_SHARD", 1), ("SHARD_GRAD_OP", 3)])
def test_later_iteration_order_change_warns_once(strategy: str, same_iterations: int) -> None:
    run_on_ranks(_later_iteration_warns, 2, strategy, same_iterations)


def _train_eval(lib: Any) -> list[str]:
    model = ordered(lib, "FULL_SHARD")
    seen: list[str] = []
    for _ in range(2):
        model.train()
        for _ in range(3):
            seen += order_warnings(model)
        model.eval()
        for _ in range(3):
            seen += order_warnings(model, backward=False)
    return seen


def _train_eval_quiet() -> None:
    ours, theirs = (at_level(dist.DebugLevel.DETAIL, _train_eval, lib) for lib in (fsdp_legacy, torch_fsdp))
    assert ours == theirs == []
    model = ordered(fsdp_legacy, "FULL_SHARD")
    order_warnings(model)
    assert model._runtime.exec_order is None, "off below DETAIL"


def test_train_eval_switching_is_no_order_difference() -> None:
    run_on_ranks(_train_eval_quiet, 2)
