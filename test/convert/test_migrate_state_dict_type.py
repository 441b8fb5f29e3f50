"""`fsdp-legacy migrate` on `FSDP.set_state_dict_type`: followed to the state-dict calls on the model after it, which
take the options the type implies, where that is unambiguous; reported with those calls otherwise. The oracle for
the mapping is torch's FSDP1 running the same function: what model.state_dict() and FSDP.optim_state_dict give on
each rank under the type it set, and what load_state_dict loads."""

from __future__ import annotations

import ast
import textwrap
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from test_migrate import _fsdp1_names

from fsdp_legacy.migrate.rewriter import migrate_source

_SET = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp import FullStateDictConfig, ShardedStateDictConfig
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    FSDP.set_state_dict_type(model, StateDictType.TYPE, CONFIG)
    saved = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):  # a block overrides it, and restores it
        full = model.state_dict()
    again = model.state_dict()
    model.load_state_dict(LOAD)
    return saved, full, again, model.state_dict()
"""

# kind -> (type, config, what every rank loads under it: full tensors, or its own shards)
_TYPES = {
    # (offload_to_cpu=True would hit torch FSDP1's own CPU bug, test/frameworks/common.py; DSD offloads with rank0_only)
    "full on rank 0": (
        "FULL_STATE_DICT",
        "FullStateDictConfig(rank0_only=True)",
        "{k: v * 2 for k, v in full.items()}",
    ),
    "sharded": ("SHARDED_STATE_DICT", "ShardedStateDictConfig(offload_to_cpu=False)", "again"),
}


def _program(kind: str) -> str:
    type_, config, load = _TYPES[kind]
    return _SET.replace("TYPE", type_).replace("CONFIG", config).replace("LOAD", load)


@pytest.mark.parametrize("kind", list(_TYPES))
def test_the_type_it_sets_is_taken_by_the_calls_after_it(kind: str) -> None:
    result = migrate_source(_program(kind))
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert _fsdp1_names(ast.parse(out)) == set() and "FSDP.set_state_dict_type(model, StateDictType" not in out
    model_options = (
        "StateDictOptions(full_state_dict=True, cpu_offload=True)" if "full" in kind else "StateDictOptions()"
    )
    optim_options = "StateDictOptions(full_state_dict=True)" if "full" in kind else "StateDictOptions(cpu_offload=True)"
    assert f'"model": get_model_state_dict(model, options={model_options})' in out
    assert f"get_optimizer_state_dict(model, optim, options={optim_options})" in out
    assert "full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))" in out
    assert f"again = get_model_state_dict(model, options={model_options})" in out
    assert f"set_model_state_dict(model, {_TYPES[kind][2]}, options={model_options})" in out


def _under_the_set_type(fsdp1_source: str, migrated_source: str) -> list[Any]:
    """On a rank: each program's state dicts as comparable data: per key, the kind of value (a full tensor, this
    rank's shard, or a plain value) and its local content."""
    from torch.distributed.tensor import DTensor

    def flat(value: Any) -> tuple[str, Any]:
        if isinstance(value, DTensor):
            return "shard", value.to_local().flatten()
        if hasattr(value, "local_shards"):  # FSDP1's ShardedTensor
            return "shard", torch.cat([s.tensor.flatten() for s in value.local_shards()])
        if isinstance(value, torch.Tensor):
            return "full", value.flatten()
        if isinstance(value, dict):
            return "dict", {key: flat(v) for key, v in value.items()}
        if isinstance(value, list):
            return "list", [flat(v) for v in value]
        return "value", value

    seen = []
    for source in (fsdp1_source, migrated_source):
        scope: dict[str, Any] = {}
        exec(compile(source, "program.py", "exec"), scope)
        seen.append(flat(list(scope["run"]())))
    return seen


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize("kind", list(_TYPES))
def test_the_calls_give_what_fsdp1_gives_under_the_type(ranks: Any, kind: str) -> None:
    """Per rank, the same kinds of values (rank 0's full tensors and nothing elsewhere, or each rank's shards), the
    same values, and the same state after loading (with the block in between)."""
    source = _program(kind)
    for fsdp1, fsdp2 in ranks(_under_the_set_type, 2, source, migrate_source(source).migrated):
        saved = fsdp1[1][0][1]["model"]
        assert saved[0] == "dict" and {kind for kind, _ in saved[1].values()} <= {"full", "shard"}
        assert _equal(fsdp2, fsdp1)


_REFUSED = {
    "set twice": ("FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)\n", "model.state_dict()"),
    "its result used": ("before = FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)", "before"),
    "LOCAL": ("FSDP.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT)", "model.state_dict()"),
    "a computed config": ("FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, config)", "config"),
    "a call before it": ("model.state_dict()\nFSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)", ""),
    "a nested function": (
        "FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)\n"
        "def later():\n    return model.state_dict()",
        "later",
    ),
    "the model bound again": (
        "FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)\nmodel = FSDP(net)",
        "model.state_dict()",
    ),
}


@pytest.mark.parametrize(("setter", "after"), _REFUSED.values(), ids=list(_REFUSED))
def test_a_setter_it_cannot_follow_is_reported_with_its_calls(setter: str, after: str) -> None:
    """The setter and every state-dict call on the model stay as they are (mapped with FSDP1's default type they
    would save something else), and each is reported; so is a call in another function."""
    if setter.startswith("FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)\n"):
        setter += "FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)"
    body = f"{setter}\nsaved = model.state_dict()\nreturn saved, {after or 'None'}"
    source = textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

        def run(net, config):
            model = FSDP(net)
        """
    ) + textwrap.indent(body, "    ")
    source += "\n\ndef elsewhere(model):\n    return model.state_dict()\n"
    result = migrate_source(source)
    lines = source.splitlines()
    setters = [i for i, line in enumerate(lines, 1) if "set_state_dict_type" in line]
    calls = [i for i, line in enumerate(lines, 1) if "model.state_dict()" in line]
    assert {f.line for f in result.findings} == {*setters, *calls}, [f.format("x.py") for f in result.findings]
    assert result.migrated.count("model.state_dict()") == len(calls)  # none mapped
    assert "get_model_state_dict" not in result.migrated


def test_a_call_in_another_function_keeps_the_setter() -> None:
    """The same model's name in another function may be the model the setter set, or not: whichever, the setter and
    that call are left to a person; without a setter it is FSDP1's default type, as before."""
    source = textwrap.dedent(
        """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

        def save(model):
            return model.state_dict()

        def run(net):
            model = FSDP(net)
            FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
            return save(model)
        """
    )
    result = migrate_source(source)
    assert sorted(f.line for f in result.findings) == [5, 9]
    without = migrate_source(
        source.replace("    FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)\n", "")
    )
    assert without.findings == []
    assert "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))" in without.migrated


# -- the model built, typed and returned by one function, its state-dict calls in the caller -----------------------

_BUILDER = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp import FullStateDictConfig, ShardedStateDictConfig
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def build_model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
    FSDP.set_state_dict_type(model, StateDictType.TYPE, CONFIG)
    return model


def run():
    fsdp_model = build_model()
    optim = torch.optim.Adam(fsdp_model.parameters(), lr=0.1)
    fsdp_model(torch.randn(2, 4)).sum().backward()
    optim.step()
    saved = {"model": fsdp_model.state_dict(), "optim": FSDP.optim_state_dict(fsdp_model, optim)}
    with FSDP.state_dict_type(fsdp_model, StateDictType.FULL_STATE_DICT):
        full = fsdp_model.state_dict()
    again = fsdp_model.state_dict()
    fsdp_model.load_state_dict(LOAD)
    return saved, full, again, fsdp_model.state_dict()
"""


def _builder(kind: str) -> str:
    type_, config, load = _TYPES[kind]
    return _BUILDER.replace("TYPE", type_).replace("CONFIG", config).replace("LOAD", load)


@pytest.mark.parametrize("kind", list(_TYPES))
def test_a_type_set_where_the_model_is_built_is_followed_to_the_caller(ranks: Any, kind: str) -> None:
    """Before, the setter stayed (reported: the calls were 'not after it in its block') while the construction
    became fully_shard: FSDP1's setter on an FSDP2 model. Now the type travels with the returned model to the
    `fsdp_model = build_model()` call site, and the caller's calls take its options; per rank, the same state dicts
    as torch's FSDP1 gives, and the same state after loading."""
    source = _builder(kind)
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert _fsdp1_names(ast.parse(out)) == set() and "    FSDP.set_state_dict_type(" not in out
    assert "the state-dict calls on what build_model() returns take its options" in out
    options = "StateDictOptions(full_state_dict=True, cpu_offload=True)" if "full" in kind else "StateDictOptions()"
    assert f"again = get_model_state_dict(fsdp_model, options={options})" in out
    for fsdp1, fsdp2 in ranks(_under_the_set_type, 2, source, out):
        assert _equal(fsdp2, fsdp1)


_NOT_FOLLOWED = {
    "not called in the file": ("fsdp_model = build_model()", "fsdp_model = make()", "is not called in this file"),
    "used as a value": ("fsdp_model = build_model()", "fsdp_model = [build_model()][0]", "used other than as"),
    "two returns": (
        "    return model\n",
        "    if dist.get_rank() < 0:\n        return None\n    return model\n",
        "more than one place",
    ),
    "a call in another function": (
        "def run():",
        "def save(fsdp_model):\n    return fsdp_model.state_dict()\n\n\ndef run():",
        "are not after it",
    ),
    "the target bound again": (
        "    again = fsdp_model",
        "    fsdp_model = fsdp_model\n    again = fsdp_model",
        "`fsdp_model` is bound again after `fsdp_model = build_model()`",
    ),
}


@pytest.mark.parametrize(("before", "after", "why"), _NOT_FOLLOWED.values(), ids=list(_NOT_FOLLOWED))
def test_where_the_returned_model_goes_is_unclear_the_file_stays_fsdp1(before: str, after: str, why: str) -> None:
    """All FSDP1 or all FSDP2: the construction, the setter and every call stay as they were, byte for byte, and
    the setter's finding says why (before, the construction became fully_shard under FSDP1's setter)."""
    source = _builder("sharded").replace(before, after, 1)
    assert after in source
    result = migrate_source(source)
    assert result.migrated == source
    setter = next(i for i, line in enumerate(source.splitlines(), 1) if "set_state_dict_type" in line)
    found = {f.line: f for f in result.findings}
    assert found[setter].kind == "refused" and why in found[setter].why, found[setter].why
    assert "the file is left as it is, as a whole" in found[setter].why
