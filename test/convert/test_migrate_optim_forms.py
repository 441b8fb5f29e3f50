"""Optimizer-state forms of public FSDP1 programs: the distributed-training-guide's resume
`FSDP.optim_state_dict_to_load(model, optimizer, optim_state_dict=..., load_directly=True)` written as a statement
(it loads), modalities' `optimizer_state = optimizer.state_dict()` handed to `FSDP.optim_state_dict(model=model,
optim=optimizer, optim_state_dict=optimizer_state)` (FSDP1's default, through a name), the model given by keyword
(its block's options apply). Before, the first two were reported and left FSDP1 in files otherwise migrated, and the
third took FSDP1's default options instead of its block's rank0_only. The oracle for the resume is torch's FSDP1
running the original beside the migrated program at 2 ranks."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("libcst")

from fsdp_legacy.migrate.rewriter import migrate_source

_GUIDE = """
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    FullyShardedDataParallel,
    ShardingStrategy,
    StateDictType,
    ShardedStateDictConfig,
    ShardedOptimStateDictConfig,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.ff(x))


def train(exp_dir, steps, resume):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(8, 2))
    model = FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
    )
    FullyShardedDataParallel.set_state_dict_type(
        model,
        state_dict_type=StateDictType.SHARDED_STATE_DICT,
        state_dict_config=ShardedStateDictConfig(offload_to_cpu=True),
        optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=True),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    if resume:
        model.load_state_dict(torch.load(os.path.join(exp_dir, f"model.shard-{rank}.pt"), weights_only=False))
        FullyShardedDataParallel.optim_state_dict_to_load(
            model,
            optimizer,
            optim_state_dict=torch.load(os.path.join(exp_dir, f"optimizer.shard-{rank}.pt"), weights_only=False),
            load_directly=True,
        )
    losses = []
    for step in steps:
        data = torch.Generator().manual_seed(10 * step + rank)
        loss = nn.functional.mse_loss(model(torch.randn(4, 8, generator=data)), torch.ones(4, 2))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.save(model.state_dict(), os.path.join(exp_dir, f"model.shard-{rank}.pt"))
    optim_state = FullyShardedDataParallel.optim_state_dict(model, optimizer)
    torch.save(optim_state, os.path.join(exp_dir, f"optimizer.shard-{rank}.pt"))
    dist.barrier()
    return losses
"""


def test_a_load_directly_statement_becomes_set_optimizer_state_dict() -> None:
    result = migrate_source(_GUIDE)
    assert result.findings == [], [f.format("guide.py") for f in result.findings]
    assert "FullyShardedDataParallel" not in result.migrated.split("class Block")[1]
    assert "        set_optimizer_state_dict(\n            model,\n" in result.migrated or (
        "set_optimizer_state_dict(model, optimizer, torch.load(" in result.migrated
    )


def _resumes(original: str, migrated: str, folder: str) -> dict[str, Any]:
    seen = {}
    for kind, source in (("fsdp1", original), ("fsdp2", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, f"{kind}.py", "exec"), namespace)
        where = os.path.join(folder, kind)
        os.makedirs(where, exist_ok=True)
        first = namespace["train"](where, range(2), resume=False)
        again = namespace["train"](where, range(2, 4), resume=True)  # each from its own per-rank files
        seen[kind] = first, again
    return seen


def test_the_migrated_guide_resumes_as_fsdp1(ranks: Any, tmp_path: Path) -> None:
    migrated = migrate_source(_GUIDE).migrated
    for seen in ranks(_resumes, 2, _GUIDE, migrated, str(tmp_path)):
        (first1, again1), (first2, again2) = seen["fsdp1"], seen["fsdp2"]
        assert first2 == pytest.approx(first1, rel=1e-5)
        assert again2 == pytest.approx(again1, rel=1e-5)


@pytest.mark.parametrize(
    ("between", "mapped"),
    [("", True), ("optimizer.step()\n", False)],
    ids=["its own dict", "stepped in between"],
)
def test_the_optimizers_own_dict_through_a_name_is_fsdp1s_default(between: str, mapped: bool) -> None:
    source = (
        textwrap.dedent(
            """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

        def save(model, optimizer):
            with FSDP.state_dict_type(module=model, state_dict_type=StateDictType.FULL_STATE_DICT):
                model_state = model.state_dict()
                optimizer_state = optimizer.state_dict()
        """
        )
        + textwrap.indent(between, " " * 8)
        + textwrap.indent(
            "optim_state_dict = FSDP.optim_state_dict(model=model, optim=optimizer, optim_state_dict=optimizer_state)\n"
            "return model_state, optim_state_dict\n",
            " " * 8,
        )
    )
    result = migrate_source(source)
    assert ("get_optimizer_state_dict(model, optimizer, options=" in result.migrated) is mapped
    assert bool(result.findings) is not mapped
