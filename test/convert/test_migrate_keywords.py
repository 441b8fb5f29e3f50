"""`fsdp-legacy migrate` on constructions whose keywords are only known at run time, as real code writes them
(`sharding_strategy=cfg.sharding_strategy`, `mixed_precision=mp_policy()`, `cpu_offload=CPUOffload(offload_params=
cfg.offload)`, `sync_module_states=cfg.low_cpu`): they become `apply_fully_shard(..., **fsdp1_options(...))`, which
maps the values at run time as FSDP1 applied them. The oracle is torch's FSDP1 running the original program beside
the migrated one at 2 ranks: the same losses, the strategy honoured (what stays unsharded after forward), the
buffers in FSDP1's dtype; a value FSDP2 cannot be given raises on every rank, naming it."""

from __future__ import annotations

import ast
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

pytest.importorskip("libcst")

from test_migrate import _fsdp1_names

from fsdp_legacy.migrate.rewriter import migrate_source

_PROGRAM = """
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

STRATEGIES = {"full": ShardingStrategy.FULL_SHARD, "grad": ShardingStrategy.SHARD_GRAD_OP}  # a config's choices


class Config:
    def __init__(self, **values):
        self.sharding_strategy = ShardingStrategy.FULL_SHARD  # a default, compared below
        self.__dict__.update(values)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
        self.register_buffer("scale", torch.full((width,), 1.0 / 3))

    def forward(self, x):
        return self.inner(x.to(self.inner[0].weight.dtype)) * self.scale


def mp_policy(cfg):
    if cfg.dtype is None:
        return None
    return MixedPrecision(param_dtype=cfg.dtype, reduce_dtype=cfg.dtype, buffer_dtype=cfg.dtype)


def strategy_of(cfg):
    return getattr(ShardingStrategy, cfg.name)


def build(cfg):
    torch.manual_seed(0)
    net = nn.Sequential(Block(8), Block(8), nn.Linear(8, 8))
    model = FSDP(
        net,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=STRATEGY,
        mixed_precision=mp_policy(cfg),
        cpu_offload=CPUOffload(offload_params=cfg.offload),
        device_id=torch.device("cpu"),
        limit_all_gathers=True,
        sync_module_states=cfg.sync,
    )
    return model, cfg.sharding_strategy == ShardingStrategy.SHARD_GRAD_OP
"""

_SOURCES = {
    "a dict": "STRATEGIES[cfg.key]",
    "a config attribute": "cfg.sharding_strategy",
    "a function": "strategy_of(cfg)",
}


def _program(where: str) -> str:
    return _PROGRAM.replace("STRATEGY,", _SOURCES[where] + ",")


def test_the_construction_becomes_apply_fully_shard_with_fsdp1_options() -> None:
    result = migrate_source(_program("a config attribute"))
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert _fsdp1_names(ast.parse(out)) == set()  # no torch FSDP1 name left: the values come from fsdp_legacy
    assert "from fsdp_legacy import CPUOffload, MixedPrecision, ShardingStrategy\n" in out
    assert "from fsdp_legacy.wrap import ModuleWrapPolicy\n" in out
    assert (
        "fsdp_kwargs = fsdp1_options(sharding_strategy=cfg.sharding_strategy, mixed_precision=mp_policy(cfg), "
        "cpu_offload=CPUOffload(offload_params=cfg.offload))"
    ) in out
    assert "apply_fully_shard(net, ModuleWrapPolicy({Block}), sync_module_states=cfg.sync, **fsdp_kwargs)" in out
    # what fsdp1_options reads stays FSDP1's (FSDP2's MixedPrecisionPolicy has no buffer_dtype), unreported
    assert "return MixedPrecision(param_dtype=cfg.dtype, reduce_dtype=cfg.dtype, buffer_dtype=cfg.dtype)" in out
    assert "STRATEGIES = {" in out and "== ShardingStrategy.SHARD_GRAD_OP" in out  # enum values as data
    assert 'device_id=torch.device("cpu") dropped' in out and "limit_all_gathers=True dropped" in out


_BRANCHES = """
import functools
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, CPUOffload, MixedPrecision
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy, transformer_auto_wrap_policy


def get_fsdp_model(args, model, block):
    if args.mixed_precision:
        mixed_precision = MixedPrecision(
            param_dtype=torch.float32, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
        )
    else:
        mixed_precision = None
    if args.use_lora:
        wrap_policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m.weight.requires_grad)
    else:
        wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=mixed_precision,
        cpu_offload=CPUOffload(offload_params=args.cpu_offload),
    )
    return model
"""


def test_a_migrated_file_reading_fsdp1_values_at_run_time_is_migrated_again_to_itself() -> None:
    """fingertap/llama_fsdp's and prismatic's shape: the policy and the precision bound on each branch, the offload
    computed. The migrated file keeps them as FSDP1's (fsdp1_options and apply_fully_shard read them at run time); a
    second run read them as left-over FSDP1 objects and reported them (a MixedPrecision without a cast, the policies
    left in place), where a migrated file must come back as it is, with nothing to say."""
    first = migrate_source(_BRANCHES)
    assert first.findings == [], [f.format("x.py") for f in first.findings]
    assert "apply_fully_shard(model, wrap_policy, **fsdp_kwargs)" in first.migrated
    again = migrate_source(first.migrated)
    assert (again.migrated, again.findings) == (first.migrated, [])


def test_a_policy_read_by_a_construction_stays_fsdp1s_only_then() -> None:
    """Without a construction reading it at run time, a MixedPrecision with a buffer_dtype nothing casts for is
    reported, as before."""
    source = _program("a dict").replace("mixed_precision=mp_policy(cfg)", "mixed_precision=None")
    result = migrate_source(source)
    assert [f.what for f in result.findings] == ["MixedPrecision(...)"], [f.format("x.py") for f in result.findings]


def test_a_literal_keyword_beside_computed_ones_is_mapped_from_the_text() -> None:
    source = _program("a dict").replace("CPUOffload(offload_params=cfg.offload)", "CPUOffload(offload_params=True)")
    out = migrate_source(source).migrated
    assert '"offload_policy": CPUOffloadPolicy(), **fsdp1_options(sharding_strategy=STRATEGIES[cfg.key]' in out


def test_manual_wrapping_with_a_computed_keyword_is_reported() -> None:
    source = """
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import enable_wrap, wrap

def build(net, cfg):
    with enable_wrap(wrapper_cls=FSDP, sharding_strategy=cfg.sharding_strategy):
        return wrap(net)
"""
    result = migrate_source(source)
    assert result.migrated == source
    assert any("known only at run time" in f.what for f in result.findings), [f.format("x") for f in result.findings]


# -- side by side: torch's FSDP1 on the original, FSDP2 on the migrated program -----------------------------------


def _side_by_side(
    original: str, migrated: str, values: dict[str, Any], steps: int = 3, fsdp1_values: dict[str, Any] | None = None
) -> dict[str, Any]:
    """On a rank: both programs built from the same Config and trained the same steps (SGD, different data per rank):
    their losses, FSDP1's strategy, which FSDP2 parameters stay unsharded after a forward, both models' buffer
    dtypes, and FSDP2's offload policies (`fsdp1_values`: what differs in the Config FSDP1 gets)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    def train(model: nn.Module) -> list[float]:
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        seen = []
        for step in range(steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            loss = model(x).float().pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            seen.append(loss.item())
        return seen

    programs = []
    for name, source in (("fsdp1.py", original), ("fsdp2.py", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, name, "exec"), namespace)
        programs.append(namespace)
    built = []
    for namespace, given in zip(programs, ({**values, **(fsdp1_values or {})}, values), strict=True):
        # a config attribute holds the program's own enum member (torch's, fsdp_legacy's)
        own = {k: namespace["ShardingStrategy"][v] if k == "sharding_strategy" else v for k, v in given.items()}
        built.append(namespace["build"](namespace["Config"](**own)))
    (fsdp1, grad_op1), (fsdp2, grad_op2) = built
    fsdp2(torch.randn(2, 8)).sum()  # forward only: SHARD_GRAD_OP keeps the units' parameters unsharded
    kept = sorted({name.split(".")[0] for name, p in fsdp2.named_parameters() if not isinstance(p, DTensor)})
    for module in fsdp2.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    offloaded = {  # (FSDP2's own record of its policy: its state is private)
        type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__  # type: ignore[operator, union-attr]
        for m in fsdp2.modules()
        if isinstance(m, FSDPModule)
    }
    return {
        "strategy": {m.sharding_strategy.name for m in fsdp1.modules() if isinstance(m, FullyShardedDataParallel)},
        "compared": (grad_op1, grad_op2),
        "kept": kept,
        "offloaded": offloaded,
        "losses": (train(fsdp1), train(fsdp2)),
        # (after training: FSDP1 casts its buffers at its first forward)
        "buffers": ({str(b.dtype) for b in fsdp1.buffers()}, {str(b.dtype) for b in fsdp2.buffers()}),
    }


_BASE = {"dtype": None, "offload": False, "sync": False}


@pytest.mark.parametrize("where", list(_SOURCES))
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_a_computed_strategy_trains_as_fsdp1(ranks: Any, where: str, strategy: str) -> None:
    original = _program(where)
    migrated = migrate_source(original).migrated
    values = {**_BASE, "key": {"FULL_SHARD": "full", "SHARD_GRAD_OP": "grad"}[strategy], "name": strategy}
    values["sharding_strategy"] = strategy
    for seen in ranks(_side_by_side, 2, original, migrated, values):
        assert seen["strategy"] == {strategy}
        assert seen["compared"] == ((strategy == "SHARD_GRAD_OP"),) * 2
        # the root keeps its own parameters after forward in both; SHARD_GRAD_OP the Blocks' too
        assert seen["kept"] == (["0", "1", "2"] if strategy == "SHARD_GRAD_OP" else ["2"])
        fsdp1, fsdp2 = seen["losses"]
        assert fsdp2 == pytest.approx(fsdp1, rel=1e-6, abs=0)


def test_a_computed_mixed_precision_casts_the_buffers_as_fsdp1(ranks: Any) -> None:
    original = _program("a dict")
    migrated = migrate_source(original).migrated
    values = {**_BASE, "key": "full", "dtype": torch.bfloat16}
    for seen in ranks(_side_by_side, 2, original, migrated, values):
        assert seen["buffers"] == ({"torch.bfloat16"}, {"torch.bfloat16"})  # FSDP2 alone keeps them fp32
        fsdp1, fsdp2 = seen["losses"]
        torch.testing.assert_close(fsdp2, fsdp1, rtol=1e-3, atol=0)  # bf16 (test_migrate_corpus.BF16_RTOL)


@pytest.mark.parametrize("offload", [False, True])
def test_a_computed_cpu_offload_trains_as_fsdp1(ranks: Any, offload: bool) -> None:
    """torch's FSDP1 pins its offloaded shards, which fails without an accelerator: with offload_params=True its
    oracle here is the same program without offloading (offloading moves no value)."""
    original = _program("a function")
    migrated = migrate_source(original).migrated
    values = {**_BASE, "name": "FULL_SHARD", "offload": offload}
    for seen in ranks(_side_by_side, 2, original, migrated, values, fsdp1_values={"offload": False}):
        assert seen["offloaded"] == {"CPUOffloadPolicy" if offload else "OffloadPolicy"}
        fsdp1, fsdp2 = seen["losses"]
        assert fsdp2 == pytest.approx(fsdp1, rel=1e-6, abs=0)


def test_no_shard_computed_trains_as_fsdp1(ranks: Any) -> None:
    """NO_SHARD, mapped as the literal is: a mesh that replicates on every rank (shard dimension 1)."""
    original = _program("a function")
    migrated = migrate_source(original).migrated
    for seen in ranks(_side_by_side, 2, original, migrated, {**_BASE, "name": "NO_SHARD"}):
        assert seen["strategy"] == {"NO_SHARD"}
        fsdp1, fsdp2 = seen["losses"]
        assert fsdp2 == pytest.approx(fsdp1, rel=1e-6, abs=0)


# -- fsdp1_options: the values, and what it refuses ---------------------------------------------------------------


def test_strategy_names() -> None:
    import torch.distributed.fsdp as torch_fsdp

    import fsdp_legacy
    from fsdp_legacy.migrate.keywords_runtime import strategy_name

    assert strategy_name(None) == "FULL_SHARD"  # FSDP1's default
    assert strategy_name(torch_fsdp.ShardingStrategy.SHARD_GRAD_OP) == "SHARD_GRAD_OP"
    assert strategy_name(fsdp_legacy.ShardingStrategy.HYBRID_SHARD) == "HYBRID_SHARD"
    assert strategy_name("ShardingStrategy.NO_SHARD") == strategy_name("no_shard") == "NO_SHARD"
    with pytest.raises(ValueError, match=r"sharding_strategy='FULL' is not a ShardingStrategy.*ShardingStrategy\."):
        strategy_name("FULL")


def test_precision_and_offload_values() -> None:
    import torch.distributed.fsdp as torch_fsdp

    import fsdp_legacy
    from fsdp_legacy.migrate.keywords_runtime import _offload, _precision

    for mp in (torch_fsdp.MixedPrecision, fsdp_legacy.MixedPrecision):
        got = _precision(mp(param_dtype=torch.bfloat16, buffer_dtype=torch.float16, cast_forward_inputs=True))
        assert got["mp_policy"] == torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        assert got["buffer_dtype"] == torch.float16
        with pytest.raises(ValueError, match="keep_low_precision_grads=True has no FSDP2 counterpart"):
            _precision(mp(param_dtype=torch.bfloat16, keep_low_precision_grads=True))
    policy = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.float16)
    assert _precision(policy) == {"mp_policy": policy} and _precision(None) == {}
    with pytest.raises(ValueError, match="mixed_precision=torch.bfloat16 is neither"):
        _precision(torch.bfloat16)
    for offload in (torch_fsdp.CPUOffload, fsdp_legacy.CPUOffload):
        assert isinstance(_offload(offload(offload_params=True))["offload_policy"], torch_fsdp.CPUOffloadPolicy)
        assert _offload(offload(offload_params=False)) == {} == _offload(None)
    with pytest.raises(ValueError, match="cpu_offload=True is neither"):
        _offload(True)


def _refused(case: str) -> dict[str, Any]:
    """On a rank: what fsdp1_options raises for `case`, and what it builds for a hybrid mesh with LOCAL_WORLD_SIZE."""
    from fsdp_legacy import ShardingStrategy
    from fsdp_legacy.migrate.runtime import fsdp1_options

    saved = os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        if case == "hybrid, LOCAL_WORLD_SIZE=2":
            os.environ["LOCAL_WORLD_SIZE"] = "2"
            mesh = fsdp1_options(ShardingStrategy._HYBRID_SHARD_ZERO2)
            return {"layout": (tuple(mesh["mesh"].shape), mesh["mesh"].mesh_dim_names), **mesh}
        given = {
            "hybrid without LOCAL_WORLD_SIZE": {"sharding_strategy": ShardingStrategy.HYBRID_SHARD},
            "no_shard with a group": {"sharding_strategy": "NO_SHARD", "process_group": dist.group.WORLD},
            "hybrid with one group": {"sharding_strategy": "HYBRID_SHARD", "process_group": dist.group.WORLD},
            "full_shard with a pair": {"process_group": (dist.group.WORLD, dist.group.WORLD)},
        }[case]
        fsdp1_options(**given)
    except ValueError as error:
        return {"raised": str(error)}
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    return {}


_REFUSED = {
    "hybrid without LOCAL_WORLD_SIZE": "sharding_strategy=HYBRID_SHARD without process_group or device_mesh",
    "no_shard with a group": "sharding_strategy=NO_SHARD with a process_group",
    "hybrid with one group": "HYBRID_SHARD's process_group must be the pair (intra_node_group, inter_node_group)",
    "full_shard with a pair": "sharding_strategy=FULL_SHARD with process_group=tuple: FSDP1 takes a pair",
}


@pytest.mark.parametrize("case", list(_REFUSED))
def test_a_value_fsdp2_cannot_take_raises_on_every_rank(ranks: Any, case: str) -> None:
    seen = ranks(_refused, 2, case)
    assert seen[0] == seen[1] and _REFUSED[case] in seen[0].get("raised", ""), seen


def _build_hybrid(source: str) -> str:
    """On a rank: the migrated program built with HYBRID_SHARD outside torchrun (no LOCAL_WORLD_SIZE)."""
    namespace: dict[str, Any] = {}
    exec(compile(source, "fsdp2.py", "exec"), namespace)
    saved = os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        namespace["build"](namespace["Config"](**_BASE, name="HYBRID_SHARD"))
    except ValueError as error:
        return str(error)
    finally:
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    return "built"


def test_a_migrated_program_given_such_a_value_raises_naming_it(ranks: Any) -> None:
    migrated = migrate_source(_program("a function")).migrated
    for message in ranks(_build_hybrid, 2, migrated):
        assert "sharding_strategy=HYBRID_SHARD" in message and "launch with torchrun" in message


def test_a_hybrid_strategy_over_local_world_size(ranks: Any) -> None:
    for seen in ranks(_refused, 2, "hybrid, LOCAL_WORLD_SIZE=2"):
        assert seen["layout"] == ((1, 2), ("replicate", "shard")) and seen["reshard_after_forward"] is False


# -- ShardingStrategy / StateDictType values used as data ---------------------------------------------------------

_CONFIG = """
from dataclasses import dataclass

from torch.distributed.fsdp import ShardingStrategy, StateDictType


@dataclass
class TrainConfig:
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    checkpoint_type: StateDictType = StateDictType.SHARDED_STATE_DICT


def full_checkpoint(cfg):
    return cfg.checkpoint_type == StateDictType.FULL_STATE_DICT
"""


def test_enum_values_as_data_are_plain_values() -> None:
    """A config's defaults and comparisons: nothing to migrate, nothing reported, the file as it is."""
    result = migrate_source(_CONFIG)
    assert (result.migrated, result.findings) == (_CONFIG, [])


def test_in_a_migrated_file_they_come_from_fsdp_legacy_and_equal_torchs() -> None:
    source = (
        _CONFIG.replace(
            "from torch.distributed.fsdp import ShardingStrategy, StateDictType",
            "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, StateDictType",
        )
        + "\n\ndef build(net, cfg):\n    model = FSDP(net, sharding_strategy=cfg.sharding_strategy)\n    return model\n"
    )
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    assert "from fsdp_legacy import ShardingStrategy, StateDictType\n" in result.migrated
    assert "torch.distributed.fsdp import" not in result.migrated
    namespace: dict[str, Any] = {}
    exec(compile(result.migrated, "config.py", "exec"), namespace)
    import torch.distributed.fsdp as torch_fsdp

    cfg = namespace["TrainConfig"](checkpoint_type=torch_fsdp.StateDictType.FULL_STATE_DICT)  # set by another file
    assert namespace["full_checkpoint"](cfg) and cfg.sharding_strategy == torch_fsdp.ShardingStrategy.FULL_SHARD
