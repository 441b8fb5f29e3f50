"""Re-entrant and repeated use of units: a unit run several times per iteration, summon_full_params inside forward or
backward, apply() and summon inside summon_full_params. Oracles: DDP for training, torch's FSDP1 for the errors
(same exception type and message)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp_legacy
from fsdp_utils import Config, batch, build_ours, build_torch_fsdp, loss_of
from harness import run_on_ranks


class Reused(nn.Module):
    """One block called three times per forward, twice on branches of the same input."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 3)
        self.block = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
        self.l2 = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        return self.l2(self.block(self.block(h) + self.block(2 * h)))


def _reused_unit_trains_as_ddp(strategy: str, use_orig_params: bool, extra: dict, frozen: bool = False) -> None:
    torch.manual_seed(0)
    net = Reused()
    if frozen:  # a unit without gradients reshards once the backward of every one of its runs is over
        net.block.requires_grad_(False)
    reference = DDP(copy.deepcopy(net))
    model = fsdp_legacy.FullyShardedDataParallel(
        net,
        auto_wrap_policy=fsdp_legacy.wrap.ModuleWrapPolicy({nn.Sequential}),
        sharding_strategy=fsdp_legacy.ShardingStrategy[strategy],
        use_orig_params=use_orig_params,
        **extra,
    )
    losses = []
    for m in (model, reference):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        run = []
        for step in range(3):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            loss = m(x).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.detach())
        losses.append(run)
    for ours, theirs in zip(*losses, strict=True):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize(
    "strategy,use_orig_params,extra",
    [
        ("FULL_SHARD", False, {}),
        ("FULL_SHARD", True, {"forward_prefetch": True}),
        ("SHARD_GRAD_OP", False, {"backward_prefetch": fsdp_legacy.BackwardPrefetch.BACKWARD_POST}),
        ("NO_SHARD", True, {}),
    ],
)
def test_a_unit_run_several_times_per_iteration_trains_as_ddp(
    strategy: str, use_orig_params: bool, extra: dict
) -> None:
    run_on_ranks(_reused_unit_trains_as_ddp, 2, strategy, use_orig_params, extra)


@pytest.mark.parametrize(
    "strategy,use_orig_params", [("FULL_SHARD", False), ("FULL_SHARD", True), ("SHARD_GRAD_OP", True)]
)
def test_a_frozen_unit_run_several_times_per_iteration_trains_as_ddp(strategy: str, use_orig_params: bool) -> None:
    run_on_ranks(_reused_unit_trains_as_ddp, 2, strategy, use_orig_params, {}, True)


def _errors(model: nn.Module, config: Config) -> dict[str, str]:
    fsdp = type(model)
    found: dict[str, str] = {}

    def attempt(name: str, action: Any) -> None:
        try:
            action()
            found[name] = "ok"
        except Exception as error:  # compared with the oracle's
            found[name] = f"{type(error).__name__}: {error}"

    def summon_now(*_: Any) -> None:
        with fsdp.summon_full_params(model):
            pass

    inner = next(m for m in model.modules() if isinstance(m, fsdp) and m is not model)
    handle = inner.module.register_forward_pre_hook(lambda *_: attempt("summon in forward", summon_now))
    out = model(batch(config, 0))
    handle.remove()
    loss = loss_of(out)
    loss.register_hook(lambda grad: attempt("summon in backward", summon_now))
    loss.backward()
    with fsdp.summon_full_params(model):
        attempt("apply inside summon", lambda: model.apply(lambda m: None))
        attempt("summon inside summon", summon_now)
    return found


def _same_errors_as_torch() -> None:
    config = Config("net")
    ours = _errors(build_ours(config)[1], config)
    theirs = _errors(build_torch_fsdp(config), config)
    assert ours == theirs, (ours, theirs)
    assert ours["summon in forward"].startswith("AssertionError") and ours["apply inside summon"].startswith(
        "ValueError"
    ), ours


def test_summon_and_apply_where_they_cannot_run_raise_torchs_errors() -> None:
    run_on_ranks(_same_errors_as_torch, 2)


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_a_unit_run_several_times_at_one_and_four_ranks_trains_as_ddp(world_size: int, frozen: bool) -> None:
    run_on_ranks(_reused_unit_trains_as_ddp, world_size, "FULL_SHARD", True, {}, frozen)


@pytest.mark.parametrize("world_size", [1, 4])
def test_torchs_errors_at_one_and_four_ranks(world_size: int) -> None:
    run_on_ranks(_same_errors_as_torch, world_size)
