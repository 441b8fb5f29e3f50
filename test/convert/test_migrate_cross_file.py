"""`fsdp-legacy migrate` on a program whose model is built in one file and trained in another: `def build(...): ...
return FSDP(net, ...)` in model_lib.py, `from model_lib import build` and `model = build(...)` in train.py (and
through a third file that returns it on). Followed across the files: the builder becomes fully_shard code and the
caller's calls on `model` (no_sync, clip_grad_norm_, the FULL checkpoint's state_dict_type block, FSDP1's default
FULL `state_dict()`) become FSDP2's. Where a caller uses the builder any other way, or stays FSDP1 itself, both files
stay as they are, byte for byte, and say why. The oracle is torch's FSDP1 running the original program beside the
migrated one at 2 ranks: the same losses and FULL checkpoint, and the FSDP2 program resuming from FSDP1's
checkpoint as FSDP1 itself does."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from test_migrate import _fsdp1_names

from fsdp_legacy.migrate.program import migrate_program

_MODEL_LIB = """
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def forward(self, x):
        return x + self.inner(x)


def build(width):
    torch.manual_seed(0)
    net = nn.Sequential(Block(width), Block(width), nn.Linear(width, 1))
    return FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))


def build_with_optimizer(width, lr):
    model = build(width)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    return model, optim
"""

_TRAIN = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

from model_lib import build_with_optimizer as make


def step(model, optim, index):
    data = torch.Generator().manual_seed(10 * index + dist.get_rank())
    x, y = torch.randn(2, 4, 8, generator=data), torch.randn(2, 4, 1, generator=data)
    nn.functional.mse_loss(model(x[0]), y[0]).backward()
    model.clip_grad_norm_(0.5)
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        return nn.functional.mse_loss(model(x[1]), y[1]).item()


def run(path, resume):
    model, optim = make(8, 0.01)
    if resume:
        state = torch.load(path, weights_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            model.load_state_dict(state["model"])
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))
    losses = []
    for index in range(2, 4) if resume else range(2):
        data = torch.Generator().manual_seed(index)
        with model.no_sync():  # a micro-batch accumulated without reducing
            nn.functional.mse_loss(model(torch.randn(4, 8, generator=data)), torch.zeros(4, 1)).backward()
        losses.append(step(model, optim, index))
    full = model.state_dict()  # FSDP1's default type: the full state dict on every rank
    if not resume:
        save_policy = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)  # (True: torch's FSDP1 breaks on CPU)
        optim_policy = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy, optim_policy):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        if dist.get_rank() == 0:
            torch.save(state, path)
        dist.barrier()
    return losses, full
"""


def _program(tmp: Path) -> tuple[str, str]:
    return str(tmp / "model_lib.py"), str(tmp / "train.py")


def test_a_model_built_in_one_file_and_trained_in_another_is_migrated_in_both(tmp_path: Path) -> None:
    lib, train = _program(tmp_path)
    program = migrate_program({lib: _MODEL_LIB, train: _TRAIN})
    for path in (lib, train):
        result = program.results[path]
        assert result.changed and result.findings == [], [f.format(path) for f in result.findings]
        assert _fsdp1_names(ast.parse(result.migrated)) == set(), path
    out = program.results[train].migrated
    assert "    model.set_requires_gradient_sync(False)  # was: with model.no_sync():" in out
    assert "torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)" in out
    assert "    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))" in out
    assert "fully_shard(net)\n    return net\n" in program.results[lib].migrated
    again = migrate_program({p: r.migrated for p, r in program.results.items()})  # nothing left the second time
    assert all(not r.changed and r.findings == [] for r in again.results.values())


def _write_both(tmp_path: Path, sources: dict[str, str]) -> None:
    """The program as written in tmp_path/fsdp1, as migrated in tmp_path/fsdp2, each file by its own name."""
    program = migrate_program(sources)
    for kind, texts in (("fsdp1", sources), ("fsdp2", {p: r.migrated for p, r in program.results.items()})):
        (tmp_path / kind).mkdir()
        for path, text in texts.items():
            (tmp_path / kind / Path(path).name).write_text(text)


def _in_each(folder: str, main: str, entry: Any) -> dict[str, Any]:
    """On a rank: `entry(module, kind, folder)` with each program's `main` module imported from its own folder."""
    seen: dict[str, Any] = {}
    for kind in ("fsdp1", "fsdp2"):
        where = Path(folder) / kind
        sys.path.insert(0, str(where))
        try:
            seen[kind] = entry(importlib.import_module(main), kind, folder)
        finally:
            sys.path.remove(str(where))
            for module in where.glob("*.py"):
                sys.modules.pop(module.stem, None)
    return seen


def _train_and_resume(train: Any, kind: str, folder: str) -> dict[str, Any]:
    """Trained 2 steps and saved, then resumed from FSDP1's checkpoint for 2 more."""
    return {
        "first": train.run(f"{folder}/{kind}.pt", resume=False),
        "resumed": train.run(f"{folder}/fsdp1.pt", resume=True),
    }


def test_the_migrated_program_trains_saves_and_resumes_as_fsdp1(ranks: Any, tmp_path: Path) -> None:
    _write_both(tmp_path, dict(zip(_program(tmp_path), (_MODEL_LIB, _TRAIN), strict=True)))
    for seen in ranks(_in_each, 2, str(tmp_path), "train", _train_and_resume):
        (losses1, full1), (losses2, full2) = seen["fsdp1"]["first"], seen["fsdp2"]["first"]
        assert losses2 == pytest.approx(losses1, rel=1e-5)  # (clipping sums the norm in another order)
        assert full1.keys() == full2.keys()
        assert all(torch.allclose(full1[k], full2[k], rtol=1e-5, atol=1e-7) for k in full1)
        (resumed1, _), (resumed2, _) = seen["fsdp1"]["resumed"], seen["fsdp2"]["resumed"]
        assert resumed2 == pytest.approx(resumed1, rel=1e-5)


_TRAINER_LIB = """
from model_lib import build


def setup(width):
    model = build(width)
    return model
"""

_CHAINED_TRAIN = """
from trainer_lib import setup


def run():
    model = setup(8)
    model.clip_grad_norm_(1.0)
    return model.state_dict()
"""


def test_a_model_returned_on_through_a_third_file_is_followed(tmp_path: Path) -> None:
    lib, train = _program(tmp_path)
    trainer = str(tmp_path / "trainer_lib.py")
    program = migrate_program({lib: _MODEL_LIB, trainer: _TRAINER_LIB, train: _CHAINED_TRAIN})
    out = program.results[train].migrated
    assert program.results[lib].changed and not program.results[trainer].changed
    assert all(r.findings == [] for r in program.results.values()), {
        p: [f.format(p) for f in r.findings] for p, r in program.results.items()
    }
    assert "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)" in out
    assert "return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))" in out


# how train.py uses the builder -> a word of the reason the builder's file gives
_NOT_FOLLOWED = {
    "read as an attribute": ("import model_lib\n", "model_lib.build_with_optimizer(8, 0.01)", "is used by"),
    "a star import": ("from model_lib import *\n", "build_with_optimizer(8, 0.01)", "is imported by"),
    "its result handed on": (
        "from model_lib import build_with_optimizer\n",
        "keep(build_with_optimizer(8, 0.01))",
        "is used other than as `model, _ = build_with_optimizer(...)`",
    ),
}


@pytest.mark.parametrize(("imports", "call", "why"), _NOT_FOLLOWED.values(), ids=list(_NOT_FOLLOWED))
def test_a_caller_the_tool_does_not_follow_keeps_both_files(tmp_path: Path, imports: str, call: str, why: str) -> None:
    lib, train = _program(tmp_path)
    caller = f"{imports}\n\ndef run():\n    model, optim = {call}\n    return model.state_dict()\n"
    if "keep(" in call:
        caller = f"{imports}\n\ndef run():\n    {call}\n"
    program = migrate_program({lib: _MODEL_LIB, train: caller})
    assert program.results[lib].migrated == _MODEL_LIB and program.results[train].migrated == caller
    reasons = [f.why for f in program.results[lib].findings]
    assert any(why in r for r in reasons), [f.format(lib) for f in program.results[lib].findings]


def test_a_caller_that_stays_fsdp1_keeps_the_builder_fsdp1(tmp_path: Path) -> None:
    """train.py's LOCAL state-dict block has no FSDP2 counterpart: it stays FSDP1, reported, so the model it binds
    must stay FSDP1's, and model_lib.py is left as it is too, saying so."""
    lib, train = _program(tmp_path)
    caller = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n"
        "from model_lib import build\n\n\ndef run():\n    model = build(8)\n"
        "    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):\n        return model.state_dict()\n"
    )
    program = migrate_program({lib: _MODEL_LIB, train: caller})
    assert program.results[train].migrated == caller and program.results[train].findings
    result = program.results[lib]
    assert result.migrated == _MODEL_LIB
    assert any(f"returns its wrapped model to {train}, which stays FSDP1" in f.why for f in result.findings), [
        f.format(lib) for f in result.findings
    ]


# -- a wrapped model handed to another file's function (fms-fsdp's `train(cfg, model, ...)`) -----------------------

_TRAIN_UTILS = """
import torch
import torch.nn as nn


def train(cfg, model, optimizer, first, steps):
    model.train()
    losses = []
    for index in range(first, first + steps):
        data = torch.Generator().manual_seed(10 * index + torch.distributed.get_rank())
        loss = nn.functional.mse_loss(model(torch.randn(4, 8, generator=data)), torch.zeros(4, 1))
        loss.backward()
        norm = model.clip_grad_norm_(cfg["clip"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append((loss.item(), norm.item()))
    return losses


def save(model):
    return model.state_dict()  # FSDP1's default type: the full state dict on every rank
"""

_MAIN = """
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from train_utils import save, train


def run():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1))
    policy = ModuleWrapPolicy({nn.Sequential})
    model = FSDP(net, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = train({"clip": 0.3}, model, optimizer, 0, 2)
    losses += train({"clip": 0.3}, model=model, optimizer=optimizer, first=2, steps=2)
    return losses, save(model)
"""


# the same caller reaching the functions through their module (`train_utils.save(model)`), as wenet and ml-4m do
_MAIN_THROUGH_MODULE = (
    _MAIN.replace("from train_utils import save, train\n", "import train_utils as utils\n")
    .replace("train({", "utils.train({")
    .replace("save(model)", "utils.save(model)")
)
_CALLERS = {"by name": _MAIN, "through the module": _MAIN_THROUGH_MODULE}


@pytest.mark.parametrize("caller", _CALLERS.values(), ids=list(_CALLERS))
def test_a_model_handed_to_another_files_function_is_the_wrapped_model_there(tmp_path: Path, caller: str) -> None:
    """train_utils.py names no FSDP at all: before, it was left as written, `model.clip_grad_norm_` and FSDP1's
    default full `state_dict()` on what became an FSDP2 model (an AttributeError, and each rank's DTensor shards),
    silently; through the module, `utils.save(model)` was not followed, and the saved dict became each rank's shards
    with nothing said."""
    utils, main = str(tmp_path / "train_utils.py"), str(tmp_path / "main.py")
    program = migrate_program({utils: _TRAIN_UTILS, main: caller})
    assert all(r.changed and r.findings == [] for r in program.results.values()), {
        p: [f.format(p) for f in r.findings] for p, r in program.results.items()
    }
    out = program.results[utils].migrated
    assert 'norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])' in out
    assert "return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))" in out


def _run_main(main: Any, kind: str, folder: str) -> Any:
    return main.run()


@pytest.mark.parametrize("caller", _CALLERS.values(), ids=list(_CALLERS))
def test_the_handed_model_trains_as_fsdp1(ranks: Any, tmp_path: Path, caller: str) -> None:
    _write_both(tmp_path, {str(tmp_path / "train_utils.py"): _TRAIN_UTILS, str(tmp_path / "main.py"): caller})
    for seen in ranks(_in_each, 2, str(tmp_path), "main", _run_main):
        (losses1, full1), (losses2, full2) = seen["fsdp1"], seen["fsdp2"]
        assert [loss for loss, _ in losses2] == pytest.approx([loss for loss, _ in losses1], rel=1e-5)
        assert [norm for _, norm in losses2] == pytest.approx([norm for _, norm in losses1], rel=1e-5)
        assert full1.keys() == full2.keys()
        assert all(torch.allclose(full1[k], full2[k], rtol=1e-5, atol=1e-7) for k in full1)


_UNFOLLOWED_CALLS = {
    "one call hands the unwrapped module": ("    return losses, save(model)\n", "    return losses, save(model)\n"
                                            "\n\ndef more(model):\n    return train({}, model.module, None, 0, 0)\n"),
    "also read as a module": ("from train_utils import save, train\n",
                              "import train_utils\nfrom train_utils import save, train\nSTEP = train_utils.train\n"),
}  # fmt: skip


@pytest.mark.parametrize("change", _UNFOLLOWED_CALLS.values(), ids=list(_UNFOLLOWED_CALLS))
def test_a_function_not_always_handed_the_model_is_reported_not_followed(tmp_path: Path, change: tuple) -> None:
    """train() is left as written; since some call hands it a wrapped model, its FSDP1 method on `model` is reported,
    though its file names no FSDP (before, it was left unreported)."""
    utils, main = str(tmp_path / "train_utils.py"), str(tmp_path / "main.py")
    program = migrate_program({utils: _TRAIN_UTILS, main: _MAIN.replace(*change)})
    result = program.results[utils]
    assert '        norm = model.clip_grad_norm_(cfg["clip"])\n' in result.migrated
    assert any("clip_grad_norm_" in f.what for f in result.findings), [f.format(utils) for f in result.findings]


_SOMETIMES = {
    "the function also read as a value": ("import train_utils as utils\n",
                                          "import train_utils as utils\nSAVE = utils.save\n"),
    "another call hands it a plain module": ("    return losses, utils.save(model)\n",
                                             "    return losses, utils.save(model)\n\n\ndef plain(net):\n"
                                             "    return utils.save(net)\n"),
}  # fmt: skip


@pytest.mark.parametrize("change", _SOMETIMES.values(), ids=list(_SOMETIMES))
def test_a_state_dict_call_on_a_parameter_sometimes_handed_the_model_is_reported(tmp_path: Path, change: tuple) -> None:
    """save() is not followed, since not every use of it is a call handing it the wrapped model: its
    `model.state_dict()`, FSDP1's full dict for the trainer's call, is reported rather than left silently to give
    each rank's shards under FSDP2 (train() is still followed: every call hands it the model)."""
    utils, main = str(tmp_path / "train_utils.py"), str(tmp_path / "main.py")
    program = migrate_program({utils: _TRAIN_UTILS, main: _MAIN_THROUGH_MODULE.replace(*change)})
    result = program.results[utils]
    assert "    return model.state_dict()  # FSDP1's default type" in result.migrated
    assert "torch.nn.utils.clip_grad_norm_(model.parameters()" in result.migrated
    (finding,) = result.findings
    assert finding.what == "`model.state_dict(...)`" and "not every use of the function" in finding.why


def test_a_caller_that_stays_fsdp1_keeps_the_function_fsdp1(tmp_path: Path) -> None:
    """main.py's LOCAL state-dict block keeps it FSDP1, so the model it hands train() is FSDP1's: train_utils.py is
    left as it is, saying so (its torch.nn.utils clipping would take each rank's shards' norm)."""
    utils, main = str(tmp_path / "train_utils.py"), str(tmp_path / "main.py")
    caller = _MAIN.replace(
        "import FullyShardedDataParallel as FSDP\n", "import FullyShardedDataParallel as FSDP, StateDictType\n"
    )
    caller = caller.replace(
        "    return losses, save(model)\n",
        "    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):\n"
        "        return losses, model.state_dict()\n",
    )
    program = migrate_program({utils: _TRAIN_UTILS, main: caller})
    assert program.results[main].migrated == caller and program.results[main].findings
    result = program.results[utils]
    assert result.migrated == _TRAIN_UTILS
    assert any(f"is handed its model by {main}, which stays FSDP1" in f.what for f in result.findings), [
        f.format(utils) for f in result.findings
    ]


# -- a model handed to a file that stays FSDP1 (apple/ml-4m, wenet): the caller stays with it -----------------------

_KEPT_SAVER = """
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, FullStateDictConfig

from .dist import save_on_main


def save_model_fsdp(args, model, optimizer):
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        save_on_main({"model": model.state_dict()}, args.path)  # (a save the tool cannot see into: the block stays)
"""

_HANDING_TRAINER = """
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import pkg.fsdp_utils as fsdp_utils
from pkg.dist import save_on_main


def main(args):
    model = FSDP(nn.Linear(4, 4), device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    model.clip_grad_norm_(1.0)
    optimizer.step()
    fsdp_utils.save_model_fsdp(args=args, model=model, optimizer=optimizer)
"""


def test_a_model_handed_to_a_file_that_stays_fsdp1_keeps_the_caller_fsdp1(tmp_path: Path) -> None:
    """ml-4m's run_training_4m_fsdp.py hands its wrapped model to `fsdp_utils.save_model_fsdp(model=model, ...)`,
    whose state_dict_type block stays FSDP1 (a save the tool cannot see into). Before, the trainer became fully_shard
    code while the saver stayed FSDP1: FSDP1's block on an FSDP2 model, failing at the first save, hours in. Now the
    trainer stays FSDP1 with the saver, refused as a whole, and says why."""
    sources = {
        "pkg/__init__.py": "",
        "pkg/dist.py": "def save_on_main(obj, path):\n    pass\n",
        "pkg/fsdp_utils.py": _KEPT_SAVER,
        "train.py": _HANDING_TRAINER,
    }
    program = migrate_program(sources)
    saver, trainer = program.results["pkg/fsdp_utils.py"], program.results["train.py"]
    assert not saver.changed and any("stays" in f.why for f in saver.findings)
    assert trainer.migrated == _HANDING_TRAINER
    (refusal,) = [f for f in trainer.findings if f.kind == "refused"]
    assert "`save_model_fsdp` of pkg/fsdp_utils.py, which stays FSDP1" in refusal.what
    # once the saver can be migrated (its save written out), both files migrate together
    mapped = _KEPT_SAVER.replace("save_on_main({", "torch.save({")
    again = migrate_program({**sources, "pkg/fsdp_utils.py": mapped})
    assert again.results["pkg/fsdp_utils.py"].changed and again.results["train.py"].changed
    assert _fsdp1_names(ast.parse(again.results["train.py"].migrated)) == set()
