"""`fsdp-legacy migrate`: FSDP1 programs rewritten onto FSDP2.

The oracle is always the FSDP1 program itself: the units its policy wraps (torch's FSDP1 vs the migrated program's
fully_shard units, on a rank pool), what it reads and saves; whole programs of test/migrate_corpus/ run with torchrun
before and after migration in test_migrate_corpus.py, the optimizer-state API in test_migrate_optim.py,
set_state_dict_type in test_migrate_state_dict_type.py, enable_wrap and hybrid process groups in
test_migrate_wrap.py. What cannot be mapped must come back as `file:line:` findings with the construct left
untouched, and the exit code must say so."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import repo_paths

pytest.importorskip("libcst")

from fsdp_legacy.cli import main as cli_main
from fsdp_legacy.migrate.rewriter import migrate_source

CORPUS = repo_paths.TEST_DIR / "migrate_corpus"


def _fsdp1_names(tree: ast.AST) -> set[str]:
    """Names imported from FSDP1's modules that the code still uses (imports excluded)."""
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed.fsdp")
        for alias in node.names
        if alias.name not in ("fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy", "FSDPModule")
    }
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in imported}


# -- the units: a policy evaluated as FSDP1 evaluates it ----------------------------------------------------------

# The block both the policy programs here and test_migrate_wrap's use.
_BLOCK = """class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))

    def forward(self, x):
        return self.inner(x)
"""

_MODEL = (
    """
import functools
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import (
    CustomPolicy, ModuleWrapPolicy, lambda_auto_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy
)


"""
    + _BLOCK
    + """

def build():
    torch.manual_seed(0)
    model = nn.Sequential(Block(8), Block(8), nn.Linear(8, 40), nn.Linear(40, 8))
    model = FSDP(model, auto_wrap_policy=POLICY, device_id=torch.device("cpu"))
    return model
"""
)

_POLICIES = [
    ("module_wrap", "ModuleWrapPolicy({Block})"),
    ("transformer", "functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})"),
    ("size_based", "functools.partial(size_based_auto_wrap_policy, min_num_params=150)"),
    ("lambda", "functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear))"),
    ("custom", "CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features == 40)"),
]


def _unit_names(fsdp1_source: str, migrated_source: str) -> tuple[list[str], list[str]]:
    """On a rank: the modules torch's FSDP1 wraps, and those the migrated code shards (FQNs, root '')."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    before: dict[str, Any] = {}
    exec(compile(fsdp1_source, "fsdp1.py", "exec"), before)
    wrapped = before["build"]()
    fsdp1 = sorted(
        name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "").rstrip(".")
        for name, m in wrapped.named_modules()
        if isinstance(m, FullyShardedDataParallel)
    )
    after: dict[str, Any] = {}
    exec(compile(migrated_source, "fsdp2.py", "exec"), after)
    sharded: nn.Module = after["build"]()
    fsdp2 = sorted(name for name, m in sharded.named_modules() if isinstance(m, FSDPModule))
    return fsdp1, fsdp2


@pytest.mark.parametrize(("name", "policy"), _POLICIES, ids=[n for n, _ in _POLICIES])
def test_policy_units_match_fsdp1(ranks: Any, name: str, policy: str) -> None:
    source = _MODEL.replace("POLICY", policy)
    result = migrate_source(source)
    assert result.findings == [], result.findings
    assert _fsdp1_names(ast.parse(result.migrated)) <= {
        "size_based_auto_wrap_policy",
        "lambda_auto_wrap_policy",
        "CustomPolicy",
    }
    assert "fully_shard(model" in result.migrated or "apply_fully_shard(model" in result.migrated
    # class policies become plain fully_shard calls; the others go through the runtime helper
    assert ("apply_fully_shard" in result.migrated) == (name in ("size_based", "lambda", "custom"))
    fsdp1, fsdp2 = ranks(_unit_names, 2, source, result.migrated)[0]
    assert len(fsdp1) > 1, fsdp1  # the policy wraps something below the root
    assert fsdp2 == fsdp1


@pytest.mark.parametrize("keyword", ["ignored_modules", "ignored_states"])
@pytest.mark.parametrize("name", ["module_wrap", "size_based"])
def test_ignored_modules_are_not_units(ranks: Any, name: str, keyword: str) -> None:
    """FSDP1 never wraps an ignored module, even one of the policy's classes; nor may the migrated code shard it.
    (ignored_states=[modules] is ignored_modules.)"""
    policy = dict(_POLICIES)[name]
    source = _MODEL.replace("POLICY", policy).replace("device_id=", f"{keyword}=[model[1]], device_id=")
    result = migrate_source(source)
    assert result.findings == [], result.findings
    fsdp1, fsdp2 = ranks(_unit_names, 2, source, result.migrated)[0]
    assert "1" not in fsdp1 and len(fsdp1) > 1, fsdp1
    assert fsdp2 == fsdp1


def _plain_params(fsdp1_source: str, migrated_source: str) -> tuple[list[str], list[str]]:
    """On a rank: the parameters left unsharded, full size, by torch's FSDP1 and by the migrated code."""
    from torch.distributed.tensor import DTensor

    before: dict[str, Any] = {}
    exec(compile(fsdp1_source, "fsdp1.py", "exec"), before)
    fsdp1 = sorted(
        name.replace("_fsdp_wrapped_module.", "")
        for name, p in before["build"]().named_parameters()
        if not name.endswith("_flat_param")
    )
    after: dict[str, Any] = {}
    exec(compile(migrated_source, "fsdp2.py", "exec"), after)
    fsdp2 = sorted(name for name, p in after["build"]().named_parameters() if not isinstance(p, DTensor))
    return fsdp1, fsdp2


@pytest.mark.parametrize("name", ["module_wrap", "size_based"])
def test_ignored_states_of_parameters_stay_unsharded(ranks: Any, name: str) -> None:
    """ignored_states=[parameters]: FSDP1 leaves them out of its flat parameters, FSDP2 out of its DTensors."""
    policy = dict(_POLICIES)[name]
    ignored = "ignored_states=[model[2].weight, model[3].bias], device_id="
    source = _MODEL.replace("POLICY", policy).replace("device_id=", ignored)
    result = migrate_source(source)
    assert result.findings == [], result.findings
    assert "ignored_params" in result.migrated
    fsdp1, fsdp2 = ranks(_plain_params, 2, source, result.migrated)[0]
    assert fsdp1 == ["2.weight", "3.bias"] and fsdp2 == fsdp1
    units = ranks(_unit_names, 2, source, result.migrated)[0]
    assert units[1] == units[0]


def _meshes(fsdp1_source: str, migrated_source: str) -> tuple[list[int], set[tuple[int, ...]], list[str], list[str]]:
    """On a rank: the ranks of FSDP1's process group, those of every FSDP2 parameter's mesh, and both unit lists."""
    from torch.distributed.tensor import DTensor

    before: dict[str, Any] = {}
    exec(compile(fsdp1_source, "fsdp1.py", "exec"), before)
    wrapped = before["build"]()
    group = dist.get_process_group_ranks(wrapped.process_group)
    after: dict[str, Any] = {}
    exec(compile(migrated_source, "fsdp2.py", "exec"), after)
    sharded = after["build"]()
    meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for p in sharded.parameters() if isinstance(p, DTensor)}
    return group, meshes, *_unit_names(fsdp1_source, migrated_source)


def test_a_process_group_becomes_the_mesh_of_its_ranks(ranks: Any) -> None:
    """FSDP(..., process_group=pair) on 4 ranks shards within each pair of ranks; the migrated code's mesh is the
    pair."""
    group = "process_group=dist.new_subgroups(2)[0], device_id="
    source = _MODEL.replace("POLICY", "ModuleWrapPolicy({Block})").replace("device_id=", group)
    source = source.replace("import torch\n", "import torch\nimport torch.distributed as dist\n", 1)
    result = migrate_source(source)
    assert result.findings == [], result.findings
    assert "DeviceMesh.from_group(" in result.migrated
    for rank, (fsdp1_group, meshes, fsdp1_units, fsdp2_units) in enumerate(ranks(_meshes, 4, source, result.migrated)):
        assert fsdp1_group == ([0, 1] if rank < 2 else [2, 3])
        assert meshes == {tuple(fsdp1_group)}
        assert fsdp2_units == fsdp1_units


def _initial_params(fsdp1_source: str, migrated_source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """On a rank: the full parameters right after construction, torch's FSDP1 and the migrated code's."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    before: dict[str, Any] = {}
    exec(compile(fsdp1_source, "fsdp1.py", "exec"), before)
    wrapped = before["build"]()
    with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False):
        fsdp1 = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in wrapped.named_parameters()}
    after: dict[str, Any] = {}
    exec(compile(migrated_source, "fsdp2.py", "exec"), after)
    return fsdp1, {n: p.full_tensor() for n, p in after["build"]().named_parameters()}


@pytest.mark.parametrize("init", ["", "param_init_fn=lambda m: m.to_empty(device='cpu', recurse=False), "])
def test_meta_device_model_is_materialized_as_fsdp1_does(ranks: Any, init: str) -> None:
    """Without param_init_fn FSDP1 calls reset_parameters() on each module of a meta unit; with one, that function.
    Either way the migrated program's initial values are FSDP1's (the lambda leaves memory uninitialized in both, so
    only the names are compared there)."""
    source = _MODEL.replace("POLICY", "ModuleWrapPolicy({Block})").replace("device_id=", init + "device_id=")
    source = source.replace(
        "    model = nn.Sequential(", "    with torch.device('meta'):\n        model = nn.Sequential("
    )
    result = migrate_source(source)
    assert result.findings == [], result.findings
    assert "apply_fully_shard(model, ModuleWrapPolicy({Block})" in result.migrated
    fsdp1, fsdp2 = ranks(_initial_params, 2, source, result.migrated)[0]
    assert sorted(fsdp1) == sorted(fsdp2)
    if not init:
        assert all(torch.equal(fsdp1[n], fsdp2[n]) for n in fsdp1)


# -- keyword mapping, methods, blocks -----------------------------------------------------------------------------


def _migrated(source: str) -> tuple[str, Any]:
    result = migrate_source(textwrap.dedent(source))
    ast.parse(result.migrated)  # always valid Python
    return result.migrated, result


def test_keywords_map_onto_fully_shard() -> None:
    out, result = _migrated(
        """
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, CPUOffload
        from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

        def build(net):
            optim = torch.optim.SGD(net.parameters(), lr=0.1)
            model = FSDP(
                net,
                sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
                cpu_offload=CPUOffload(offload_params=True),
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                limit_all_gathers=True,
                sync_module_states=True,
            )
            return model, optim
        """
    )
    assert result.findings == []
    tree = ast.parse(out)
    assert _fsdp1_names(tree) == set()
    calls = {ast.unparse(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert ast.unparse(calls["MixedPrecisionPolicy"]) == "MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
    assert "CPUOffloadPolicy" in calls and "init_device_mesh" in calls  # HYBRID_SHARD: a (replicate, shard) mesh
    assert '"mesh": mesh' in out and "buffer.data.to(torch.bfloat16)" in out  # buffer_dtype: an explicit cast
    assert "torch.distributed.broadcast" in out  # sync_module_states, before sharding
    for dropped in ("limit_all_gathers", "backward_prefetch"):
        assert f"# fsdp-legacy migrate: {dropped}=" in out
    # the optimizer over the parameters fully_shard replaces now comes after it
    body = out.splitlines()
    assert body.index(next(line for line in body if "torch.optim.SGD" in line)) > max(
        i for i, line in enumerate(body) if "fully_shard(" in line
    )


def test_no_offload_inside_a_construction_imports_nothing() -> None:
    """`cpu_offload=CPUOffload(offload_params=False)` is FSDP2's default: nothing is passed, and nothing imported."""
    out, result = _migrated(
        """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, CPUOffload

        def build(net):
            model = FSDP(net, cpu_offload=CPUOffload(offload_params=False))
            return model
        """
    )
    assert result.findings == [] and "fully_shard(net)" in out
    assert "OffloadPolicy" not in out and "CPUOffload" not in out


def test_training_and_state_dict_calls() -> None:
    out, result = _migrated(
        """
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
        from torch.distributed.fsdp import FullStateDictConfig, FullOptimStateDictConfig

        def step(net, optim, batches):
            model = FSDP(net)
            for batch in batches[:-1]:
                with model.no_sync():
                    if batch is None:
                        return None
                    model(batch).sum().backward()
            norm = model.clip_grad_norm_(1.0)
            config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            optim_config = FullOptimStateDictConfig(rank0_only=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config, optim_config):
                state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
            model.load_state_dict(state["model"])
            to_load = FSDP.optim_state_dict_to_load(model, optim, state["optim"])
            optim.load_state_dict(to_load)
            return norm, FSDP.fsdp_modules(model)
        """
    )
    assert result.findings == [], result.findings
    assert _fsdp1_names(ast.parse(out)) == set()  # the config's assignment went with its only use
    full_rank0 = "StateDictOptions(full_state_dict=True, cpu_offload=True)"
    assert f"get_model_state_dict(model, options={full_rank0})" in out
    assert f"get_optimizer_state_dict(model, optim, options={full_rank0})" in out
    # outside the block: FSDP1's default, a full state dict on every rank
    assert 'set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))' in out
    # (FSDP1's full optimizer state shares one `step` tensor per unit: unshared before FSDP2 loads it)
    assert "set_optimizer_state_dict(model, optim, unshared_optim_state(state" in out
    assert "optim.load_state_dict" not in out
    assert "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)" in out
    assert "isinstance(m, FSDPModule)" in out
    # a return inside no_sync: sync is switched back on in a finally
    assert re.search(
        r"set_requires_gradient_sync\(False\).*\n\s*try:.*finally:\n\s*model\.set_requires_gradient_sync\(True\)",
        out,
        re.S,
    )


_CHECKPOINTING = """
import functools
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as ac
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

def setup(model):
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return torch.optim.SGD(model.parameters(), lr=0.1)  # does more than checkpointing

def build(model):
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    BETWEEN
    AC
    return model
"""


@pytest.mark.parametrize(
    ("between", "ac", "moved"),
    [
        ("pass", "apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))", True),
        (
            "wrapper = functools.partial(ac.checkpoint_wrapper)",
            "ac.apply_activation_checkpointing(model, wrapper)",
            False,
        ),
        ("pass", "setup(model)", False),
    ],
    ids=["moved", "uses a name bound after wrapping", "a helper that does more"],
)
def test_activation_checkpointing_after_wrapping_moves_before_fully_shard(between: str, ac: str, moved: bool) -> None:
    out, result = _migrated(_CHECKPOINTING.replace("BETWEEN", between).replace("AC", ac))
    assert result.findings == [], result.findings
    assert (out.index(f"\n    {ac}\n") < out.index("fully_shard(model")) == moved


_SUMMON = """
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

def look(net, x, rank):
    model = FSDP(net)
    norms = {}
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
BODY
    return norms
"""

_READS = {
    "norms into a dict": "for name, p in model.named_parameters():\n    norms[name] = p.norm().item()",
    "print": "if rank == 0:\n    print(sum(p.numel() for p in model.parameters()))",
    "copies": "saved = [p.detach().clone() for p in model.parameters()]\ntotal = 0\ntotal += len(saved)",
}
_WRITES = {
    "copy_ through .data": "for p in model.parameters():\n    p.data.copy_(x)",
    "in-place add": "model.head.weight.add_(1)",
    "fill under no_grad": "with torch.no_grad():\n    next(model.parameters()).fill_(0)",
    "parameter assigned": "model.head.weight = nn.Parameter(x)",
    ".data assigned": "next(model.parameters()).data = x",
    "item assigned": "weight = model.head.weight\nweight[0] = 1",
    "nn.init": "nn.init.zeros_(model.head.weight)",
}


def _summon(body: str) -> str:
    return _SUMMON.replace("BODY", textwrap.indent(body, " " * 8))


@pytest.mark.parametrize("body", _READS.values(), ids=list(_READS))
def test_summon_full_params_that_reads_is_mapped(body: str) -> None:
    out, result = _migrated(_summon(body))
    assert result.findings == [], result.findings
    assert "with full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):" in out
    assert "from fsdp_legacy.migrate.runtime import full_params" in out
    assert _fsdp1_names(ast.parse(out)) == set()


@pytest.mark.parametrize("body", _WRITES.values(), ids=list(_WRITES))
def test_summon_full_params_that_writes_is_reported(body: str) -> None:
    source = _summon(body)
    out, result = _migrated(source)
    summon = next(i for i, line in enumerate(source.splitlines(), 1) if "summon_full_params" in line)
    assert [f.line for f in result.findings] == [summon], [f.format("x.py") for f in result.findings]
    assert "writes" in result.findings[0].what
    assert source.splitlines()[summon - 1] in out  # the block is left as it was
    assert "with full_params(" not in out


def test_summon_full_params_with_grads_is_reported() -> None:
    source = _summon("print(1)").replace("offload_to_cpu=True", "with_grads=True")
    out, result = _migrated(source)
    assert len(result.findings) == 1 and "with_grads=True" in result.findings[0].what
    assert "FSDP.summon_full_params(model" in out


def _full_params_as_fsdp1() -> dict[str, Any]:
    """On a rank: torch's FSDP1 summon_full_params and fsdp_legacy.migrate.runtime.full_params on the same model
    after the same bf16 step, what each shows, and full_params' refusal of a write it cannot carry back."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.tensor import DTensor

    from fsdp_legacy.migrate.runtime import full_params

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))

    def step(model: nn.Module) -> None:
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        model(x).float().pow(2).mean().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()

    fsdp1 = FullyShardedDataParallel(
        build(),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        device_id=torch.device("cpu"),
    )
    step(fsdp1)
    with FullyShardedDataParallel.summon_full_params(fsdp1, writeback=False):
        expected = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in fsdp1.named_parameters()}
    fsdp2 = build()
    for module in (fsdp2[0], fsdp2[2], fsdp2):
        fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    step(fsdp2)
    fsdp2(torch.randn(2, 4))  # the root stays unsharded after a forward without backward
    with full_params(fsdp2, writeback=False):
        got = {n: p.detach().clone() for n, p in fsdp2.named_parameters()}
    with full_params(fsdp2, rank0_only=True, offload_to_cpu=True, writeback=False):
        rank0_only = {type(p).__name__ for p in fsdp2.parameters()}
    with full_params(fsdp2, writeback=False):
        fsdp2[0].weight.data.add_(1)  # discarded, as FSDP1 discards it
    raised = ""
    try:
        with full_params(fsdp2):
            fsdp2[2].bias.data.zero_()  # FSDP1 would have written this back; FSDP2 cannot
    except RuntimeError as error:
        raised = str(error)
    after = {n: cast(DTensor, p).full_tensor() for n, p in fsdp2.named_parameters()}
    return {
        "names": (sorted(expected), sorted(got)),
        "equal": all(torch.equal(expected[n], got[n]) for n in expected),
        "dtypes": {p.dtype for p in got.values()},
        "rank0_only": rank0_only,
        "sharded after": all(isinstance(p, DTensor) for p in fsdp2.parameters()),
        "unchanged": all(torch.equal(after[n], got[n]) for n in got),
        "raised": raised,
    }


def test_full_params_shows_what_fsdp1_summon_shows(ranks: Any) -> None:
    for rank, seen in enumerate(ranks(_full_params_as_fsdp1, 2)):
        assert seen["names"][0] == seen["names"][1]
        assert seen["equal"] and seen["dtypes"] == {torch.float32}  # full precision, as FSDP1's, not bf16
        assert seen["rank0_only"] == ({"Parameter"} if rank == 0 else {"DTensor"})
        assert seen["sharded after"] and seen["unchanged"]
        assert "changed inside the block" in seen["raised"]


_UNMAPPABLE = """
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, StateDictType

def run(net, optim, options):
    model = FSDP(net, *options)  # <- arguments not in the text
    other = FSDP(net.head, process_group=net.group, sharding_strategy=ShardingStrategy.NO_SHARD)  # <- group
    with FSDP.summon_full_params(model, writeback=True):  # <- summon
        model.weight.zero_()
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):  # <- local
        state = model.state_dict()
    flat = model._flat_param  # <- private
    full = FSDP.full_optim_state_dict(model, optim, group=net.group)  # <- legacy optim over a group
    return state, flat, full
"""


def test_unmappable_constructs_are_reported_and_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = migrate_source(_UNMAPPABLE)
    marked = {
        number: line.split("# <- ")[1]
        for number, line in enumerate(_UNMAPPABLE.splitlines(), start=1)
        if "# <- " in line
    }
    assert {f.line for f in result.findings} == set(marked), [f.format("x.py") for f in result.findings]
    for line in _UNMAPPABLE.splitlines():  # every unmapped line is still there, word for word
        if "# <- " in line:
            assert line in result.migrated
    path = tmp_path / "prog.py"
    path.write_text(_UNMAPPABLE)
    assert cli_main(["migrate", str(path)]) == 1
    err = capsys.readouterr().err
    for number in marked:
        assert re.search(rf"^{re.escape(str(path))}:{number}: .+: .+; fix: .+", err, re.M), err
    assert cli_main(["migrate", str(path), "--write"]) == 1  # written, yet not fully migrated
    assert "FSDP.summon_full_params" in path.read_text()


def _inner_module(fsdp1_source: str, migrated_source: str) -> list[tuple[bool, list[str]]]:
    """On a rank: what `model.module` is (an nn.Sequential? its children) in the FSDP1 program and the migrated one."""
    seen = []
    for source in (fsdp1_source, migrated_source):
        scope: dict[str, Any] = {}
        exec(compile(source, "program.py", "exec"), scope)
        inner = scope["inner"]()
        seen.append((isinstance(inner, nn.Sequential), [name for name, _ in inner.named_children()]))
    return seen


def test_the_wrapped_module_is_the_model_itself(ranks: Any) -> None:
    """FSDP1's `model.module` is the module it wraps; under FSDP2 that is the model itself."""
    source = _MODEL.replace("POLICY", "None") + "\n\ndef inner():\n    model = build()\n    return model.module\n"
    result = migrate_source(source)
    assert result.findings == [], result.findings
    assert "return model\n" in result.migrated and "model.module" not in result.migrated
    fsdp1, fsdp2 = ranks(_inner_module, 2, source, result.migrated)[0]
    assert fsdp1 == fsdp2 == (True, ["0", "1", "2", "3"])


def test_check_write_and_idempotence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = tmp_path / "pkg" / "train.py"
    program.parent.mkdir()
    program.write_text((CORPUS / "readme_style.py").read_text())
    assert cli_main(["migrate", str(tmp_path), "--check"]) == 1  # would change
    assert cli_main(["migrate", str(tmp_path)]) == 0  # a diff, and nothing left to a person
    diff = capsys.readouterr().out
    assert diff.startswith("--- a/") and "+    fully_shard(model)" in diff
    assert cli_main(["migrate", str(program), "--write"]) == 0
    migrated = program.read_text()
    assert cli_main(["migrate", str(tmp_path), "--check"]) == 0
    assert migrate_source(migrated).migrated == migrated
    assert "# torch's FSDP1 needs device_id on the CPU" in migrated  # comments are kept
    assert cli_main(["migrate", str(tmp_path / "missing.py")]) == 2
