"""ShardedGradScaler with fp16 mixed precision against torch's ShardedGradScaler and FSDP1, and inf agreement."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler

import models
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import ShardedGradScaler
from fsdp_utils import Config, assert_close, batch, build_ours, build_torch_fsdp, loss_of, optimizer
from harness import run_on_ranks

FP16 = ("float16", "float16", "float16")


def _scaler_matches_torch(use_orig_params: bool) -> None:
    config = Config("net", "FULL_SHARD", "block", use_orig_params, mixed_precision=FP16)
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    runs = [
        (ours, optimizer(ours), ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2)),
        (theirs, optimizer(theirs), TorchScaler("cpu", init_scale=2.0**10, growth_interval=2)),
    ]
    for step in range(4):
        for model, opt, scaler in runs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scaler.scale(loss_of(model(batch(config, step)))).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        assert runs[0][2].get_scale() == runs[1][2].get_scale(), f"scale at step {step}"
    for a, b in zip(FSDP.fsdp_modules(ours), torch_fsdp.FullyShardedDataParallel.fsdp_modules(theirs), strict=True):
        assert_close(a._flat_param.detach(), b._flat_param.detach(), "shard after scaled steps")


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_matches_torch_sharded_grad_scaler(use_orig_params: bool) -> None:
    run_on_ranks(_scaler_matches_torch, 2, use_orig_params)


def _inf_on_one_rank_skips_everywhere() -> None:
    _, ours = build_ours(Config("net", "FULL_SHARD", "block", False))
    opt = optimizer(ours)
    scaler = ShardedGradScaler("cpu", init_scale=4.0)
    before = [p.detach().clone() for p in ours.parameters()]
    scaler.scale(loss_of(ours(models.Net.batch(dist.get_rank())))).backward()
    if dist.get_rank() == 1:
        next(ours.parameters()).grad[0] = float("inf")  # only rank 1's shard overflows
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0, "every rank backs off"
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, ours.parameters(), strict=True)), (
        "every rank skips the step"
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_inf_on_one_rank_skips_the_step_on_all(world_size: int) -> None:
    run_on_ranks(_inf_on_one_rank_skips_everywhere, world_size)
