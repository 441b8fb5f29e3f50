"""`fsdp-legacy migrate`: all of a file (and of a program) or a clear refusal, never a mix.

Subclasses of FSDP1's class (`class TracedFSDP(FSDP):`, as in mmengine's and several
trainers' wrappers): all of a file or a clear refusal, never a mix. Before, `FSDP.fsdp_modules(m)` and
`isinstance(x, FSDP)` were rewritten onto FSDP2's `FSDPModule` while `m` was still built by the subclass, which stays
FSDP1: they silently matched nothing. A file that defines one, and, migrated together, every file of the program that
uses FSDP1, is left byte for byte, with a finding that names the subclass."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("libcst")

from fsdp_legacy.cli import main as cli_main
from fsdp_legacy.migrate.program import migrate_program
from fsdp_legacy.migrate.rewriter import migrate_source

_SUBCLASS = textwrap.dedent(
    """
    import torch.nn as nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy


    class TracedFSDP(BASE):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)


    def build(net):
        model = TracedFSDP(net, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        units = FSDP.fsdp_modules(model)
        assert all(isinstance(m, FSDP) for m in units)
        head = FSDP(nn.Linear(2, 2))
        return model, head
    """
)

_BASES = {
    "the alias": ("FSDP", ""),
    "the module's attribute": ("torch.distributed.fsdp.FullyShardedDataParallel", "import torch.distributed.fsdp\n"),
    "fsdp_legacy's class": ("FullyShardedDataParallel", "from fsdp_legacy import FullyShardedDataParallel\n"),
}


@pytest.mark.parametrize(("base", "imports"), _BASES.values(), ids=list(_BASES))
def test_a_file_defining_a_subclass_is_left_as_it_is(base: str, imports: str) -> None:
    source = imports + _SUBCLASS.replace("BASE", base)
    result = migrate_source(source)
    assert result.migrated == source  # byte for byte: neither fsdp_modules, isinstance nor the head's FSDP(...)
    line = next(i for i, text in enumerate(source.splitlines(), 1) if text.startswith("class TracedFSDP"))
    assert [(f.line, f.kind) for f in result.findings] == [(line, "refused")]
    assert "`class TracedFSDP(" in result.findings[0].what and "subclass of FSDP1's class" in result.findings[0].what
    assert "left as it is, as a whole" in result.findings[0].why


def test_a_subclass_of_a_subclass_is_named_too() -> None:
    source = _SUBCLASS.replace("BASE", "FSDP") + "\n\nclass Deeper(TracedFSDP):\n    pass\n"
    result = migrate_source(source)
    assert result.migrated == source
    assert [f.what.split("(")[0] for f in result.findings] == ["`class TracedFSDP", "`class Deeper"]


def test_without_the_subclass_the_same_file_migrates() -> None:
    """The control: the refusal comes from the subclass alone."""
    source = _SUBCLASS.replace("BASE", "nn.Module").replace("TracedFSDP(net, ", "FSDP(net, ")
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    assert "FSDP.fsdp_modules" not in result.migrated and "isinstance(m, FSDPModule)" in result.migrated


_PROGRAM = {
    "wrappers.py": """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


        class TracedFSDP(FSDP):
            pass
        """,
    "deeper.py": """
        from pkg.wrappers import TracedFSDP


        class Deeper(TracedFSDP):
            pass
        """,
    "train.py": """
        import torch.nn as nn
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        from .deeper import Deeper


        def build(net):
            model = Deeper(net)
            return model, FSDP.fsdp_modules(model)
        """,
    "units.py": """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


        def units(model):  # given a Deeper model: it never names the subclass, yet its objects come here
            return [m for m in model.modules() if isinstance(m, FSDP)]


        def wrap(net):
            model = FSDP(net)
            return model
        """,
    "data.py": """
        import torch


        def batch():
            return torch.randn(2, 4)
        """,
}


def _write(root: Path, files: dict[str, str]) -> dict[Path, str]:
    written = {}
    (root / "pkg").mkdir()
    for name, text in files.items():
        path = root / "pkg" / name
        path.write_text(textwrap.dedent(text).lstrip())
        written[path] = path.read_text()
    return written


def test_across_files_every_fsdp1_file_of_the_program_is_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The subclass defined in one file, subclassed in a second, used in a third; a fourth never names it but takes
    its objects (isinstance against FSDP1's class); a fifth has no FSDP at all. Migrated alone, the fourth file would
    become FSDP2's and match nothing; together, nothing changes and each file says why."""
    written = _write(tmp_path, _PROGRAM)
    assert migrate_source(written[tmp_path / "pkg" / "units.py"]).changed  # alone, it would be rewritten
    assert cli_main(["migrate", str(tmp_path / "pkg"), "--write"]) == 1
    for path, text in written.items():
        assert path.read_text() == text, path.name  # byte for byte
    err = capsys.readouterr().err
    for name in ("wrappers.py", "deeper.py", "train.py", "units.py"):
        assert f"pkg/{name}:" in err, err
    assert "data.py" not in err  # nothing to migrate: no finding, no change
    wrappers = str(tmp_path / "pkg" / "wrappers.py")
    assert "`class TracedFSDP(FSDP)`, a subclass of FSDP1's class" in err
    assert f"`TracedFSDP`, a subclass of FSDP1's class defined at {wrappers}:4" in err  # deeper.py's finding
    assert "the program defines `Deeper`" in err and "`TracedFSDP`" in err  # units.py's


def test_the_same_program_without_the_subclass_migrates(tmp_path: Path) -> None:
    files = dict(_PROGRAM)
    files["wrappers.py"] = files["wrappers.py"].replace("TracedFSDP(FSDP)", "TracedFSDP")
    files["deeper.py"] = files["deeper.py"].replace("Deeper(TracedFSDP)", "Deeper")
    written = _write(tmp_path, files)
    program = migrate_program({str(p): t for p, t in written.items()})
    units = program.results[str(tmp_path / "pkg" / "units.py")]
    assert units.changed and units.findings == [], [f.format("units.py") for f in units.findings]
    assert "isinstance(m, FSDPModule)" in units.migrated and "fully_shard(net)" in units.migrated
    assert not program.results[str(tmp_path / "pkg" / "data.py")].changed


# -- a construction that stays FSDP1 keeps the file FSDP1 ----------------------------------------------------------

_KEPT = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP

    offload = CPUOffload(offload_params=True)


    def train(net, head, cfg, batch):
        model = FSDP(net, *cfg.fsdp_args, cpu_offload=offload)
        other = FSDP(head)
        model(batch).sum().backward()
        model.clip_grad_norm_(1.0)
        return FSDP.fsdp_modules(model), [m for m in other.modules() if isinstance(m, FSDP)]
    """
)


def test_a_construction_that_stays_fsdp1_keeps_its_file() -> None:
    """Before, the construction stayed (keywords the text does not show) while `clip_grad_norm_` became
    torch.nn.utils' (each rank's shards' norm on an FSDP1 model), `fsdp_modules` and `isinstance` FSDPModule's
    (matching nothing), the other construction fully_shard and its CPUOffload FSDP2's policy (which FSDP1 rejects)."""
    result = migrate_source(_KEPT)
    assert result.migrated == _KEPT
    assert any(f.line == 9 and "*args" in f.what for f in result.findings)
    refusal = next(f for f in result.findings if f.kind == "refused")
    assert refusal.line == 9 and "at line 9 stays FSDP1" in refusal.why and "as a whole" in refusal.why
    assert result.fsdp1_constructions == {9}


def test_once_it_can_be_read_the_file_migrates() -> None:
    result = migrate_source(_KEPT.replace("*cfg.fsdp_args, ", ""))
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    assert "offload = CPUOffloadPolicy()" in result.migrated and "torch.nn.utils.clip_grad_norm_" in result.migrated


# -- across files: what a file that stays FSDP1 gives another is FSDP1's ------------------------------------------

_BUILDER = """
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType


def build(net):
    model = FSDP(net)
    FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
    return model
"""

_CALLER = """
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from models import build


def save(net, optim):
    model = build(net)
    return FSDP.optim_state_dict(model, optim)
"""


def test_a_file_importing_from_one_that_stays_fsdp1_stays_too(tmp_path: Path) -> None:
    """models.py sets the type where it builds the model, for callers in another file: it stays FSDP1 (refused).
    Alone, train.py's optim_state_dict became FSDP2's with FSDP1's default FULL options, where the model is FSDP1's
    under SHARDED; together, it stays as it is and names the file it depends on."""
    models, train = str(tmp_path / "models.py"), str(tmp_path / "train.py")
    alone = migrate_source(_CALLER)
    assert alone.changed and "full_state_dict=True" in alone.migrated  # the wrong half
    program = migrate_program({models: _BUILDER, train: _CALLER})
    assert program.results[models].migrated == _BUILDER
    assert f"is imported by {train}" in program.results[models].findings[0].why  # (alone: "not called in this file")
    result = program.results[train]
    assert result.migrated == _CALLER
    assert (
        result.findings[0].kind == "refused"
        and f"it imports from {models}, which stays FSDP1" in result.findings[0].why
    )


def test_a_file_importing_from_a_migrated_one_migrates() -> None:
    # (without the setter, the builder's model is followed to train.py: test_migrate_cross_file)
    returning = _BUILDER.replace("    FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)\n", "")
    program = migrate_program({"models.py": returning, "train.py": _CALLER})
    assert program.results["models.py"].changed and program.results["train.py"].changed
    assert "get_optimizer_state_dict(model, optim" in program.results["train.py"].migrated
    models = returning.replace("    return model\n", "    return len(FSDP.fsdp_modules(model))\n")
    caller = _CALLER.replace("    model = build(net)\n", "    build(net)\n    model = FSDP(net)\n")
    program = migrate_program({"models.py": models, "train.py": caller})
    assert program.results["models.py"].changed and program.results["train.py"].changed
    assert "get_optimizer_state_dict(model, optim" in program.results["train.py"].migrated


def test_manual_wrapping_that_stays_fsdp1_keeps_its_file() -> None:
    """A wrap() outside its enable_wrap keeps every wrap() FSDP1's (test_migrate_wrap); the model they build is then
    FSDP1's, so `FSDP.fsdp_modules(model)` and the other construction stay too."""
    source = textwrap.dedent(
        """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import enable_wrap, wrap


        def run(net, head):
            layer = wrap(net.layer)
            with enable_wrap(wrapper_cls=FSDP):
                model = wrap(net)
            other = FSDP(head)
            return FSDP.fsdp_modules(model), other
        """
    )
    result = migrate_source(source)
    assert result.migrated == source
    assert any(f.kind == "refused" and "at lines 7, 8, 9 stays FSDP1" in f.why for f in result.findings)


# FastChat's trainer_save_model_safe: a FULL type around `trainer.save_model()`, which the tool cannot see into, so
# the block stays; the rest of the file (the construction, a SHARDED helper) was rewritten around it.
_SAVE_MODEL_SAFE = textwrap.dedent(
    """
    import torch.nn as nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, FullStateDictConfig, StateDictType


    def trainer_save_model_safe(trainer):
        save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(trainer.model, StateDictType.FULL_STATE_DICT, save_policy):
            trainer.save_model()


    def build():
        model = FSDP(nn.Linear(4, 4))
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return model, model.state_dict()
    """
)


def _fsdp1_block_on_fsdp2() -> tuple[list[str], str]:
    """What FSDP1's FULL rank0_only block does on an FSDP2 model: the state dict's value types inside it, and the
    error leaving it raises."""
    import torch
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType, fully_shard
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = fully_shard(torch.nn.Linear(4, 4))
    types: list[str] = []
    try:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
            types = sorted({type(v).__name__ for v in model.state_dict().values()})
    except Exception as e:
        return types, type(e).__name__
    return types, ""


def test_a_state_dict_type_block_that_stays_keeps_its_file(ranks: Any) -> None:
    """The block left FSDP1's around the model rewritten for FSDP2 does not fit it (the oracle, torch 2.13: torch's
    FSDP1 block over a fully_shard model sets nothing, its state_dict() gives each rank's DTensor shards where FSDP1
    gave rank 0 a full dict, and leaving the block fails with a KeyError), so the file stays as it is, as a whole,
    with the block's finding and a refusal."""
    assert ranks(_fsdp1_block_on_fsdp2, 2) == [(["DTensor"], "KeyError")] * 2
    result = migrate_source(_SAVE_MODEL_SAFE)
    assert result.migrated == _SAVE_MODEL_SAFE
    assert [(f.line, f.kind) for f in result.findings if f.kind == "refused"] == [(8, "refused")]  # the block
    assert any("it stays: `trainer.save_model(...)`" in f.why for f in result.findings)
    # without the block it cannot map, the rest of the same file migrates
    head, build = _SAVE_MODEL_SAFE.split("\n\ndef trainer_save_model_safe")[0], _SAVE_MODEL_SAFE.split("\n\n\n")[-1]
    alone = migrate_source(head + "\n\n\n" + build)
    assert alone.findings == [] and "fully_shard(model)" in alone.migrated


# -- FSDP1's CPUOffload where what takes it is not shown (FastVideo's get_dit_fsdp_kwargs) -------------------------

_KWARGS_FACTORY = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy


    def get_fsdp_kwargs(cpu_offload=False):
        cpu_offload = (CPUOffload(offload_params=True) if cpu_offload else None)
        return {"sharding_strategy": ShardingStrategy.FULL_SHARD, "cpu_offload": cpu_offload}
    """
)

_KWARGS_USER = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fsdp_util import get_fsdp_kwargs


    def build(net):
        return FSDP(net, device_id=torch.device("cpu"), **get_fsdp_kwargs(cpu_offload=True))
    """
)


def test_cpu_offload_handed_on_stays_fsdp1s(ranks: Any) -> None:
    """A CPUOffload(...) built into a kwargs dict that another file hands to `FSDP(net, **kwargs)`: it used to become
    FSDP2's CPUOffloadPolicy(), which an FSDP(...) left FSDP1 then could not take (`.offload_params`). Now it stays
    FSDP1's: FSDP1's construction takes it as before, and the migrated one (`fully_shard_fsdp1(net, **kwargs)`,
    which maps the dict's values at run time) offloads with it."""
    program = migrate_program({"fsdp_util.py": _KWARGS_FACTORY, "train.py": _KWARGS_USER})
    factory = program.results["fsdp_util.py"].migrated
    assert "CPUOffload(offload_params=True) if cpu_offload else None" in factory and "CPUOffloadPolicy" not in factory
    train = program.results["train.py"].migrated
    assert 'net = fully_shard_fsdp1(net, device_id=torch.device("cpu"), **get_fsdp_kwargs(cpu_offload=True))' in train
    assert ranks(_offloads_with, 2, factory, _KWARGS_USER) == [(True, True)] * 2  # FSDP1's, as before
    assert ranks(_offloads_with, 2, factory, train) == [(False, True)] * 2  # fully_shard's, offloaded


def _offloads_with(factory: str, train: str) -> tuple[bool, bool]:
    """On a rank: whether the program's model is FSDP1's, and whether its parameters are offloaded."""
    import sys
    import types

    import torch.nn as nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    module = types.ModuleType("fsdp_util")
    exec(compile(factory, "fsdp_util.py", "exec"), module.__dict__)
    sys.modules["fsdp_util"] = module
    try:
        namespace: dict[str, Any] = {}
        exec(compile(train, "train.py", "exec"), namespace)
        model = namespace["build"](nn.Linear(4, 4))
    finally:
        del sys.modules["fsdp_util"]
    if isinstance(model, FSDP):
        return True, bool(model.cpu_offload.offload_params)
    from torch.distributed.fsdp import CPUOffloadPolicy

    state = model._get_fsdp_state()  # (FSDP2's state: the offload policy its parameter group runs with)
    return False, isinstance(state._fsdp_param_group.offload_policy, CPUOffloadPolicy)


def test_accelerates_own_clip_grad_norm_is_not_reported() -> None:
    """alpaca_farm's RL trainer clips with `self.accelerator.clip_grad_norm_(...)`, Accelerate's method, beside its
    FSDP1 code: it was reported as an FSDP1 method on an object not known to be wrapped."""
    source = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy\n\n\n"
        "def step(self, policy):\n"
        "    self.accelerator.clip_grad_norm_(policy.parameters(), 1.0)\n"
        "    return policy.sharding_strategy != ShardingStrategy.NO_SHARD, other.clip_grad_norm_(1.0)\n"
    )
    result = migrate_source(source)
    assert [f.line for f in result.findings if "clip_grad_norm_" in f.what] == [6]  # (another object's still is)
