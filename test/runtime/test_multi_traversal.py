"""Units run several times per forward, some runs under torch.no_grad() in between (torch's
`test_hooks_multi_traversal`): `x = layer_no_grad(layer_with_grad(x))`, then `with torch.no_grad(): x +=
layer_with_grad(x)`, ten times per forward, every Linear its own unit. Oracles: DDP, and torch's FSDP1 run side by
side."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp_legacy
from harness import run_on_ranks


class MultiTraversal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer_no_grad = nn.Linear(10, 10)
        self.layer_with_grad = nn.Linear(10, 10)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(10):
            x = self.layer_no_grad(self.layer_with_grad(x))
            with torch.no_grad():  # the same unit again, without autograd, between runs that backpropagate
                x += self.layer_with_grad(x)
        return x


def _wrap(fsdp_module, net: nn.Module, strategy: str, use_orig_params: bool, forward_prefetch: bool) -> nn.Module:
    extra = {"device_id": torch.device("cpu")} if fsdp_module is torch.distributed.fsdp else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fsdp_module.FullyShardedDataParallel(
            net,
            auto_wrap_policy=fsdp_module.wrap.ModuleWrapPolicy({nn.Linear}),
            sharding_strategy=fsdp_module.ShardingStrategy[strategy],
            use_orig_params=use_orig_params,
            forward_prefetch=forward_prefetch,
            **extra,
        )


def _losses(model: nn.Module, inp: torch.Tensor) -> list[torch.Tensor]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = model(inp).sum()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _multi_traversal_as_ddp(strategy: str, use_orig_params: bool, inp_requires_grad: bool, forward_prefetch: bool):
    import torch.distributed.fsdp  # torch's FSDP1, the second oracle

    torch.manual_seed(1234)
    net = MultiTraversal()
    inp = torch.randn(8, 10, requires_grad=inp_requires_grad)
    reference = _losses(DDP(copy.deepcopy(net)), inp)
    ours = _losses(_wrap(fsdp_legacy, copy.deepcopy(net), strategy, use_orig_params, forward_prefetch), inp)
    for step, (a, b) in enumerate(zip(ours, reference, strict=True)):
        torch.testing.assert_close(a, b, msg=lambda m, step=step: f"step {step} vs DDP: {m}")
    theirs = _losses(_wrap(torch.distributed.fsdp, net, strategy, use_orig_params, forward_prefetch), inp)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(a, b, msg=lambda m, step=step: f"step {step} vs torch's FSDP1: {m}")


@pytest.mark.parametrize("forward_prefetch", [False, True], ids=["", "fwd_prefetch"])
@pytest.mark.parametrize("inp_requires_grad", [False, True], ids=["", "inp_grad"])
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "uop"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_a_unit_run_with_and_without_grad_in_one_forward_trains_as_ddp(
    strategy: str, use_orig_params: bool, inp_requires_grad: bool, forward_prefetch: bool
) -> None:
    run_on_ranks(_multi_traversal_as_ddp, 2, strategy, use_orig_params, inp_requires_grad, forward_prefetch)


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "uop"])
def test_a_unit_run_with_and_without_grad_at_one_and_four_ranks(world_size: int, use_orig_params: bool) -> None:
    run_on_ranks(_multi_traversal_as_ddp, world_size, "FULL_SHARD", use_orig_params, True, True)
