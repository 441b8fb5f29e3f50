"""`fsdp-legacy migrate` and FSDP1's `apply`: `model.apply(fn)` on a wrapped model and `FSDP.apply(model, fn)` become
`apply_full(model, fn)` (fsdp_legacy.migrate.runtime), which must leave the parameters torch's FSDP1 apply leaves:
on a rank pool, torch's FSDP1 vs fully_shard + apply_full, bit for bit, uneven and empty shards and a 2-D
(replicate, shard) mesh included. The corpus program readme_style.py applies an init after wrapping, end to end."""

from __future__ import annotations

import math
import textwrap
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

pytest.importorskip("libcst")

from fsdp_legacy.migrate.rewriter import migrate_source

# -- apply_full against torch's FSDP1 apply ---------------------------------------------------------------------------


def _build() -> nn.Sequential:
    """Sizes that shard unevenly on 2 ranks (7 rows: 4 + 3; 3 rows: 2 + 1) and leave rank 1 empty (1 row), a
    BatchNorm (a buffer) in the root unit."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Sequential(nn.Linear(7, 3), nn.Linear(3, 1)))


def _init(m: nn.Module) -> None:
    """A seeded init as programs write it: nn.init, fill_ on a bias, in-place edits through .data, a buffer."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.5)
        m.bias.data.fill_(0.1)
    elif isinstance(m, nn.BatchNorm1d):
        m.weight.data.copy_(torch.linspace(0.5, 2.0, m.num_features))
        m.bias.data.uniform_(-1, 1)
        m.running_mean.fill_(0.25)


def _assigns(m: nn.Module) -> None:
    """`.data =` on one parameter: torch's FSDP1 drops it without a word."""
    _init(m)
    if isinstance(m, nn.Linear) and m.out_features == 3:
        m.weight.data = m.weight.data * 2


def _step(model: nn.Module) -> None:
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).pow(2).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def _fsdp1(mesh_shape: tuple[int, ...], fn: Any) -> dict[str, torch.Tensor]:
    """torch's FSDP1 (FULL_SHARD, or HYBRID_SHARD on a 2-D mesh), `model.apply(fn)`, then one step: the full
    parameters after the apply and after the step, and the buffer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    hybrid: dict[str, Any] = {}
    if len(mesh_shape) == 2:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        hybrid = {"sharding_strategy": ShardingStrategy.HYBRID_SHARD, "device_mesh": mesh}
    policy = ModuleWrapPolicy({nn.Linear})
    model = FullyShardedDataParallel(_build(), auto_wrap_policy=policy, device_id=torch.device("cpu"), **hybrid)
    model(torch.randn(2, 5))  # a forward before the apply, as a program may do
    torch.manual_seed(1)
    model.apply(fn)

    def full(tag: str) -> dict[str, torch.Tensor]:
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {f"{tag}:{n.replace('_fsdp_wrapped_module.', '')}": p.clone() for n, p in model.named_parameters()}

    seen = full("applied")
    _step(model)
    return seen | full("stepped") | {"running_mean": model.module[1].running_mean.clone()}


def _fsdp2(mesh_shape: tuple[int, ...], fn: Any, apply: str) -> dict[str, torch.Tensor]:
    """The same on fully_shard units, with `apply_full(model, fn)` (or nn.Module.apply: `apply="module"`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from fsdp_legacy.migrate.runtime import apply_full

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = _build()
    for module in (model[0], model[3][0], model[3][1], model):
        fully_shard(module, mesh=mesh)
    before = [id(p) for p in model.parameters()]
    model(torch.randn(2, 5))  # the root stays unsharded after a forward without backward
    torch.manual_seed(1)
    if apply == "full":
        assert apply_full(model, fn) is model
        assert [id(p) for p in model.parameters()] == before  # the optimizer's parameters, sharded
    else:
        model.apply(fn)
        model.reshard()
    seen = {f"applied:{n}": cast(DTensor, p).full_tensor() for n, p in model.named_parameters()}
    _step(model)
    seen |= {f"stepped:{n}": cast(DTensor, p).full_tensor() for n, p in model.named_parameters()}
    return seen | {"running_mean": cast(torch.Tensor, model[1].running_mean).clone()}


def _apply_side_by_side(mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """On a rank: which parameters of the FSDP2 model equal torch's FSDP1's, with apply_full and with
    nn.Module.apply, and the plain model's for comparison."""
    plain = _build()
    torch.manual_seed(1)
    expected = {f"applied:{n}": p for n, p in plain.apply(_init).named_parameters()}
    fsdp1 = _fsdp1(mesh_shape, _init)
    full = _fsdp2(mesh_shape, _init, "full")
    try:
        module = _fsdp2(mesh_shape, _init, "module")
        on_shards = sorted(n for n in fsdp1 if not torch.equal(fsdp1[n], module[n]))
    except RuntimeError as error:  # a plain tensor copied into a DTensor shard, on some torch releases
        on_shards = [f"raised: {error}"]
    return {
        "plain": all(torch.equal(expected[n], fsdp1[n]) for n in expected),
        "names": sorted(fsdp1) == sorted(full),
        "apply_full": sorted(n for n in fsdp1 if not torch.equal(fsdp1[n], full[n])),
        "nn.Module.apply": on_shards,
    }


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2 ranks", "2-D mesh on 4 ranks"])
def test_apply_full_leaves_what_fsdp1_apply_leaves(ranks: Any, mesh_shape: tuple[int, ...]) -> None:
    """A seeded init after wrapping: FSDP1 gathers the full parameters around fn, so the values are the plain
    model's; apply_full gives FSDP1's bit for bit (after the apply, and after a step on the written shards), where
    nn.Module.apply on the DTensor shards draws other values."""
    for seen in ranks(_apply_side_by_side, math.prod(mesh_shape), mesh_shape):
        assert seen["plain"] and seen["names"]
        assert seen["apply_full"] == []
        assert any(n.endswith("0.weight") for n in seen["nn.Module.apply"]), seen["nn.Module.apply"]


def _replacements() -> dict[str, Any]:
    """On a rank: what FSDP1 does with `.data =` in apply (drops it), and apply_full's refusal of it, of a new
    Parameter and of a change made on rank 0 only; the parameters after the refusal."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from fsdp_legacy.migrate.runtime import apply_full

    plain = _build()
    torch.manual_seed(1)
    without = {f"applied:{n}": p for n, p in plain.apply(_init).named_parameters()}
    fsdp1 = _fsdp1((2,), _assigns)
    dropped = all(torch.equal(without[n], fsdp1[n]) for n in without)

    def new_parameter(m: nn.Module) -> None:
        if isinstance(m, nn.Linear) and m.out_features == 1:
            m.bias = nn.Parameter(torch.zeros(1))

    def on_rank0(m: nn.Module) -> None:
        if isinstance(m, nn.BatchNorm1d) and dist.get_rank() == 0:
            m.weight.data = torch.ones(3)

    raised = {}
    model = _build()
    for module in (model[0], model[3][0], model[3][1], model):
        fully_shard(module)
    kept = {n: cast(DTensor, p).full_tensor() for n, p in model.named_parameters()}
    for name, fn in (("data", _assigns), ("parameter", new_parameter), ("rank 0", on_rank0)):
        torch.manual_seed(1)
        try:
            apply_full(model, fn)
        except RuntimeError as error:
            raised[name] = str(error)
        after = {n: cast(DTensor, p).full_tensor() for n, p in model.named_parameters()}
        assert all(isinstance(p, DTensor) for p in model.parameters())
        kept = {n: v for n, v in kept.items() if torch.equal(v, after[n])}  # what no apply has written yet
    return {"dropped": dropped, "raised": raised, "kept": sorted(kept)}


def test_apply_full_refuses_what_fsdp1_dropped(ranks: Any) -> None:
    """torch's FSDP1 apply keeps only in-place changes: a `.data =` assignment, a new Parameter, a new shape are
    dropped silently. nn.Module.apply would keep them, so apply_full cannot be both: it fails on every rank of the
    unit (also when only one rank did it), naming the parameter, before writing anything of that unit back."""
    for rank, seen in enumerate(ranks(_replacements, 2)):
        assert seen["dropped"]
        assert "3.0.weight (`.data` assigned)" in seen["raised"]["data"]
        assert "3.1.bias (replaced by another object)" in seen["raised"]["parameter"]
        assert ("1.weight (shape changed from (7,) to (3,))" if rank == 0 else "on another rank") in seen["raised"][
            "rank 0"
        ]
        for message in seen["raised"].values():
            assert "in place" in message and "FSDP1" in message
        # the units refused are left as they were; the nested units before them were written back
        assert {"3.0.weight", "3.0.bias", "3.1.weight", "3.1.bias", "1.weight", "1.bias"} <= set(seen["kept"])
        assert "0.weight" not in seen["kept"]


# -- the rewrite ----------------------------------------------------------------------------------------------------

_PROGRAM = """
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def init_weights(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)


def build(net, head):
    head.apply(init_weights)  # a module the file does not wrap: nn.Module.apply
    model = FSDP(net)
    model.apply(init_weights)
    model = model.apply(fn=init_weights)
    FSDP.apply(model, init_weights)
    return model, head.apply(init_weights)
"""

_LEFT = {
    "star args": ("model.apply(*fns)", "`model.apply(*args/**kwargs)`"),
    "unbound star args": ("FSDP.apply(model, *fns)", "`FSDP.apply(...)` with its arguments not written out"),
    "the wrapped module": ("model.module.apply(init_weights)", "`model.module.apply(...)` on the module FSDP1 wraps"),
    "as a value": ("later = model.apply", "`model.apply` used as a value"),
}


def test_apply_on_the_wrapped_model_becomes_apply_full() -> None:
    result = migrate_source(_PROGRAM)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert "from fsdp_legacy.migrate.runtime import apply_full\n" in out
    assert "FullyShardedDataParallel" not in out and "FSDP." not in out
    body = textwrap.dedent(out[out.index("    model = net\n") :])
    assert body.splitlines()[1:4] == [
        "apply_full(model, init_weights)",
        "model = apply_full(model, fn=init_weights)",
        "apply_full(model, init_weights)",
    ]
    assert out.count("head.apply(init_weights)") == 2  # nn.Module.apply on other modules: untouched


@pytest.mark.parametrize(("line", "what"), _LEFT.values(), ids=list(_LEFT))
def test_apply_it_cannot_map_is_reported_and_kept(line: str, what: str) -> None:
    source = _PROGRAM.replace("def build(net, head):", "def build(net, head, fns):").replace(
        "    return model,", f"    {line}\n    return model,"
    )
    result = migrate_source(source)
    number = source.splitlines().index(f"    {line}") + 1
    assert [(f.line, f.what.startswith(what)) for f in result.findings] == [(number, True)], result.findings
    assert "apply_full(model, fn)" in result.findings[0].fix
    assert f"    {line}\n" in result.migrated  # left as written
