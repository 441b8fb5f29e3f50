"""The rest of torch's FSDP1 semantics outside optimizer state (issue 20): hybrid-sharding argument errors,
`summon_full_params(with_grads=True)` with flat parameters, and execution-order checks at the DETAIL debug level.
Oracle: torch's FSDP1 on the same ranks (CPU, `device_id=torch.device("cpu")`)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp

import fsdp_legacy
import models
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
