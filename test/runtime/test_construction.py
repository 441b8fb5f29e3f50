"""Construction as torch's FSDP1: its ValueErrors and warnings for invalid arguments, stand-in process groups, ignored
modules under auto-wrapping, and optimizers applied in backward. Oracle: torch's FSDP1 on the same input (same
exception type and message, same warnings, same wrapped structure, same parameters after training)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import fsdp_legacy
import models
from fsdp_utils import Config, batch, build_ours, build_torch_fsdp, loss_of
from harness import run_on_ranks

TORCH_EXTRA = {"device_id": torch.device("cpu")}


def _attempt(build: Callable[[], Any]) -> tuple[str, list[str]]:
    """(the exception's type and message, or "ok"; the warnings' messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            build()
            outcome = "ok"
        except Exception as error:  # the oracle's outcome is compared as it is
            outcome = f"{type(error).__name__}: {error}"
    # Up to the module repr: torch's top-level-ignored warning shows the last module it iterated over (a bug; ours
    # shows the root), the rest is the same text.
    messages = sorted(
        str(w.message).split(": ")[0]
        for w in caught
        if "NO_SHARD" not in str(w.message) and "deprecated" not in str(w.message)
    )
    return outcome, messages


def _meta_net() -> nn.Module:
    with torch.device("meta"):
        return models.Net()


def _cases(lib: Any, extra: dict) -> dict[str, tuple[str, list[str]]]:
    fsdp = lib.FullyShardedDataParallel
    cases: dict[str, Callable[[], Any]] = {}
    cases["param_init_fn not callable"] = lambda: fsdp(_meta_net(), param_init_fn=3, **extra)
    net = models.Net()
    inner = fsdp(net.block, **extra)
    cases["ignored_modules holds an FSDP module"] = lambda: fsdp(net, ignored_modules=[inner], **extra)
    mixed = models.Net()
    cases["ignored_states mixes modules and parameters"] = lambda: fsdp(
        mixed, ignored_states=[mixed.l1, mixed.l2.weight], **extra
    )
    params_as_modules = models.Net()
    cases["ignored_modules holds a parameter"] = lambda: fsdp(
        params_as_modules, ignored_modules=[params_as_modules.l2.weight], **extra
    )
    root = models.Net()
    cases["the root itself ignored"] = lambda: fsdp(root, ignored_modules=[root], **extra)
    cases["ModuleList root"] = lambda: fsdp(nn.ModuleList([nn.Linear(2, 2)]), **extra)
    cases["ModuleDict root"] = lambda: fsdp(nn.ModuleDict({"a": nn.Linear(2, 2)}), **extra)
    return {name: _attempt(build) for name, build in cases.items()}


def _same_errors_and_warnings() -> None:
    ours, theirs = _cases(fsdp_legacy, {}), _cases(torch_fsdp, TORCH_EXTRA)
    for name, outcome in ours.items():
        assert outcome == theirs[name], f"{name}: ours {outcome}, torch {theirs[name]}"


def test_invalid_arguments_raise_and_warn_as_torch() -> None:
    run_on_ranks(_same_errors_and_warnings, 1)


def _wrapped_structure(lib: Any, extra: dict, process_group: Any = None) -> list[tuple[str, int]]:
    torch.manual_seed(0)
    net = models.Transformer()
    policy = lib.wrap.ModuleWrapPolicy({models.TransformerBlock, nn.LayerNorm})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = lib.FullyShardedDataParallel(
            net, process_group=process_group, auto_wrap_policy=policy, ignored_modules=[net.blocks[1]], **extra
        )
    fsdp = lib.FullyShardedDataParallel
    return [
        (name.replace("_fsdp_wrapped_module.", ""), unit._flat_param.numel() if unit._flat_param is not None else 0)
        for name, unit in model.named_modules()
        if isinstance(unit, fsdp)
    ]


def _ignored_under_auto_wrapping() -> None:
    assert _wrapped_structure(fsdp_legacy, {}) == _wrapped_structure(torch_fsdp, TORCH_EXTRA)


def test_ignored_modules_under_auto_wrapping_are_skipped_as_torch_skips_them() -> None:
    run_on_ranks(_ignored_under_auto_wrapping, 2)


def _unit_plans_against_torch() -> None:
    """The one walk of unit_plan.py finds, for every unit, the parameters torch's FSDP1 flattens, in its order (tied
    head once, ignored block and nested units left out), and sync_module_states gives every rank rank 0's values."""
    from fsdp_legacy.flat_param import iter_unit_modules
    from fsdp_legacy.unit_plan import plan_unit

    def units(lib: Any, extra: dict) -> list[tuple[str, tuple[str, ...]]]:
        torch.manual_seed(
            torch.distributed.get_rank()
        )  # values differ per rank: our sync_module_states must fix them (torch refuses it on CPU)
        net = models.Transformer()
        policy = lib.wrap.ModuleWrapPolicy({models.TransformerBlock, nn.LayerNorm})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = lib.FullyShardedDataParallel(
                net,
                auto_wrap_policy=policy,
                ignored_modules=[net.blocks[1]],
                sync_module_states=lib is fsdp_legacy,
                **extra,
            )
            state = {k: v.clone() for k, v in model.state_dict().items()} if lib is fsdp_legacy else {}
        return [
            (name, tuple(unit._flat_param._fqns) if unit._flat_param is not None else ())
            for name, unit in model.named_modules()
            if isinstance(unit, lib.FullyShardedDataParallel)
        ], state

    ours, state = units(fsdp_legacy, {})
    theirs, _ = units(torch_fsdp, TORCH_EXTRA)
    assert ours == theirs
    gathered = [None] * torch.distributed.get_world_size()
    synced = {k: v.sum().item() for k, v in state.items() if "blocks.1." not in k}  # (ignored: left as they are)
    torch.distributed.all_gather_object(gathered, synced)
    assert len(synced) > 20 and all(sums == gathered[0] for sums in gathered)

    # The plan itself: references in nn.Module order, a tied parameter once per reference, grouped by dtype.
    net = models.Transformer()
    net.norm.half()
    plan = plan_unit(net, lambda m: m is net.blocks[1], set(), {}, None, False)
    expected = [
        (name, param)
        for module_name, module in iter_unit_modules(net, lambda m: m is net.blocks[1])
        for name, param in ((f"{module_name}.{n}" if module_name else n, p) for n, p in module._parameters.items())
        if param is not None
    ]
    assert [(ref.fqn, ref.param) for ref in plan.references] == expected
    assert [ref.fqn for ref in plan.references].count("head.weight") == 1 and plan.references[-1].fqn == "head.weight"
    assert [{ref.param.dtype for ref in group} for group in plan.dtype_groups] == [{torch.float32}, {torch.float16}]
    assert list(plan.registration_order) == [name for name, _ in expected]


def test_unit_plans_find_what_torch_flattens() -> None:
    run_on_ranks(_unit_plans_against_torch, 2)


class StandInGroup:
    """What torch's FSDP1 needs of a process group to build the wrapped structure: rank() and size()."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stand_in_process_group_builds_the_structure_without_init_process_group(rank: int) -> None:
    assert not torch.distributed.is_initialized()  # the pytest process itself has no process group
    group = StandInGroup(rank, 2)
    ours = _wrapped_structure(fsdp_legacy, {}, group)
    assert ours == _wrapped_structure(torch_fsdp, TORCH_EXTRA, group)
    assert any(numel for _, numel in ours)


def _optimizer_in_backward(use_orig_params: bool) -> None:
    from torch.distributed.optim import _apply_optimizer_in_backward

    config = Config("net", use_orig_params=use_orig_params)
    outcomes = []
    for model in (build_ours(config)[1], build_torch_fsdp(config)):
        _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1, "momentum": 0.9})
        try:
            for step in range(3):
                loss_of(model(batch(config, step))).backward()
                assert all(p.grad is None for p in model.parameters()), "stepped and dropped in backward"
        except RuntimeError as error:
            outcomes.append(str(error))
            continue
        with type(model).summon_full_params(model):
            outcomes.append(
                {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
            )
    ours, theirs = outcomes
    if use_orig_params:
        assert isinstance(ours, dict) and isinstance(theirs, dict)
        for name, value in ours.items():
            torch.testing.assert_close(value, theirs[name], msg=name)
    else:
        assert ours == theirs == "FSDP optimizer in backward only supported with use_orig_params=True!"


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_optimizer_in_backward_as_torch(use_orig_params: bool) -> None:
    run_on_ranks(_optimizer_in_backward, 2, use_orig_params)


@pytest.mark.parametrize("world_size", [2, 4])
def test_invalid_arguments_at_two_and_four_ranks(world_size: int) -> None:
    run_on_ranks(_same_errors_and_warnings, world_size)


@pytest.mark.parametrize("world_size", [1, 4])
def test_ignored_modules_and_optimizer_in_backward_at_one_and_four_ranks(world_size: int) -> None:
    run_on_ranks(_ignored_under_auto_wrapping, world_size)
    run_on_ranks(_optimizer_in_backward, world_size, True)
