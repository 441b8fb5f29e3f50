"""`fsdp-legacy migrate` on `with FSDP.state_dict_type(model, ...)` blocks whose type and configs the source does not
show (Composer's checkpoint helpers: `state_dict_type = SHARDED if sharded_state_dict else FULL` and a config chosen
by the same conditional): the block becomes `state_dict_type_options(...)` where it started, deciding at run time as
FSDP1 does, and its calls take those options. The oracle is torch's FSDP1 running the original at 2 ranks: each
rank's state dicts under either type, and what load_state_dict loads."""

from __future__ import annotations

import ast
from typing import Any

import pytest

pytest.importorskip("libcst")

from test_migrate import _fsdp1_names
from test_migrate_state_dict_type import _equal, _under_the_set_type

from fsdp_legacy.migrate.rewriter import migrate_source
from fsdp_legacy.migrate.runtime import state_dict_type_options

_PROGRAM = """
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

SHARDED = WHICH


def state_dicts(model, optim, sharded_state_dict):
    state_dict_type = StateDictType.SHARDED_STATE_DICT if sharded_state_dict else StateDictType.FULL_STATE_DICT
    state_dict_config = ShardedStateDictConfig(
        offload_to_cpu=False,
    ) if sharded_state_dict else FullStateDictConfig(
        rank0_only=True,
    )
    optim_state_dict_config = ShardedOptimStateDictConfig(
        offload_to_cpu=False,
    ) if sharded_state_dict else FullOptimStateDictConfig(rank0_only=True)
    with FSDP.state_dict_type(
        model,
        state_dict_type=state_dict_type,
        state_dict_config=state_dict_config,
        optim_state_dict_config=optim_state_dict_config,
    ):
        return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}


def load(model, state, sharded_state_dict):
    kind = StateDictType.SHARDED_STATE_DICT if sharded_state_dict else StateDictType.FULL_STATE_DICT
    with FSDP.state_dict_type(model, kind):
        model.load_state_dict(state)


def run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    saved = state_dicts(model, optim, SHARDED)
    full = model.state_dict()
    load(model, saved["model"] if SHARDED else {k: v * 2 for k, v in full.items()}, SHARDED)
    return saved, full, model.state_dict()
"""


def _program(sharded: bool) -> str:
    return _PROGRAM.replace("WHICH", str(sharded))


def test_a_type_chosen_at_run_time_is_decided_there() -> None:
    result = migrate_source(_program(True))
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    # what the helper reads at run time stays as written: FSDP1's configs, as data
    assert _fsdp1_names(ast.parse(out)) <= {
        "FullStateDictConfig", "ShardedStateDictConfig", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig"
    }  # fmt: skip
    assert "FSDP.state_dict_type" not in out and "StateDictType.FULL_STATE_DICT\n" in out
    assert (
        "    state_dict_options, optim_state_dict_options = state_dict_type_options(state_dict_type=state_dict_type, "
        "state_dict_config=state_dict_config, optim_state_dict_config=optim_state_dict_config)\n"
        '    return {"model": get_model_state_dict(model, options=state_dict_options), '
        '"optim": get_optimizer_state_dict(model, optim, options=optim_state_dict_options)}\n'
    ) in out
    assert "state_dict_type_options(state_dict_type=kind)\n" in out
    assert "set_model_state_dict(model, state, options=state_dict_options)" in out
    again = migrate_source(out)  # a second pass finds nothing left
    assert (again.migrated, again.findings) == (out, [])


@pytest.mark.parametrize("sharded", [False, True], ids=["full on rank 0", "sharded"])
def test_a_type_chosen_at_run_time_gives_what_fsdp1_gives(ranks: Any, sharded: bool) -> None:
    source = _program(sharded)
    for fsdp1, fsdp2 in ranks(_under_the_set_type, 2, source, migrate_source(source).migrated):
        assert {kind for kind, _ in fsdp1[1][0][1]["model"][1].values()} == ({"shard"} if sharded else {"full"}) or (
            fsdp1[1][0][1]["model"][1] == {}
        )
        assert _equal(fsdp2, fsdp1)


_KEPT = {
    "LOCAL written": "StateDictType.LOCAL_STATE_DICT",
    "a config bound twice": "state_dict_type, state_dict_config=c",
    "a config of another kind": "state_dict_type, state_dict_config=make_config()",
}


@pytest.mark.parametrize("args", list(_KEPT.values()), ids=list(_KEPT))
def test_a_block_it_cannot_decide_stays_with_the_file(args: str) -> None:
    source = _program(True).replace(
        "    with FSDP.state_dict_type(model, kind):",
        f"    c = None\n    c = ShardedStateDictConfig()\n    with FSDP.state_dict_type(model, {args}):",
    )
    result = migrate_source(source)
    assert result.migrated == source and any(f.kind == "refused" for f in result.findings)


def test_a_config_computed_inline_is_decided_where_the_block_starts() -> None:
    source = _program(True).replace("with FSDP.state_dict_type(model, kind):", (
        "with FSDP.state_dict_type(model, kind, ShardedStateDictConfig(offload_to_cpu=sharded_state_dict)):"
    ))  # fmt: skip
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    expected = "state_dict_type_options(state_dict_type=kind, state_dict_config=ShardedStateDictConfig(offload_to_cpu="
    assert expected in result.migrated


def test_the_helper_refuses_what_fsdp2_lacks() -> None:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    with pytest.raises(NotImplementedError, match="LOCAL_STATE_DICT"):
        state_dict_type_options(StateDictType.LOCAL_STATE_DICT)
    with pytest.raises(RuntimeError, match="ShardedStateDictConfig"):  # as FSDP1's state_dict_type raises
        state_dict_type_options(StateDictType.SHARDED_STATE_DICT, FullStateDictConfig())
