"""`fsdp-legacy migrate` on FSDP1's class handed on rather than called: a wrapper factory returning
`functools.partial(FSDP, sharding_strategy=..., mixed_precision=..., ...)` (dinov2's `get_fsdp_wrapper`) becomes
`partial(fully_shard_fsdp1, ...)`, which maps every value at run time as FSDP1 applied it; the oracle is torch's FSDP1
running the original program beside the migrated one at 2 ranks. A use of the class as a value that stays FSDP1's
leaves the file as it is, as a whole (never FSDP1 models under calls rewritten for FSDP2)."""

from __future__ import annotations

import ast
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from test_migrate import _fsdp1_names
from test_migrate_keywords import _side_by_side

from fsdp_legacy.migrate.rewriter import migrate_source

_PROGRAM = """
import functools
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Config:
    def __init__(self, **values):
        self.strategy = "FULL_SHARD"
        self.__dict__.update(values)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
        self.register_buffer("scale", torch.full((width,), 1.0 / 3))

    def forward(self, x):
        return self.inner(x.to(self.inner[0].weight.dtype)) * self.scale


def get_fsdp_wrapper(cfg, modules_to_wrap=frozenset()):
    strategies = {"FULL_SHARD": ShardingStrategy.FULL_SHARD, "SHARD_GRAD_OP": ShardingStrategy.SHARD_GRAD_OP}
    dtype = DTYPES[cfg.dtype]
    mixed_precision_config = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
    return functools.partial(
        FSDP,
        sharding_strategy=strategies[cfg.strategy],
        mixed_precision=mixed_precision_config,
        device_id=torch.device("cpu"),
        use_orig_params=True,
        auto_wrap_policy=ModuleWrapPolicy(modules_to_wrap),
    )


def build(cfg):
    torch.manual_seed(0)
    net = nn.Sequential(Block(8), Block(8), nn.Linear(8, 8))
    model = get_fsdp_wrapper(cfg, modules_to_wrap={Block})(net)
    return model, len(FSDP.fsdp_modules(model))
"""


def test_a_partial_of_fsdp_becomes_one_of_fully_shard_fsdp1() -> None:
    result = migrate_source(_PROGRAM)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert _fsdp1_names(ast.parse(out)) == set()  # the values it keeps come from fsdp_legacy
    assert "    return functools.partial(\n        fully_shard_fsdp1,\n        sharding_strategy=strategies[" in out
    assert "from fsdp_legacy.migrate.runtime import fully_shard_fsdp1\n" in out
    # what fully_shard_fsdp1 reads at run time stays FSDP1's (the buffer dtype included), unreported
    assert "MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)" in out
    again = migrate_source(out)  # a second pass finds nothing left
    assert (again.migrated, again.findings) == (out, [])


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_partial_of_fsdp_trains_as_fsdp1(ranks: Any, strategy: str, dtype: str) -> None:
    migrated = migrate_source(_PROGRAM).migrated
    for seen in ranks(_side_by_side, 2, _PROGRAM, migrated, {"strategy": strategy, "dtype": dtype}):
        assert seen["strategy"] == {strategy}
        assert seen["compared"] == (3, 3)  # the root and its two Blocks, as FSDP.fsdp_modules counts them
        # the root keeps its own parameters after forward in both; SHARD_GRAD_OP the Blocks' too
        assert seen["kept"] == (["0", "1", "2"] if strategy == "SHARD_GRAD_OP" else ["2"])
        expected = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}[dtype]
        assert seen["buffers"] == ({expected}, {expected})  # FSDP2's own policy would leave them fp32
        fsdp1, fsdp2 = seen["losses"]
        torch.testing.assert_close(fsdp2, fsdp1, rtol=1e-3 if dtype == "bf16" else 1e-6, atol=0)


_HANDED_ON = {
    "a partial with a keyword unpacked": "build_fsdp = functools.partial(FSDP, **extra)\n    model = build_fsdp(net)",
    "a partial with a keyword FSDP2 lacks": (
        "build_fsdp = functools.partial(FSDP, ignored_states=[net[0]])\n    model = build_fsdp(net)"
    ),
    "the class bound to a name": "wrapper_cls = FSDP\n    model = wrapper_cls(net)",
    "the class in a tuple of isinstance": "model = net if isinstance(net, (FSDP, nn.Linear)) else None",
}


@pytest.mark.parametrize("how", list(_HANDED_ON))
def test_the_class_handed_on_and_left_fsdp1s_keeps_the_file_whole(how: str) -> None:
    """The rest of the file (here FSDP.fsdp_modules and a state-dict block) rewritten for FSDP2 around the FSDP1
    models the class still builds would match nothing or fail: the file stays as it is, and says why."""
    source = f"""
import functools
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType


def build(net, extra):
    {_HANDED_ON[how]}
    print(len(FSDP.fsdp_modules(model)))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return model.state_dict()
"""
    result = migrate_source(source)
    assert result.migrated == source
    refusals = [f for f in result.findings if f.kind == "refused"]
    assert [f.what for f in refusals] == ["FSDP1 constructions kept"], [f.format("x.py") for f in result.findings]
    assert refusals[0].line == 8
