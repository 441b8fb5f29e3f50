"""`fsdp-legacy migrate` on FSDP1's optimizer-state API: the legacy full_/sharded_optim_state_dict saves,
shard_full_/scatter_full_optim_state_dict loads (nested in `optim.load_state_dict(...)` or through a name), and
rekey_optim_state_dict. The oracle is torch's FSDP1 running the same program: what it saves, and how the training it
resumes goes on."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("libcst")

from test_migrate import _fsdp1_names

from fsdp_legacy.migrate.rewriter import migrate_source

_PROGRAM = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def build():
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(Block(), Block(), nn.Linear(6, 3)), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 device_id=torch.device("cpu"))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optim


def train(model, optim, steps):
    losses = []
    for step in steps:
        data = torch.Generator().manual_seed(100 * step + dist.get_rank())
        loss = model(torch.randn(4, 6, generator=data)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def save():
    model, optim = build()
    train(model, optim, range(3))
    every = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    sharded = FSDP.sharded_optim_state_dict(model, optim)
    return FSDP.full_optim_state_dict(model, optim), every, sharded


def resume(full, how):
    model, optim = build()
    if how == "shard":
        optim.load_state_dict(FSDP.shard_full_optim_state_dict(full, model, optim=optim))
    else:
        osd = full if dist.get_rank() == 0 else None
        scattered = FSDP.scatter_full_optim_state_dict(osd, model, optim=optim)
        optim.load_state_dict(scattered)
    return train(model, optim, range(3, 6))
"""


def test_legacy_calls_map_onto_dsd() -> None:
    result = migrate_source(_PROGRAM)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert _fsdp1_names(ast.parse(out)) == set()
    # rank0_only=True, FSDP1's default: rank 0's full dict on the CPU, {} elsewhere
    assert (
        "get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))"
        in out
    )
    assert "every = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))" in out
    assert "sharded = get_optimizer_state_dict(model, optim, options=StateDictOptions(cpu_offload=True))" in out
    full = "options=StateDictOptions(full_state_dict=True)"
    assert f"set_optimizer_state_dict(model, optim, unshared_optim_state(full), {full})" in out
    broadcast = "options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)"
    assert f"set_optimizer_state_dict(model, optim, unshared_optim_state(osd), {broadcast})" in out
    assert "load_state_dict" not in out and "scattered" not in out  # the load is the set_ call


def _saves_and_resumes(fsdp1_source: str, migrated_source: str, path: str) -> dict[str, Any]:
    """On a rank: what torch's FSDP1 program saves and how it goes on after loading its full optimizer state
    (scattered from rank 0, or sharded on every rank); what the migrated program saves, and how it goes on from
    FSDP1's state; and the same without unshared_optim_state (set_optimizer_state_dict as it is)."""
    from torch.distributed.tensor import DTensor

    def run(source: str) -> dict[str, Any]:
        scope: dict[str, Any] = {}
        exec(compile(source, "program.py", "exec"), scope)
        return scope

    fsdp1, fsdp2 = run(fsdp1_source), run(migrated_source)
    raw = run(migrated_source.replace("unshared_optim_state(", "("))
    full1, every1, sharded1 = fsdp1["save"]()
    full2, every2, sharded2 = fsdp2["save"]()
    if dist.get_rank() == 0:
        torch.save(full1, path)  # FSDP1's checkpoint, with its shared `step` tensors
    dist.barrier()
    saved = torch.load(path, weights_only=True)

    def local(value: Any) -> torch.Tensor:  # this rank's piece of a ShardedTensor or DTensor
        if isinstance(value, DTensor):
            return value.to_local()
        shards = value.local_shards() if hasattr(value, "local_shards") else None
        return torch.cat([s.tensor.flatten() for s in shards]).view(-1) if shards is not None else value

    return {
        "full": (full1, full2),
        "every": (every1, every2),
        "sharded": {
            key: {name: (local(v1).flatten(), local(sharded2["state"][key][name]).flatten()) for name, v1 in s.items()}
            for key, s in sharded1["state"].items()
        },
        "resumed": {how: (fsdp1["resume"](saved, how), fsdp2["resume"](saved, how)) for how in ("scatter", "shard")},
        "raw": raw["resume"](saved, "shard"),
    }


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert set(a["state"]) == set(b["state"])
    for key, state in a["state"].items():
        assert set(state) == set(b["state"][key])
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][key][name])), (key, name)
    assert [sorted(g["params"]) for g in a["param_groups"]] == [sorted(g["params"]) for g in b["param_groups"]]


def test_legacy_saves_and_loads_as_fsdp1(ranks: Any, tmp_path: Path) -> None:
    result = migrate_source(_PROGRAM)
    for rank, seen in enumerate(ranks(_saves_and_resumes, 2, _PROGRAM, result.migrated, str(tmp_path / "o.pt"))):
        full1, full2 = seen["full"]
        if rank == 0:
            _same_state(full1, full2)
        else:
            assert full1 == full2 == {}  # rank0_only: the other ranks get nothing, in both
        _same_state(*seen["every"])
        for key, states in seen["sharded"].items():
            for name, (piece1, piece2) in states.items():
                assert torch.equal(piece1, piece2), (key, name)
        for how, (fsdp1, fsdp2) in seen["resumed"].items():
            assert fsdp2 == fsdp1, how  # the same Adam steps after loading FSDP1's state, bit for bit
        # FSDP1's dict gives a unit's parameters one `step` tensor; loaded as it is, FSDP2 counts it once per
        # parameter and Adam's bias correction goes wrong: why unshared_optim_state is there
        assert seen["raw"] != seen["resumed"]["shard"][0]


_REKEY = """
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, OptimStateKeyType


def rekey():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    # param groups in another order than the model's parameters
    first, rest = [plain[2].weight], [plain[0].weight, plain[0].bias, plain[2].bias]
    optim = torch.optim.Adam([{"params": first}, {"params": rest}])
    plain(torch.randn(5, 3)).sum().backward()
    optim.step()
    by_name = FSDP.rekey_optim_state_dict(optim.state_dict(), OptimStateKeyType.PARAM_NAME, plain, optim=optim)
    by_id = FSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, plain, optim=optim)
    by_model_order = FSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, plain)
    return by_name, by_id, by_model_order
"""


def test_rekey_is_fsdp1s() -> None:
    """FSDP1's re-keying needs no process group: torch's and the migrated program's results side by side, in both
    directions, by the optimizer's order and by the model's."""
    result = migrate_source(_REKEY)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    assert 'rekey_optim_state_dict(by_name, "PARAM_ID", plain, optim=optim)' in result.migrated
    seen = []
    for source in (_REKEY, result.migrated):
        scope: dict[str, Any] = {}
        exec(compile(source, "program.py", "exec"), scope)
        seen.append(scope["rekey"]())
    for fsdp1, fsdp2 in zip(*seen, strict=True):
        assert list(fsdp1["state"]) == list(fsdp2["state"])
        assert fsdp1["param_groups"] == fsdp2["param_groups"]
        for key, state in fsdp1["state"].items():
            assert all(torch.equal(value, fsdp2["state"][key][name]) for name, value in state.items())
    by_name, by_id, by_model_order = seen[0]
    assert sorted(by_name["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert by_id["param_groups"][0]["params"] == [0] and by_model_order["param_groups"][0]["params"] == [2]


_REFUSED = {
    "optim_input": "full = FSDP.full_optim_state_dict(model, optim, optim_input=params)",
    "a group": "full = FSDP.sharded_optim_state_dict(model, optim, group=group)",
    "computed rank0_only": "full = FSDP.full_optim_state_dict(model, optim, rank0_only=rank == 0)",
    "**kwargs": "full = FSDP.full_optim_state_dict(**kwargs)",
    "not loaded": "sharded = FSDP.shard_full_optim_state_dict(full, model, optim=optim)",
    "used twice, never loaded": "sharded = FSDP.shard_full_optim_state_dict(full, model, optim=optim)\n"
    "torch.save(sharded, 'osd.pt')\nprint(sharded)",
    "another optimizer": "optim.load_state_dict(FSDP.shard_full_optim_state_dict(full, model, optim=other))",
    "rebound between": "sharded = FSDP.scatter_full_optim_state_dict(full, model, optim=optim)\n"
    "full = None\noptim.load_state_dict(sharded)",
    "computed key type": "ids = FSDP.rekey_optim_state_dict(full, key_type, model)",
}


@pytest.mark.parametrize("body", _REFUSED.values(), ids=list(_REFUSED))
def test_forms_it_cannot_map_are_reported_and_kept(body: str) -> None:
    source = textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def run(model, optim, other, full, params, group, rank, key_type, kwargs):
        """
    ) + textwrap.indent(body, "    ")
    result = migrate_source(source)
    first = next(i for i, line in enumerate(source.splitlines(), 1) if "FSDP." in line and "import" not in line)
    assert [f.line for f in result.findings] == [first], [f.format("x.py") for f in result.findings]
    assert source.splitlines()[first - 1] in result.migrated  # left as it was
    assert "set_optimizer_state_dict" not in result.migrated and "get_optimizer_state_dict" not in result.migrated
    # the load it would have fed stays as well (it would otherwise load FSDP1's layout into FSDP2's optimizer)
    assert body.count("load_state_dict") == result.migrated.count("load_state_dict")


def test_a_to_load_result_used_beyond_its_load_loads_at_once() -> None:
    """open_lm converts under a flag and loads either form after it (`if args.fsdp: osd = FSDP.optim_state_dict_to_load
    (...)`, then `optimizer.load_state_dict(osd)`): the conversion becomes runtime's loaded_optim_state_dict, which
    loads into the optimizer and gives back its own state dict for the load that follows (test_migrate_maybe_wrapped.py
    runs it against FSDP1)."""
    source = textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def run(model, optim, full, fsdp):
            sharded = full
            if fsdp:
                sharded = FSDP.shard_full_optim_state_dict(full, model, optim=optim)
            optim.load_state_dict(sharded)
            print(sharded)
        """
    )
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    loaded = "sharded = loaded_optim_state_dict(model, optim, full, options=StateDictOptions(full_state_dict=True))"
    assert loaded in result.migrated and "    optim.load_state_dict(sharded)\n" in result.migrated
    assert "from fsdp_legacy.migrate.runtime import loaded_optim_state_dict" in result.migrated


def test_the_argument_order_before_torch_2_1_is_read_from_the_model() -> None:
    """ml-4m calls `FSDP.optim_state_dict_to_load(checkpoint['optimizer'], model, optimizer)`, torch 2.0's order
    (2.1 put the model and optimizer first): where the second argument is the model the file knows wrapped, the
    arguments are read in that order (before, it was reported as loaded into another optimizer)."""
    source = textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, FullStateDictConfig

        def resume(model, optimizer, checkpoint):
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
                model.load_state_dict(checkpoint['model'])
                optimizer_state_dict = FSDP.optim_state_dict_to_load(checkpoint['optimizer'], model, optimizer)
                optimizer.load_state_dict(optimizer_state_dict)
        """
    )
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    loaded = "set_optimizer_state_dict(model, optimizer, unshared_optim_state(checkpoint['optimizer']), options="
    assert loaded in result.migrated
    # the 2.1 order, by position, stays read as it is written
    current = migrate_source(source.replace("(checkpoint['optimizer'], model, optimizer)", "(model, optimizer, osd)"))
    assert "set_optimizer_state_dict(model, optimizer, unshared_optim_state(osd), options=" in current.migrated
