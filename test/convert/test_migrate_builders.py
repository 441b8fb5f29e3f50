"""`fsdp-legacy migrate` on a function that builds and returns the model: `return FSDP(net, ...)` (a module-level
function or a method) becomes fully_shard code before `return net`, and the names its callers bind the result to
(`model = build_model(...)`, `self.model = self.setup(...)`) are wrapped models for the rewrite, as a model wrapped
in place is: their state-dict calls, `no_sync()` and `clip_grad_norm_` are FSDP2's. Only where every caller in the
file binds the result to a name; otherwise the file stays as it is, byte for byte, and says why. The oracle is
torch's FSDP1 running the original program beside the migrated one at 2 ranks: the same units and full state dict,
the same losses, and the FSDP2 program resumes from the FSDP1 program's FULL checkpoint as FSDP1 itself does."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from test_migrate import _fsdp1_names

from fsdp_legacy.migrate.program import migrate_program
from fsdp_legacy.migrate.rewriter import migrate_source

_PROGRAM = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def forward(self, x):
        return x + self.inner(x)


def net(width):
    torch.manual_seed(0)
    return nn.Sequential(Block(width), Block(width), nn.Linear(width, 1))


def build_model(width):
    return FSDP(net(width), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))


def units(width):
    model = build_model(width)
    return len(FSDP.fsdp_modules(model)), model.state_dict()  # FSDP1's default: the full state dict on every rank


class Trainer:
    def __init__(self, width):
        self.width = width
        self.model = self.setup()
        self.optim = torch.optim.Adam(self.model.parameters(), lr=0.01)

    def setup(self):
        wrapped = FSDP(
            net(self.width),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        return wrapped

    def step(self, step):
        data = torch.Generator().manual_seed(10 * step + dist.get_rank())
        x, y = torch.randn(2, 4, self.width, generator=data), torch.randn(2, 4, 1, generator=data)
        with self.model.no_sync():  # the first micro-batch accumulates without reducing
            nn.functional.mse_loss(self.model(x[0]), y[0]).backward()
        loss = nn.functional.mse_loss(self.model(x[1]), y[1])
        loss.backward()
        self.model.clip_grad_norm_(0.5)
        self.optim.step()
        self.optim.zero_grad()
        return loss.item()

    def save(self, path):
        # (offload_to_cpu=False: on a CPU device torch's FSDP1 gives every optimizer state of a unit as a view of one
        # buffer otherwise, test/frameworks/common.py)
        with FSDP.state_dict_type(
            self.model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        ):
            state = {"model": self.model.state_dict(), "optim": FSDP.optim_state_dict(self.model, self.optim)}
        if dist.get_rank() == 0:
            torch.save(state, path)
        dist.barrier()
        return state

    def load(self, path):
        state = torch.load(path, weights_only=True)
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT):
            self.model.load_state_dict(state["model"])
            self.optim.load_state_dict(FSDP.optim_state_dict_to_load(self.model, self.optim, state["optim"]))
"""


def test_the_builder_and_its_callers_are_migrated() -> None:
    result = migrate_source(_PROGRAM)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert _fsdp1_names(ast.parse(out)) == set()
    assert (  # `return FSDP(...)`: the module it is given sharded under a name the function lacks, then returned
        "def build_model(width):\n    # fsdp-legacy migrate: FSDP(...) became fully_shard (FSDP2)\n"
        '    # fsdp-legacy migrate: device_id=torch.device("cpu") dropped: fully_shard moves the parameters to its '
        "mesh's device (the current CUDA device, else the CPU)\n    model = net(width)\n"
        "    for module in reversed(list(model.modules())):  # children before parents, as FSDP1 wraps\n"
        "        if module is not model and isinstance(module, (Block,)):\n            fully_shard(module)\n"
        "    fully_shard(model)\n    return model\n"
    ) in out
    # the caller's name is the wrapped model: FSDP1's default type, FULL on every rank
    assert "return len([m for m in model.modules() if isinstance(m, FSDPModule)]), get_model_state_dict(model, " in out
    # `wrapped = FSDP(...); return wrapped` in a method: `self.model` is the wrapped model in the other methods
    assert "        self.model.set_requires_gradient_sync(False)  # was: with self.model.no_sync():" in out
    assert "        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)" in out
    assert (
        '"model": get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))'
    ) in out
    assert (
        'set_model_state_dict(self.model, state["model"], options=StateDictOptions(full_state_dict=True))' in out
        and 'set_optimizer_state_dict(self.model, self.optim, unshared_optim_state(state["optim"]), ' in out
    )
    again = migrate_source(out)  # a second pass finds nothing left
    assert (again.migrated, again.findings) == (out, [])


def _side_by_side(original: str, migrated: str, path: str) -> dict[str, Any]:
    """On a rank: each program's units and full state dict through the module-level builder; the Trainer (the
    method builder) of each trained 4 steps, FSDP1's saving its FULL checkpoint after 2; then each program's
    Trainer resumed from FSDP1's checkpoint, trained the last 2 steps."""
    import torch.distributed as dist

    programs = []
    for name, source in (("fsdp1.py", original), ("fsdp2.py", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, name, "exec"), namespace)
        programs.append(namespace)
    seen: dict[str, Any] = {"units": [p["units"](8) for p in programs], "losses": [], "resumed": [], "saved": []}
    for index, program in enumerate(programs):
        trainer = program["Trainer"](8)
        losses = [trainer.step(s) for s in range(2)]
        saved = trainer.save(f"{path}.{index}")  # FSDP1's file is the one both resume from
        seen["saved"].append(saved["model"])
        seen["losses"].append(losses + [trainer.step(s) for s in range(2, 4)])
    dist.barrier()
    for program in programs:
        trainer = program["Trainer"](8)
        trainer.load(f"{path}.0")
        seen["resumed"].append([trainer.step(s) for s in range(2, 4)])
    return seen


def test_the_migrated_builder_trains_saves_and_resumes_as_fsdp1(ranks: Any, tmp_path: Path) -> None:
    migrated = migrate_source(_PROGRAM).migrated
    for rank, seen in enumerate(ranks(_side_by_side, 2, _PROGRAM, migrated, str(tmp_path / "full.pt"))):
        (count1, full1), (count2, full2) = seen["units"]
        assert count1 == count2 == 3  # the root and its two Blocks
        assert full1.keys() == full2.keys() and all(torch.equal(full1[k], full2[k]) for k in full1)
        saved1, saved2 = seen["saved"]  # rank 0's full state dict, nothing elsewhere, in both
        assert saved1.keys() == saved2.keys() and (rank == 0) == bool(saved1)
        assert all(torch.allclose(saved1[k], saved2[k], rtol=1e-5, atol=1e-7) for k in saved1)
        fsdp1, fsdp2 = seen["losses"]
        assert fsdp2 == pytest.approx(fsdp1, rel=1e-5)  # (clipping sums the norm in another order)
        resumed1, resumed2 = seen["resumed"]
        assert resumed1 == pytest.approx(fsdp1[2:], rel=1e-6)  # (the oracle: FSDP1 resumes as it went on)
        assert resumed2 == pytest.approx(fsdp1[2:], rel=1e-5)


# -- what stays: a result the text does not follow ----------------------------------------------------------------

_BUILDER = """
import functools
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
EXTRA

DECORATORdef build_model(width):
    BODY


def main():
    CALLER
    model.clip_grad_norm_(1.0)
    other = FSDP(nn.Linear(2, 2))  # (it would migrate: the file would change)
    return model.state_dict(), other.state_dict()
"""

_PLAIN = {"body": "return FSDP(nn.Linear(width, width))", "caller": "model = build_model(4)", "extra": ""}

# how -> (what changes in the plain program, a word of the finding's `why` at `FSDP(...)`)
_STAYS = {
    "the result passed on": ({"caller": "model = build_model(4)\n    train(build_model(4))"}, "used other than as"),
    "called in an expression": (
        {"caller": "model = build_model(4)\n    print(build_model(4).state_dict())"},
        "used other than as",
    ),
    "exported": ({"extra": '__all__ = ["build_model"]\n'}, "exported by `__all__`"),
    "two returns": (
        {"body": "if width < 0:\n        return None\n    return FSDP(nn.Linear(width, width))"},
        "more than one place",
    ),
    "a decorator": ({"decorator": "@functools.cache\n"}, "not a plain module-level function or method"),
    "FSDP(...) handed to a function": (
        {"body": "return wrap_fn(FSDP(nn.Linear(width, width)))"},
        "not bound to a name by a statement of its own",
    ),
}


def _builder(**changes: str) -> str:
    source = _BUILDER
    for key, value in {"decorator": "", **_PLAIN, **changes}.items():
        source = source.replace(key.upper(), value)
    return source


@pytest.mark.parametrize(
    "changes",
    [{}, {"caller": "model = make()", "extra": "\ndef make():\n    built = build_model(4)\n    return built\n"}],
    ids=["called by its caller", "returned on by another function"],
)
def test_the_plain_builder_is_mapped(changes: dict[str, str]) -> None:
    result = migrate_source(_builder(**changes))
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    assert "    model = nn.Linear(width, width)\n    fully_shard(model)\n    return model\n" in result.migrated
    assert "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)" in result.migrated
    assert "return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)), " in result.migrated


@pytest.mark.parametrize(
    "changes",
    [
        {"caller": "model = nn.Linear(4, 4)"},
        {"caller": "model = nn.Linear(4, 4)", "extra": "\ndef make():\n    built = build_model(4)\n    return built\n"},
    ],
    ids=["called nowhere", "returned on, to nowhere"],
)
def test_a_builder_called_nowhere_is_mapped_as_any_model_it_returns(changes: dict[str, str]) -> None:
    """Its callers are outside the files the tool is given, as for `wrapped = FSDP(...); return wrapped` and any name a
    file migrated alone defines (a program's other files are followed: test_migrate_cross_file): sharded as before,
    and nothing said of it."""
    result = migrate_source(_builder(**changes))
    assert "    model = nn.Linear(width, width)\n    fully_shard(model)\n    return model\n" in result.migrated
    assert not [f for f in result.findings if "build_model" in f.what + f.why], [
        f.format("x.py") for f in result.findings
    ]


@pytest.mark.parametrize(("changes", "why"), _STAYS.values(), ids=list(_STAYS))
def test_a_result_the_text_does_not_follow_keeps_the_file(changes: dict[str, str], why: str) -> None:
    """Mapped, the construction would become FSDP2's and the calls made on its result elsewhere would stay as written
    (`state_dict()`: each rank's DTensor shards where FSDP1 gave the full state dict): the file stays as it is, the
    construction reported with why, and a second run over it reports the same."""
    source = _builder(**changes)
    result = migrate_source(source)
    assert result.migrated == source
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "FSDP(nn.Linear(width" in text)
    found = [f for f in result.findings if f.line == line]
    assert [f.kind for f in found] == ["unmapped", "refused"], [f.format("x.py") for f in result.findings]
    assert "FSDP(...)" in found[0].what and why in found[0].why, found[0].format("x.py")
    assert "would be left as written under FSDP2" in found[0].why
    again = migrate_source(result.migrated)
    assert (again.migrated, again.findings) == (source, result.findings)


def test_a_builder_read_as_an_attribute_by_another_file_of_the_program_stays(tmp_path: Path) -> None:
    """train.py reads `models.build_model`, a form the tool does not follow across files (`from models import
    build_model` it does: test_migrate_cross_file): models.py stays as it is, and train.py with it (it imports from a
    file that stays FSDP1)."""
    models, train = str(tmp_path / "models.py"), str(tmp_path / "train.py")
    caller = "import models\n\n\ndef run():\n    model = models.build_model(4)\n    return model.state_dict()\n"
    source = _builder()
    program = migrate_program({models: source, train: caller})
    result = program.results[models]
    assert result.migrated == source
    assert any(f"is used by {train}:5" in f.why for f in result.findings), [f.format("m") for f in result.findings]
    assert program.results[train].migrated == caller
    # alone, nothing shows the other file: the builder is followed to its callers here
    assert migrate_source(source).changed


# -- a call before the wrapping: the module the program is about to wrap --------------------------------------------

_LOADED_BEFORE_WRAPPING = """
import functools
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, FullStateDictConfig
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def forward(self, x):
        return x + self.inner(x)


def setup_fsdp_sync(model: nn.Module) -> FSDP:
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block)),
        device_id=torch.device("cpu"),
        sync_module_states=True,
        use_orig_params=True,
    )
    return model


def main(resume):
    torch.manual_seed(dist.get_rank())  # each rank its own weights: rank 0's reach the others through the wrapping
    model = nn.Sequential(Block(8), Block(8), nn.Linear(8, 1))
    if dist.get_rank() == 0:  # the other ranks receive the weights in setup_fsdp_sync
        model.load_state_dict(torch.load(resume, weights_only=True), strict=True)
    model = setup_fsdp_sync(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for step in range(3):
        data = torch.Generator().manual_seed(10 * step + dist.get_rank())
        x, y = torch.randn(4, 8, generator=data), torch.randn(4, 1, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        model.clip_grad_norm_(0.5)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        consolidated = model.state_dict()
    return losses, consolidated
"""


def _resumed_side_by_side(original: str, migrated: str, path: str) -> list[Any]:
    import torch.distributed as dist
    import torch.nn as nn

    # torch's FSDP1 refuses sync_module_states on the CPU: fsdp_legacy's FSDP1 (equal to it in the parity tests) runs
    # the original program
    original = original.replace("torch.distributed.fsdp", "fsdp_legacy")
    programs = []
    for name, source in (("fsdp1.py", original), ("fsdp2.py", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, name, "exec"), namespace)
        programs.append(namespace)
    if dist.get_rank() == 0:  # the consolidated checkpoint both resume from: the program's own model, other weights
        torch.manual_seed(123)
        block = programs[0]["Block"]
        torch.save(nn.Sequential(block(8), block(8), nn.Linear(8, 1)).state_dict(), path)
    dist.barrier()
    return [program["main"](path) for program in programs]


def test_a_load_before_the_wrapping_stays_the_plain_modules(ranks: Any, tmp_path: Path) -> None:
    """LlamaGen's FSDP trainer: rank 0 loads the consolidated checkpoint into the model before handing it to the
    function that wraps it (`model = setup_fsdp_sync(model, ...)`, sync_module_states=True). That call is on the plain
    module: it stays `model.load_state_dict(...)` (it became `set_model_state_dict(model, ...)` on one rank), while
    the calls after the wrapping become FSDP2's, and the builder's `-> FSDP` annotation FSDPModule (it was reported,
    the file left half FSDP1); the program trains as FSDP1's from the same weights."""
    result = migrate_source(_LOADED_BEFORE_WRAPPING)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert "        model.load_state_dict(torch.load(resume, weights_only=True), strict=True)\n" in out
    assert "torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)" in out
    assert "def setup_fsdp_sync(model: nn.Module) -> FSDPModule:" in out  # (evaluated where it is defined)
    assert "consolidated = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True" in out
    for rank, ((losses1, full1), (losses2, full2)) in enumerate(
        ranks(_resumed_side_by_side, 2, _LOADED_BEFORE_WRAPPING, out, str(tmp_path / "consolidated.pt"))
    ):
        assert losses2 == pytest.approx(losses1, rel=1e-5)
        assert full1.keys() == full2.keys() and (rank == 0) == bool(full1)
        assert all(torch.allclose(full1[k], full2[k], rtol=1e-5, atol=1e-7) for k in full1)


_COUNTED_BEFORE = """
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main():
    model = nn.Linear(4, 4)
    n_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"Number of params: {n_parameters}")
    OPTIMIZER
    model = FSDP(model, device_id=torch.device("cpu"))
    return n_parameters
"""


def test_statements_before_the_construction_move_only_where_nothing_between_needs_them() -> None:
    """ml-4m counts the parameters before wrapping and prints the count: the count used to move after fully_shard,
    past the print that reads it (a NameError). A count stays (FSDP2's DTensors count as many elements); an
    optimizer moves after fully_shard where nothing between uses it, and is reported where something does."""
    plain = migrate_source(_COUNTED_BEFORE.replace("OPTIMIZER", "pass"))
    assert plain.findings == []
    assert (
        "    n_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)\n    print(" in plain.migrated
    )
    alone = migrate_source(_COUNTED_BEFORE.replace("OPTIMIZER", "optim = torch.optim.SGD(model.parameters(), lr=0.1)"))
    assert alone.findings == [] and alone.migrated.index("fully_shard(model)") < alone.migrated.index("optim = ")
    used = _COUNTED_BEFORE.replace(
        "OPTIMIZER",
        "optim = torch.optim.SGD(model.parameters(), lr=0.1)\n    sched = torch.optim.lr_scheduler.StepLR(optim, 1)",
    )
    result = migrate_source(used)
    (finding,) = result.findings
    assert "optim = torch.optim.SGD(model.parameters(), lr=0.1)" in finding.why and "cannot move" in finding.why
