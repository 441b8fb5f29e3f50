"""A construction's keyword read through a name bound in more than one way keeps its run-time value. t5_11's trainer
(the origin of torch's FSDP T5 tutorial) binds `mp_policy, wrapping_policy = get_policies(cfg)`, then
`mp_policy = None` when the model itself is cast to bf16, and wraps with `mixed_precision=mp_policy`. The tool took
the second, a literal None, for the only binding and dropped the keyword as FSDP1's default: the migrated program
trained in fp32 where the original trained in bf16, without a word. The oracle is torch's FSDP1 running the original
beside the migrated program at 2 ranks: the same losses and the same compute dtype inside the units."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from fsdp_legacy.migrate.rewriter import migrate_source

_PROGRAM = """
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

bfSixteen = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)


class T5Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.ff(x))


def get_policies(cfg):
    mixed_precision_policy = None
    if cfg["use_mixed_precision"]:
        mixed_precision_policy = bfSixteen
    wrapping_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block})
    return mixed_precision_policy, wrapping_policy


def train(cfg, seen_dtypes):
    mp_policy, wrapping_policy = get_policies(cfg)
    torch.manual_seed(0)
    model = nn.Sequential(T5Block(), T5Block(), nn.Linear(8, 2))
    if cfg["model_in_bf16"]:
        model.to(torch.bfloat16)
        mp_policy = None
    model = FSDP(
        model,
        auto_wrap_policy=wrapping_policy,
        mixed_precision=mp_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),
    )
    model[0].ff.register_forward_hook(lambda module, args, out: seen_dtypes.append(str(args[0].dtype)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for step in range(3):
        data = torch.Generator().manual_seed(10 * step + dist.get_rank())
        out = model(torch.randn(4, 8, generator=data).to(torch.bfloat16 if cfg["model_in_bf16"] else torch.float32))
        loss = nn.functional.mse_loss(out.float(), torch.ones(4, 2))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
"""


def test_the_keyword_read_at_run_time_keeps_the_policy() -> None:
    result = migrate_source(_PROGRAM)
    assert result.findings == [], [f.format("t5.py") for f in result.findings]
    assert "fsdp1_options(mixed_precision=mp_policy" in result.migrated


def _side_by_side(original: str, migrated: str) -> dict[str, Any]:
    seen = {}
    for kind, source in (("fsdp1", original), ("fsdp2", migrated)):
        for flags in ((True, False), (True, True)):
            namespace: dict[str, Any] = {}
            exec(compile(source, f"{kind}.py", "exec"), namespace)
            dtypes: list[str] = []
            cfg = {"use_mixed_precision": flags[0], "model_in_bf16": flags[1]}
            seen[kind, flags] = namespace["train"](cfg, dtypes), sorted(set(dtypes))
    return seen


def test_the_migrated_program_trains_in_bf16_as_fsdp1(ranks: Any) -> None:
    migrated = migrate_source(_PROGRAM).migrated
    for seen in ranks(_side_by_side, 2, _PROGRAM, migrated):
        for flags in ((True, False), (True, True)):
            (losses1, dtypes1), (losses2, dtypes2) = seen["fsdp1", flags], seen["fsdp2", flags]
            assert dtypes1 == dtypes2 == ["torch.bfloat16"]
            assert losses2 == pytest.approx(losses1, rel=1e-3)  # bf16 (docs/migration.md: FSDP1 vs FSDP2 in bf16)
        assert torch.tensor(seen["fsdp1", (True, False)][0]).ne(torch.tensor(seen["fsdp1", (True, True)][0])).any()


@pytest.mark.parametrize(
    "binding",
    [
        "from config import mp_policy\n",  # imported; the None below is another function's local
        "mp_policy, other = None, None\n",
        "for mp_policy in (None,):\n    pass\n",
    ],
    ids=["imported", "unpacked", "loop"],
)
def test_a_name_bound_twice_in_any_way_is_read_at_run_time(binding: str) -> None:
    source = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        + binding
        + "\n\ndef helper():\n    mp_policy = None\n    return mp_policy\n"
        + "\n\ndef main(net):\n    model = FSDP(net, mixed_precision=mp_policy)\n"
    )
    assert "fsdp1_options(mixed_precision=mp_policy)" in migrate_source(source).migrated
