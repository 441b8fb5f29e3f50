"""Objects the program checks are FSDP1 units (`assert isinstance(m, FSDP)`, `if isinstance(m, FSDP):`, a name bound
to such a test) take FSDP2's forms of FSDP1's methods only where the text shows the check still holds; elsewhere the
call stays and is reported. A state_dict() inside a gathered block stays the module's own only where every rank
gathers all of it (narrowed.py, methods._gathered_whole)."""

from __future__ import annotations

import pytest

pytest.importorskip("libcst")

from fsdp_legacy.migrate.rewriter import migrate_source

_HEAD = """import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main(net, other):
    model = FSDP(net)
"""


def _findings(body: str) -> list[str]:
    return [f.what for f in migrate_source(_HEAD + body).findings]


@pytest.mark.parametrize(
    "body",
    [
        # rebound after the check
        "    for unit in model.modules():\n        if isinstance(unit, FSDP):\n            unit = other\n"
        "            with unit.summon_full_params(unit):\n                print(unit.state_dict())\n",
        # the check is on another object
        "    assert isinstance(model, FSDP)\n    with other.summon_full_params(other):\n        pass\n",
        # a function defined after the check reads the name later
        "    unit = other\n    assert isinstance(unit, FSDP)\n\n    def later():\n"
        "        with unit.summon_full_params(unit):\n            pass\n\n    return later\n",
        # `or`: the check may have failed
        "    for unit in model.modules():\n        if isinstance(unit, FSDP) or unit is other:\n"
        "            with unit.summon_full_params(unit):\n                pass\n",
        # a loop unpacking into the name after the check (the rebinding check once saw no unpacked names)
        "    for unit in model.modules():\n        assert isinstance(unit, FSDP)\n"
        "        for key, unit in other.items():\n            with unit.summon_full_params(unit):\n"
        "                pass\n",
    ],
    ids=["rebound", "another-object", "closure", "or", "rebound-by-unpacking"],
)
def test_a_check_that_may_not_hold_leaves_the_call_reported(body: str) -> None:
    assert any("summon_full_params" in what for what in _findings(body))


@pytest.mark.parametrize(
    "body",
    [
        "    for unit in model.modules():\n        assert isinstance(unit, FSDP)\n"
        "        with unit.summon_full_params(unit):\n            print(unit.state_dict())\n",
        "    checked = isinstance(other, FSDP)\n    if checked and other.training:\n"
        "        with other.summon_full_params(other):\n            print(other.state_dict())\n",
        "    leaves = [m.module for m in model.modules() if isinstance(m, FSDP) and m.module is not None]\n",
        "    inner = {n: m.module for n, m in model.named_modules() if isinstance(m, FSDP)}\n",
    ],
    ids=["assert", "bound-test", "comprehension-and", "dict-comprehension"],
)
def test_a_check_that_holds_maps_the_unit(body: str) -> None:
    result = migrate_source(_HEAD + body)
    assert result.findings == [], [f.format("t.py") for f in result.findings]
    assert "summon_full_params(" not in result.migrated.replace("# fsdp-legacy migrate: summon_full_params", "")
    assert "FSDP)" not in result.migrated and "m.module" not in result.migrated


def test_state_dict_in_a_block_that_gathers_on_rank0_only_stays_fsdp2s_full_dict() -> None:
    body = (
        "    with FSDP.summon_full_params(model, writeback=False, rank0_only=True):\n"
        "        sd = model.state_dict()\n"
        "    with FSDP.summon_full_params(model, writeback=False):\n"
        "        whole = model.state_dict()\n"
        "    return sd, whole\n"
    )
    out = migrate_source(_HEAD + body).migrated
    # rank 0 alone holds the full parameters in the first block: FSDP1's default dict is still full on every rank
    assert "sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))" in out
    assert "whole = model.state_dict()" in out


def test_a_later_for_of_the_comprehension_rebinding_the_unit_keeps_its_module_attribute() -> None:
    body = "    inner = [m.module for m in model.modules() if isinstance(m, FSDP) for m in [other]]\n"
    assert "[m.module for m in" in migrate_source(_HEAD + body).migrated
