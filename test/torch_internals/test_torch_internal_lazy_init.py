"""`FSDP._reset_lazy_init()`, as code calls it, on ours next to torch's FSDP1 (through the switch, the same code):
fairseq's wrapping of units that already ran forward (each ran as a root of its own) into a larger model, resetting
every unit so that the outer one becomes the root; and per-layer work on inner units (pruning tools reset a unit,
then summon its full parameters and change them) before training goes on."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torch_side_by_side import _FSDP, _fsdp, _full_params, _run, _run_ours, _units


def _reset_all(model: nn.Module) -> None:
    for unit in _units(model):
        unit._reset_lazy_init()


def _train(model: nn.Module, steps: int, seed: int) -> list[float]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=generator)).square().sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _wrapped_after_use(reset: bool) -> dict[str, Any]:
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    inner = _FSDP(first)
    before = _train(inner, 1, seed=1)  # its lazy init made it a root
    model = _FSDP(nn.Sequential(inner, second))
    if reset:
        _reset_all(model)
    losses = _train(model, 3, seed=2)
    return {
        "before": before,
        "losses": losses,
        "roots": [unit._is_root for unit in _units(model)],
        "params": _full_params(model),
    }


def test_units_that_ran_wrapped_into_a_larger_model_after_a_reset() -> None:
    for observed in _run(_wrapped_after_use, True):
        assert observed["roots"] == [True, False]


def test_without_the_reset_ours_makes_the_outer_unit_the_root() -> None:
    """torch raises its AssertionError ("Non-root FSDP instance's `_is_root` should not have been set yet ...") when
    the outer unit's first forward finds a unit that ran as a root; ours decides the root again, as the reset does,
    and trains as with the reset (its own lazy initialisation also runs in more places than torch's, such as an inner
    unit's forward under summon_full_params of the root, which TRL's generation takes)."""
    with_reset = _run_ours(_wrapped_after_use, True)
    without = _run_ours(_wrapped_after_use, False)
    assert without == with_reset


def _per_unit_summon() -> dict[str, Any]:
    model = _FSDP(
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
        auto_wrap_policy=_fsdp().wrap.ModuleWrapPolicy({nn.Linear}),
    )
    first = _train(model, 1, seed=1)
    for unit in _units(model)[1:]:
        unit._reset_lazy_init()
        with _fsdp().FullyShardedDataParallel.summon_full_params(unit), torch.no_grad():
            unit.weight.mul_(0.5)  # written back into the shard
    return {"first": first, "halved": _full_params(model), "after": _train(model, 2, seed=2)}


def test_inner_units_reset_and_summoned_one_by_one() -> None:
    _run(_per_unit_summon)
