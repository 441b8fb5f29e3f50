"""`fsdp-legacy migrate` on which modules are units and over which ranks: manual wrapping (`enable_wrap` / `wrap`)
and hybrid sharding over a pair of process groups or a 2-D device mesh. The oracle is torch's FSDP1 building the
same model: its units and their sharding strategies, its intra- and inter-node groups, and the parameters after the
same training steps."""

from __future__ import annotations

import ast
import textwrap
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

pytest.importorskip("libcst")

from test_migrate import _BLOCK, _MODEL, _fsdp1_names, _unit_names

from fsdp_legacy.migrate.rewriter import migrate_source

_WRAP = (
    """
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.distributed.fsdp.wrap import enable_wrap, wrap


"""
    + _BLOCK
    + """

def build():
    torch.manual_seed(0)
    with enable_wrap(wrapper_cls=FSDP, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, device_id=torch.device("cpu")):
        first = wrap(Block(8), sharding_strategy=ShardingStrategy.FULL_SHARD)  # the override wins
        model = wrap(nn.Sequential(first, wrap(Block(8)), nn.Linear(8, 8)))
    return model
"""
)


def test_enable_wrap_becomes_fully_shard_calls() -> None:
    result = migrate_source(_WRAP)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert _fsdp1_names(ast.parse(out)) == set()  # no wrap, no enable_wrap
    assert 'wrap_kwargs = {"reshard_after_forward": False}' in out
    assert "first = fully_shard(Block(8))" in out  # FULL_SHARD overrides the context's SHARD_GRAD_OP
    assert (
        "fully_shard(nn.Sequential(first, fully_shard(Block(8), **wrap_kwargs), nn.Linear(8, 8)), **wrap_kwargs)" in out
    )


def _trained(fsdp1_source: str, migrated_source: str) -> dict[str, Any]:
    """On a rank: FSDP1's units and their strategies; FSDP2's units, which of their parameters stay unsharded after
    a forward (reshard_after_forward=False), and both programs' losses over three SGD steps."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    def losses(model: nn.Module) -> list[float]:
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            seen.append(loss.item())
        return seen

    before: dict[str, Any] = {}
    exec(compile(fsdp1_source, "fsdp1.py", "exec"), before)
    wrapped = before["build"]()
    strategies = {
        name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "").rstrip("."): m.sharding_strategy
        for name, m in wrapped.named_modules()
        if isinstance(m, FullyShardedDataParallel)
    }
    after: dict[str, Any] = {}
    exec(compile(migrated_source, "fsdp2.py", "exec"), after)
    sharded = after["build"]()
    units = sorted(name for name, m in sharded.named_modules() if isinstance(m, FSDPModule))
    sharded(torch.randn(2, 8)).sum()  # forward only: which units keep their parameters unsharded
    kept = {name for name, p in sharded.named_parameters() if not isinstance(p, DTensor)}
    for module in sharded.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return {
        "fsdp1": {name: strategy.name for name, strategy in strategies.items()},
        "fsdp2": units,
        "kept": kept,
        "losses": (losses(wrapped), losses(sharded)),
    }


def test_wrapped_units_are_fsdp1s(ranks: Any) -> None:
    for seen in ranks(_trained, 2, _WRAP, migrate_source(_WRAP).migrated):
        assert sorted(seen["fsdp1"]) == seen["fsdp2"] == ["", "0", "1"]
        assert seen["fsdp1"] == {"": "SHARD_GRAD_OP", "0": "FULL_SHARD", "1": "SHARD_GRAD_OP"}
        # SHARD_GRAD_OP keeps a unit unsharded after forward (FSDP2's reshard_after_forward=False); the root
        # keeps its own in both
        assert {name.split(".")[0] for name in seen["kept"]} == {"1", "2"}
        fsdp1, fsdp2 = seen["losses"]
        assert fsdp2 == pytest.approx(fsdp1, rel=1e-6, abs=0)


def test_wrap_keywords_map_as_fsdp_keywords() -> None:
    source = textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, CPUOffload
        from torch.distributed.fsdp.wrap import enable_wrap, wrap

        def build(net, group):
            with enable_wrap(wrapper_cls=FSDP, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
                             cpu_offload=CPUOffload(offload_params=True), process_group=group, use_orig_params=True):
                return wrap(net)
        """
    )
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert "wrap_mesh = DeviceMesh.from_group(group," in out
    assert (
        'wrap_kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16), '
        '"offload_policy": CPUOffloadPolicy(), "mesh": wrap_mesh}'
    ) in out
    assert (
        "return fully_shard(net, **wrap_kwargs)" in out and "# fsdp-legacy migrate: use_orig_params=True dropped" in out
    )


_REFUSED = {
    "wrap outside the block": "layer = wrap(net)\nwith enable_wrap(wrapper_cls=FSDP):\n    model = wrap(net)",
    "wrap in a function of the block": "with enable_wrap(wrapper_cls=FSDP):\n    make = lambda: wrap(net)",
    "wrap passed on": "with enable_wrap(wrapper_cls=FSDP):\n    model = build(wrap, net)",
    "another wrapper class": "with enable_wrap(wrapper_cls=Other):\n    model = wrap(net)",
    "a policy in the context": "with enable_wrap(wrapper_cls=FSDP, auto_wrap_policy=policy):\n    model = wrap(net)",
    "buffer_dtype": "with enable_wrap(wrapper_cls=FSDP, mixed_precision=MixedPrecision(buffer_dtype=dtype)):\n"
    "    model = wrap(net)",
    "an override with its own group": "with enable_wrap(wrapper_cls=FSDP):\n    model = wrap(net, process_group=group)",
    "nested": "with enable_wrap(wrapper_cls=FSDP):\n    with enable_wrap(wrapper_cls=FSDP):\n        model = wrap(net)",
    "per-module overrides": "net._wrap_overrides = {}\nwith enable_wrap(wrapper_cls=FSDP):\n    model = wrap(net)",
}


@pytest.mark.parametrize("body", _REFUSED.values(), ids=list(_REFUSED))
def test_manual_wrapping_it_cannot_follow_is_reported_and_kept(body: str) -> None:
    """One wrap() it cannot place inside a context leaves all of them, and every enable_wrap, as they were: taking
    the context away would turn the wrap() it left into a no-op."""
    source = textwrap.dedent(
        """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
        from torch.distributed.fsdp.wrap import enable_wrap, wrap

        def run(net, policy, group, dtype, build, Other):
        """
    ) + textwrap.indent(body + "\nreturn model", "    ")
    result = migrate_source(source)
    assert result.findings, result.migrated
    assert all(line in result.migrated for line in source.splitlines() if "wrap" in line)
    assert "fully_shard" not in result.migrated


_HYBRID = {
    "process_group pair": "sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=(intra, inter)",
    "process_group pair, ZeRO-2": "sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2, "
    "process_group=(intra, inter)",
    "device_mesh": "sharding_strategy=ShardingStrategy.HYBRID_SHARD, "
    'device_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))',
}


def _hybrid_source(keywords: str) -> str:
    """_MODEL sharded in pairs of ranks ({0, 1}, {2, 3}), replicated across them ({0, 2}, {1, 3})."""
    groups = (
        "intra = dist.new_subgroups(2)[0]\n"
        "    inter = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])[0]\n"
        "    model = FSDP("
    )
    source = _MODEL.replace("POLICY", "ModuleWrapPolicy({Block}), " + keywords)
    source = source.replace("model = FSDP(", groups, 1)
    return source.replace(
        "import torch\n",
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.fsdp import ShardingStrategy\n",
        1,
    )


def _hybrid(fsdp1_source: str, migrated_source: str) -> dict[str, Any]:
    """On a rank: FSDP1's intra- and inter-node group ranks; FSDP2's mesh (layout, dimension names, each
    dimension's group ranks, the placements); both unit lists; and whether one SGD step leaves the same parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    def step(model: nn.Module) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
        model(x).pow(2).mean().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()

    before: dict[str, Any] = {}
    exec(compile(fsdp1_source, "fsdp1.py", "exec"), before)
    wrapped = before["build"]()
    step(wrapped)
    with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False):
        fsdp1 = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in wrapped.named_parameters()}
    after: dict[str, Any] = {}
    exec(compile(migrated_source, "fsdp2.py", "exec"), after)
    sharded = after["build"]()
    meshes = {
        (
            str(p.device_mesh.mesh.tolist()),
            p.device_mesh.mesh_dim_names,
            tuple(tuple(dist.get_process_group_ranks(p.device_mesh.get_group(d))) for d in ("replicate", "shard")),
            str(p.placements),
        )
        for p in sharded.parameters()
        if isinstance(p, DTensor)
    }
    step(sharded)
    fsdp2 = {n: p.full_tensor() for n, p in sharded.named_parameters()}
    return {
        "groups": (
            dist.get_process_group_ranks(wrapped.process_group),
            dist.get_process_group_ranks(wrapped._inter_node_pg),
        ),
        "meshes": meshes,
        "units": _unit_names(fsdp1_source, migrated_source),
        "same": sorted(fsdp1) == sorted(fsdp2) and all(torch.equal(fsdp1[n], fsdp2[n]) for n in fsdp1),
    }


@pytest.mark.parametrize("keywords", _HYBRID.values(), ids=list(_HYBRID))
def test_hybrid_sharding_becomes_the_2d_mesh_of_its_groups(ranks: Any, keywords: str) -> None:
    """HYBRID_SHARD on 4 ranks: FSDP1 shards within each pair and all-reduces across pairs; the migrated units are
    FSDP1's, on a (replicate, shard) mesh whose dimensions are the same groups, and train to the same values."""
    source = _hybrid_source(keywords)
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    if "process_group" in keywords:
        assert "mesh = hybrid_mesh((intra, inter))" in result.migrated
    assert ('"reshard_after_forward": False' in result.migrated) == ("ZERO2" in keywords)
    for rank, seen in enumerate(ranks(_hybrid, 4, source, result.migrated)):
        intra, inter = seen["groups"]
        assert intra == ([0, 1] if rank < 2 else [2, 3]) and inter == [rank % 2, rank % 2 + 2]
        layout = str([[0, 1], [2, 3]])
        dims = (tuple(inter), tuple(intra))
        assert seen["meshes"] == {(layout, ("replicate", "shard"), dims, "(Replicate(), Shard(dim=0))")}
        fsdp1_units, fsdp2_units = seen["units"]
        assert len(fsdp1_units) > 1 and fsdp2_units == fsdp1_units
        assert seen["same"]


# -- a policy built by a function of the file (fsdp_qlora's get_wrapping_policy, llama-recipes' fsdp_auto_wrap_policy)

_FACTORY = """

def get_wrapping_policy():
    lambda_policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: getattr(m, 'out_features', 0) == 40)
    transformer_wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=(Block,))
    return functools.partial(_or_policy, policies=[lambda_policy, transformer_wrap_policy])
"""


def test_a_policy_built_by_a_function_of_the_file_goes_to_apply_fully_shard(ranks: Any) -> None:
    """The policies the function composes were reported as left in place (exit 1) though apply_fully_shard evaluates
    what it returns as FSDP1 does: the same units as torch's FSDP1, nothing reported."""
    source = _MODEL.replace("POLICY", "get_wrapping_policy()").replace("\n\ndef build", _FACTORY + "\n\ndef build")
    source = source.replace("transformer_auto_wrap_policy\n)", "transformer_auto_wrap_policy, _or_policy\n)")
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    assert "apply_fully_shard(model, get_wrapping_policy())" in result.migrated
    again = migrate_source(result.migrated)  # a second run over the migrated file finds nothing either
    assert (again.migrated, again.findings) == (result.migrated, [])
    fsdp1, fsdp2 = ranks(_unit_names, 2, source, result.migrated)[0]
    assert fsdp1 == ["", "0", "1", "2"] and fsdp2 == fsdp1
    # the function used otherwise too (here: called a second time): what else its policies reach is not known
    twice = source.replace("    return model\n", "    print(get_wrapping_policy())\n    return model\n")
    left = {f.what for f in migrate_source(twice).findings}
    assert left == {
        "FSDP1 API `lambda_auto_wrap_policy` left in place",
        "FSDP1 API `transformer_auto_wrap_policy` left in place",
        "FSDP1 API `_or_policy` left in place",  # (torch's private combinator, an FSDP1 policy like the others)
    }


def test_the_module_passed_by_keyword_migrates_as_by_position(ranks: Any) -> None:
    """torchtune's recipes write `FSDP(module=model, ...)`: it was left FSDP1 ("without the module as first
    argument"), keeping the whole file; it is the same construction, and the same units as torch's FSDP1."""
    positional = _MODEL.replace("POLICY", "ModuleWrapPolicy({Block})")
    keyword = positional.replace("FSDP(model, ", "FSDP(module=model, ")
    assert keyword != positional
    result = migrate_source(keyword)
    assert result.findings == [] and result.migrated == migrate_source(positional).migrated
    fsdp1, fsdp2 = ranks(_unit_names, 2, keyword, result.migrated)[0]
    assert fsdp1 == ["", "0", "1"] and fsdp2 == fsdp1


def test_the_wrap_module_imported_as_a_name_is_no_wrap_call() -> None:
    """mistral-finetune: `import torch.distributed.fsdp.wrap as torch_wrap`, its policies read as
    `torch_wrap.transformer_auto_wrap_policy` and combined with `torch_wrap._or_policy`: the module was taken for
    FSDP1's `wrap()` used as a value (manual wrapping, reported three times); the policies are apply_fully_shard's."""
    source = (
        "import functools\nimport torch.nn as nn\nimport torch.distributed.fsdp.wrap as torch_wrap\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def get_policy():\n"
        "    layers = functools.partial(torch_wrap.transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})\n"
        "    policies = [layers,\n"
        "                functools.partial(torch_wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: False)]\n"
        "    return functools.partial(torch_wrap._or_policy, policies=policies)\n\n\n"
        "def build(model):\n"
        "    return FSDP(model, auto_wrap_policy=get_policy())\n"
    )
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    assert "apply_fully_shard(model, get_policy())" in result.migrated
