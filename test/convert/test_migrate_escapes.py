"""`fsdp-legacy migrate` on a model wrapped in a function and returned (`wrapped = FSDP(...)` ... `return wrapped`,
`return wrapped, optim`): its callers' calls on the result are FSDP1's (`state_dict()`: the full state dict), so the
construction is migrated only where the text follows the result to names: `model = build(...)`, or, for a returned
tuple, `model, optim = build(...)` (`self.model, self.optim = ...` too). Any other escape (a dict, a list, a nested
tuple, handed to a call, a caller that does not unpack it, a block, a yield) keeps the file as it is, byte for byte,
with a finding at the construction. The oracle for the followed tuple is torch's FSDP1 running the original beside the
migrated program at 2 ranks: the same units, full state dict through the caller's name, and losses."""

from __future__ import annotations

import ast
from typing import Any

import pytest
import torch

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
    def __init__(self, width):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def forward(self, x):
        return x + self.inner(x)


def build(width):
    torch.manual_seed(0)
    net = nn.Sequential(Block(width), Block(width), nn.Linear(width, 1))
    wrapped = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), use_orig_params=True)
    optim = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    return wrapped, optim


def units(width):
    model, _ = build(width)
    return len(FSDP.fsdp_modules(model)), model.state_dict()  # FSDP1's default: the full state dict on every rank


class Trainer:
    def __init__(self, width):
        self.width = width
        self.model, self.optim = build(width)

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
"""


def test_the_returned_tuple_is_followed_to_the_names_its_callers_unpack() -> None:
    result = migrate_source(_PROGRAM)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert _fsdp1_names(ast.parse(out)) == set()
    assert (
        "    fully_shard(net)\n    wrapped = net\n    optim = torch.optim.Adam(wrapped.parameters(), lr=0.01)\n"
        "    return wrapped, optim\n"
    ) in out
    # the name at the model's place is the wrapped model: FSDP1's default type, FULL on every rank
    assert "return len([m for m in model.modules() if isinstance(m, FSDPModule)]), get_model_state_dict(model, " in out
    assert "        self.model.set_requires_gradient_sync(False)  # was: with self.model.no_sync():" in out
    assert "        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)" in out
    again = migrate_source(out)  # a second pass finds nothing left
    assert (again.migrated, again.findings) == (out, [])


def _side_by_side(original: str, migrated: str) -> dict[str, Any]:
    """On a rank: each program's units and full state dict through the caller's name, and 4 steps of its Trainer."""
    programs = []
    for name, source in (("fsdp1.py", original), ("fsdp2.py", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, name, "exec"), namespace)
        programs.append(namespace)
    units = [p["units"](8) for p in programs]
    losses = []
    for program in programs:
        trainer = program["Trainer"](8)
        losses.append([trainer.step(s) for s in range(4)])
    return {"units": units, "losses": losses}


def test_the_followed_tuple_trains_as_fsdp1(ranks: Any) -> None:
    migrated = migrate_source(_PROGRAM).migrated
    for seen in ranks(_side_by_side, 2, _PROGRAM, migrated):
        (count1, full1), (count2, full2) = seen["units"]
        assert count1 == count2 == 3  # the root and its two Blocks
        assert full1.keys() == full2.keys() and all(torch.equal(full1[k], full2[k]) for k in full1)
        fsdp1, fsdp2 = seen["losses"]
        assert fsdp2 == pytest.approx(fsdp1, rel=1e-5)  # (clipping sums the norm in another order)


# -- what stays: an escape the text does not follow -----------------------------------------------------------------

_BUILDER = """
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def build(width):
    BIND
    optim = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    RETURN


def main():
    CALLER
    model.clip_grad_norm_(1.0)
    other = FSDP(nn.Linear(2, 2))  # (it would migrate: the file would change)
    return model.state_dict(), other.state_dict()
EXTRA"""

_PLAIN = {
    "bind": "wrapped = FSDP(nn.Linear(width, width))",
    "return": "return wrapped, optim",
    "caller": "model, optim = build(4)",
    "extra": "",
}
# a function of the file the model is handed to, whose result is returned on
_KEEP = "\n\ndef keep(module):\n    return module\n"
_LOSS = "\n\ndef loss(module):\n    return module(torch.ones(4)).sum().item()\n"

# how -> (what changes in the plain program, a word of the finding's `why` at `wrapped = FSDP(...)`)
_STAYS = {
    "in a dict": (
        {
            "return": "return {'model': wrapped, 'optim': optim}",
            "caller": "built = build(4)\n    model = built['model']",
        },
        "returns `wrapped` in `{'model': wrapped, 'optim': optim}`",
    ),
    "in a list": ({"return": "return [wrapped, optim]"}, "returns `wrapped` in `[wrapped, optim]`"),
    "in a nested tuple": (
        {"return": "return (wrapped, 1), optim", "caller": "(model, _), optim = build(4)"},
        "returns `wrapped` in `(wrapped, 1), optim`",
    ),
    "handed to a call": (
        {"return": "return dict(model=wrapped)", "caller": "model = build(4)['model']"},
        "returns `wrapped` in `dict(model=wrapped)`",
    ),
    "twice in the tuple": ({"return": "return wrapped, wrapped"}, "returns `wrapped` in `wrapped, wrapped`"),
    "the tuple not unpacked": (
        {"caller": "pair = build(4)\n    model = pair[0]"},
        "is used other than as `model, _ = build(...)`",
    ),
    "unpacked into three": (
        {"caller": "model, optim, extra = build(4)"},
        "is used other than as `model, _ = build(...)`",
    ),
    "unpacked with a star": ({"caller": "model, *rest = build(4)"}, "is used other than as `model, _ = build(...)`"),
    "the tuple passed on": (
        {"caller": "model, optim = build(4)\n    train(build(4))"},
        "is used other than as `model, _ = build(...)`",
    ),
    "returned alone, used in an expression": (
        {"return": "return wrapped", "caller": "model = build(4)\n    print(build(4).state_dict())"},
        "is used other than as `name = build(...)`",
    ),
    "handed to a function of the file that returns it": (
        {"return": "return keep(wrapped), optim", "caller": "model, optim = build(4)", "extra": _KEEP},
        "returns `wrapped` in `keep(wrapped), optim`",
    ),
    "bound in a block": (
        {"bind": "if width:\n        wrapped = FSDP(nn.Linear(width, width))"},
        "`wrapped` is bound inside a block of `build`, which returns it",
    ),
    "yielded": (
        {"return": "yield wrapped", "caller": "model = next(build(4))"},
        "`build` yields `wrapped`",
    ),
}


def _builder(**changes: str) -> str:
    source = _BUILDER
    for key, value in {**_PLAIN, **changes}.items():
        source = source.replace(key.upper(), value)
    return source


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {
            "caller": "model, optim = make()",
            "extra": "\n\ndef make():\n    built, opt = build(4)\n    return built, opt\n",
        },
        {
            "caller": "_, model, optim = make()",
            "extra": f"\n\ndef make():\n    built, opt = build(4)\n    return loss(built), built, opt\n{_LOSS}",
        },
    ],
    ids=["unpacked by its caller", "returned on by another function", "beside what a function of the file gives"],
)
def test_the_plain_tuple_is_followed(changes: dict[str, str]) -> None:
    result = migrate_source(_builder(**changes))
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    assert "    wrapped = nn.Linear(width, width)\n    fully_shard(wrapped)\n" in result.migrated
    assert "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)" in result.migrated
    assert "return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)), " in result.migrated


@pytest.mark.parametrize(("changes", "why"), _STAYS.values(), ids=list(_STAYS))
def test_an_escape_the_text_does_not_follow_keeps_the_file(changes: dict[str, str], why: str) -> None:
    """Mapped, the construction would become FSDP2's and the calls on what the callers get would stay as written
    (`state_dict()`: each rank's DTensor shards where FSDP1 gave the full state dict): the file stays as it is, the
    construction reported with why, and a second run over it reports the same."""
    source = _builder(**changes)
    result = migrate_source(source)
    assert result.migrated == source
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "wrapped = FSDP(" in text)
    found = [f for f in result.findings if f.line == line]
    assert [f.kind for f in found] == ["unmapped", "refused"], [f.format("x.py") for f in result.findings]
    assert found[0].what == "`wrapped = FSDP(...)`" and why in found[0].why, found[0].format("x.py")
    assert "would be left as written under FSDP2" in found[0].why
    again = migrate_source(result.migrated)
    assert (again.migrated, again.findings) == (source, result.findings)
