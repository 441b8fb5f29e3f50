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

import fsdp_legacy
import models
from fsdp_utils import Config, batch, build_ours, build_torch_fsdp, clean, loss_of
from harness import run_on_ranks
from test_optim_semantics import nested_model


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
