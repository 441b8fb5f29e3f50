"""A backward that raises on every rank (an error in a loss, a hook or a custom function; a KeyboardInterrupt) never
runs the end-of-backward callback: autograd drops queued callbacks on error. The next forward ends that backward
(runtime.py, `_end_interrupted_backward`): training and summon_full_params go on.

Oracle: torch's FSDP1 trained on the same batches without the failed step. After the failure the user zeroes the
gradients, as after any failed step; the parameters must then equal the oracle's bit for bit. (torch's own FSDP1
fails this: it keeps the interrupted backward's reduced shards aside and adds them to the next backward's gradients,
past the zero_grad; docs/compatibility.md.)"""

import importlib
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_legacy.buckets import ENV_VAR
from harness import run_on_ranks


class Fails(torch.autograd.Function):
    """Identity whose backward raises: the error comes mid-backward, after the later blocks' gradients are reduced."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("failed in backward")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index == 1 and self.fail:
                x = Fails.apply(x)
        return x.square().mean()


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randn(4, 8, generator=g) for _ in range(4)]


def _train(lib_name: str, strategy: str, use_orig_params: bool, budget: str, fail: bool) -> list[torch.Tensor]:
    """Four steps with `lib_name`'s FSDP1 (ours or torch's: the same arguments); with `fail`, the second one's
    backward raises and the user zeroes the gradients; without, that step is skipped. The full parameters after."""
    lib = importlib.import_module(lib_name)
    policy = importlib.import_module(f"{lib_name}.wrap").ModuleWrapPolicy({Block})
    os.environ[ENV_VAR] = budget
    try:
        torch.manual_seed(0)
        model = lib.FullyShardedDataParallel(
            Net(),
            auto_wrap_policy=policy,
            sharding_strategy=lib.ShardingStrategy[strategy],
            use_orig_params=use_orig_params,
            device_id=torch.device("cpu"),
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        first, failing, *rest = _batches()
        for step, x in enumerate((first, failing, *rest)):
            if step == 1:  # the failure comes in a later iteration than the first
                if fail:
                    model.module.fail = True
                    with pytest.raises(RuntimeError, match="failed in backward"):
                        model(x).backward()
                    model.module.fail = False
                    opt.zero_grad()
                continue
            model(x).backward()
            opt.step()
            opt.zero_grad()
        with lib.FullyShardedDataParallel.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    finally:
        del os.environ[ENV_VAR]


@pytest.mark.parametrize(
    "strategy, use_orig_params, budget, world_size",
    [
        ("FULL_SHARD", False, "0", 2),
        ("FULL_SHARD", False, "1", 2),
        ("FULL_SHARD", True, "1", 2),
        ("SHARD_GRAD_OP", False, "0", 2),
        ("FULL_SHARD", True, "0", 4),
        ("FULL_SHARD", True, "0", 2),
        ("FULL_SHARD", False, "0", 4),
    ],
)
def test_training_goes_on_after_a_backward_that_raised(
    strategy: str, use_orig_params: bool, budget: str, world_size: int
) -> None:
    ours = run_on_ranks(_train, world_size, "fsdp_legacy", strategy, use_orig_params, budget, True)
    theirs = run_on_ranks(_train, world_size, "torch.distributed.fsdp", strategy, use_orig_params, budget, False)
    for mine, reference in zip(ours, theirs, strict=True):
        assert len(mine) == len(reference)
        for a, b in zip(mine, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
