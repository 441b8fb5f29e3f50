"""Overlap (runtime.py, design.md "Overlap"): every collective runs while one unit computes. On gloo ranks, a log of
the collectives issued and waited on, and of each block's forward and backward compute, shows where each one lies:
a reduction between its issue and its wait spans the next unit's backward; in forward the next unit's all-gather is
issued before this unit computes (what CUDA's run-ahead does by itself), unless backward_prefetch says otherwise.
The values are checked against torch's FSDP1 run on the same ranks."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_legacy.collectives as comm
from fsdp_legacy import BackwardPrefetch
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy.buckets import ENV_VAR
from fsdp_legacy.wrap import ModuleWrapPolicy
from harness import run_on_ranks

N_BLOCKS = 4


class Block(nn.Module):
    """Residual MLP whose hidden width differs per block, so a collective's size tells which unit it is for."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8 * (index + 1))
        self.fc2 = nn.Linear(8 * (index + 1), 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(N_BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _logged_step(model: nn.Module, log: list[tuple[str, int]], steps: int) -> None:
    """Train `steps` steps, logging in the last one: ("ag"|"reduce", unit) when a collective is issued, ("ag
    done"|"reduce done", unit) when it is waited on, ("forward"|"backward", block) when a block computes."""
    units = {m.module if hasattr(m, "module") else m: i for i, m in enumerate(model.module.blocks)}
    by_size = {m._handles[0].layout.padded_numel: i for i, m in enumerate(model.module.blocks)}
    originals = {"all_gather": comm.all_gather, "reduce_scatter": comm.reduce_scatter}

    def logging(name: str, size_of):
        def call(*args, **kwargs):
            unit = by_size.get(size_of(*args))
            work = originals[name](*args, **kwargs)
            if unit is None:  # (the root)
                return work
            log.append((name, unit))

            class Logged:
                def wait(self) -> bool:
                    log.append((name + " done", unit))
                    return work.wait()

            return Logged()

        return call

    hooks = []
    for module, index in units.items():
        hooks.append(module.register_forward_hook(lambda m, a, o, i=index: log.append(("forward", i))))
        hooks.append(module.register_full_backward_hook(lambda m, gi, go, i=index: log.append(("backward", i))))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(steps):
            if step == steps - 1:
                log.clear()  # (the hooks logged the earlier steps' compute)
                comm.all_gather = logging("all_gather", lambda output, shard, group: output.numel())
                comm.reduce_scatter = logging("reduce_scatter", lambda output, full, group: full.numel())
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            model(x.requires_grad_()).backward()
            opt.step()
            opt.zero_grad()
    finally:
        comm.all_gather, comm.reduce_scatter = originals["all_gather"], originals["reduce_scatter"]
        for hook in hooks:
            hook.remove()


def _run(prefetch: str) -> tuple[list[tuple[str, int]], list[torch.Tensor]]:
    os.environ[ENV_VAR] = "0"  # one collective per unit, so that each is seen alone
    try:
        torch.manual_seed(0)
        model = FSDP(Net(), auto_wrap_policy=ModuleWrapPolicy({Block}), backward_prefetch=BackwardPrefetch[prefetch])
        log: list[tuple[str, int]] = []
        _logged_step(model, log, steps=3)
        with FSDP.summon_full_params(model):
            params = [p.detach().clone() for p in model.parameters()]
        return log, params
    finally:
        del os.environ[ENV_VAR]


def _torch_params() -> list[torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    torch.manual_seed(0)
    model = TorchFSDP(Net(), auto_wrap_policy=TorchPolicy({Block}), device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        model(x.requires_grad_()).backward()
        opt.step()
        opt.zero_grad()
    with TorchFSDP.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


def _at(log: list[tuple[str, int]], event: tuple[str, int], after: int = -1) -> int:
    return log.index(event, after + 1)


@pytest.mark.parametrize("prefetch", ["BACKWARD_PRE", "BACKWARD_POST"])
def test_reductions_span_the_next_units_backward(prefetch: str) -> None:
    for log, _ in run_on_ranks(_run, 2, prefetch):
        for unit in range(1, N_BLOCKS):  # backward runs the blocks from the last to the first
            issued = _at(log, ("reduce_scatter", unit))
            assert _at(log, ("backward", unit - 1), issued) < _at(log, ("reduce_scatter done", unit), issued), log


def test_forward_gathers_the_next_unit_before_this_one_computes() -> None:
    for log, _ in run_on_ranks(_run, 2, "BACKWARD_PRE"):
        for unit in range(N_BLOCKS - 1):
            assert _at(log, ("all_gather", unit + 1)) < _at(log, ("forward", unit)), log


def test_no_forward_prefetch_when_backward_prefetch_is_not_pre() -> None:
    """BACKWARD_POST asks for less memory than BACKWARD_PRE: forward then gathers one unit at a time."""
    for log, _ in run_on_ranks(_run, 2, "BACKWARD_POST"):
        for unit in range(N_BLOCKS - 1):
            assert _at(log, ("forward", unit)) < _at(log, ("all_gather", unit + 1)), log


def test_values_equal_torch_fsdp1() -> None:
    ours = run_on_ranks(_run, 2, "BACKWARD_PRE")
    theirs = run_on_ranks(_torch_params, 2)
    for (_, mine), reference in zip(ours, theirs, strict=True):
        assert len(mine) == len(reference)
        for a, b in zip(mine, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
