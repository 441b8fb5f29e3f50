"""Training state as torch's FSDP1 keeps it: every unit IDLE between its forward and its backward (and after a forward
that is never backpropagated), FORWARD_BACKWARD from its forward's start and again from its pre-backward hook, IDLE
after backward; summon_full_params between forwards; torch's own enum members accepted. Oracle: torch's FSDP1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.fsdp._common_utils import TrainingState as TorchTrainingState

import models
from fsdp_utils import Config, batch, build_ours, build_torch_fsdp, loss_of
from harness import run_on_ranks


def _states(model: nn.Module) -> tuple[str, ...]:
    return tuple(unit.training_state.name for unit in type(model).fsdp_modules(model))


def _timeline(model: nn.Module, config: Config) -> list[tuple[str, tuple[str, ...]]]:
    """The units' states at each moment of two training steps and a forward nobody backpropagates."""
    seen: list[tuple[str, tuple[str, ...]]] = [("built", _states(model))]
    block = next(m for m in model.modules() if isinstance(m, models.Block))
    block.register_forward_pre_hook(lambda *_: seen.append(("in forward", _states(model))))
    block.register_full_backward_hook(lambda *_: seen.append(("in backward", _states(model))))
    for step in range(2):
        loss = loss_of(model(batch(config, step)))
        seen.append(("after forward", _states(model)))
        loss.backward()
        seen.append(("after backward", _states(model)))
    model(batch(config, 5))
    seen.append(("after a forward never backpropagated", _states(model)))
    with torch.no_grad():
        model(batch(config, 6))
    seen.append(("after a no_grad forward", _states(model)))
    return seen


def _same_timeline_as_torch(use_orig_params: bool, strategy: str) -> None:
    config = Config("net", strategy, use_orig_params=use_orig_params)
    ours, theirs = build_ours(config)[1], build_torch_fsdp(config)
    assert _timeline(ours, config) == _timeline(theirs, config)


def test_training_state_through_steps_matches_torch() -> None:
    for use_orig_params in (False, True):
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            run_on_ranks(_same_timeline_as_torch, 2, use_orig_params, strategy)


@pytest.mark.parametrize("world_size", [1, 4])
def test_training_state_at_one_and_four_ranks_matches_torch(world_size: int) -> None:
    run_on_ranks(_same_timeline_as_torch, world_size, True, "FULL_SHARD")


def _summon_between_forwards_and_torch_members() -> None:
    config = Config("net")
    results = []
    for model in (build_ours(config)[1], build_torch_fsdp(config)):
        fsdp = type(model)
        model(batch(config, 0))  # never backpropagated
        model._assert_state(TorchTrainingState.IDLE)
        model._assert_state([TorchTrainingState.IDLE, TorchTrainingState.FORWARD_BACKWARD])
        with fsdp.summon_full_params(model):
            full = {n: p.detach().clone() for n, p in model.named_parameters()}
        loss = loss_of(model(batch(config, 1)))
        with fsdp.summon_full_params(model):  # between forward and backward
            pass
        loss.backward()
        model._assert_state(TorchTrainingState.IDLE)
        results.append(({n.replace("_fsdp_wrapped_module.", ""): v for n, v in full.items()}, loss.detach()))
    (ours, our_loss), (theirs, their_loss) = results
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    torch.testing.assert_close(our_loss, their_loss)


def test_summon_between_forwards_and_torch_enum_members() -> None:
    run_on_ranks(_summon_between_forwards_and_torch_members, 2)


def test_torch_members_are_accepted_by_assert_state_on_one_rank() -> None:
    run_on_ranks(_assert_with_torch_members, 1)


def _assert_with_torch_members() -> None:
    _, ours = build_ours(Config("net"))
    ours._assert_state(torch_fsdp._common_utils.TrainingState.IDLE)
    try:
        ours._assert_state(TorchTrainingState.FORWARD_BACKWARD)
    except ValueError as error:
        assert "current state is TrainingState.IDLE" in str(error)
    else:
        raise AssertionError("_assert_state accepted a state the unit is not in")
