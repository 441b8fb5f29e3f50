"""Training parity: the same losses and parameters as DDP, and the same shards and gradients as torch's FSDP1.

Each case trains a few SGD-with-momentum steps with different data on every rank, over a matrix of sharding
strategy x wrap policy x use_orig_params x backward/forward prefetch x a no_grad forward mid-training x world size.
"""

import warnings

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_utils import Config, assert_close, batch, build_ours, build_torch_fsdp, full_params, loss_of, optimizer, train
from harness import run_on_ranks

PREFETCHES = ["BACKWARD_PRE", "BACKWARD_POST", None]


def _matrix() -> list[tuple[Config, int]]:
    cases = []
    i = 0
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for uop in (False, True):
            for policy in ("block", "always", "size", "none"):
                cases.append(
                    (
                        Config("net", strategy, policy, uop, PREFETCHES[i % 3], i % 2 == 0, 1 if i % 4 < 2 else None),
                        2,
                    )
                )
                i += 1
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for uop in (False, True):
            cases.append((Config("net", strategy, "block", uop, PREFETCHES[i % 3], uop, 2), 4))
            cases.append((Config("transformer", strategy, "block", uop, PREFETCHES[i % 3], not uop, 1), 2))
            i += 1
    cases += [
        (Config("net", "FULL_SHARD", "block", False), 1),
        (Config("net", "FULL_SHARD", "always", True), 1),
        (Config("transformer", "NO_SHARD", "block", True), 2),
        (Config("transformer", "FULL_SHARD", "block", False, "BACKWARD_POST", True), 4),
        (Config("moe", "FULL_SHARD", "none", False, set_to_none=False), 2),
        (Config("moe", "SHARD_GRAD_OP", "none", True, "BACKWARD_POST", set_to_none=False), 2),
        (Config("frozen", "FULL_SHARD", "block", False), 2),
        (Config("frozen", "FULL_SHARD", "none", True), 2),
    ]
    return cases


MATRIX = _matrix()
IDS = [f"{config.name()}_w{world}" for config, world in MATRIX]


def _ddp_parity(config: Config) -> None:
    reference, ours = build_ours(config)
    ddp = DDP(reference, find_unused_parameters=config.model == "moe")
    ours_losses = train(ours, config)
    ddp_losses = train(ddp, config)
    for step, (a, b) in enumerate(zip(ours_losses, ddp_losses, strict=True)):
        assert_close(a, b, f"loss at step {step}")
    full = full_params(ours)
    for name, param in reference.named_parameters():
        assert_close(full[name], param.detach(), f"parameter {name} after {config.steps} steps")


@pytest.mark.parametrize("config,world_size", MATRIX, ids=IDS)
def test_matches_ddp(config: Config, world_size: int) -> None:
    run_on_ranks(_ddp_parity, world_size, config)


def _grads_by_name(model) -> dict:
    return {name: p.grad for name, p in model.named_parameters()}


def _torch_fsdp_parity(config: Config) -> None:
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    our_units, their_units = FSDP.fsdp_modules(ours), torch_fsdp.FullyShardedDataParallel.fsdp_modules(theirs)
    assert len(our_units) == len(their_units), "a different number of FSDP units than torch's FSDP1"

    def compare(stage: str) -> None:
        for index, (a, b) in enumerate(zip(our_units, their_units, strict=True)):
            if b._flat_param is None:
                assert a._handle is None, f"unit {index}: torch has no flat parameter, we do"
                continue
            ours_flat, theirs_flat = a._handle.flat_param, b._flat_param
            assert_close(ours_flat.detach(), theirs_flat.detach(), f"{stage}: local shard of unit {index}")
            if not config.use_orig_params and theirs_flat.grad is not None:
                assert_close(ours_flat.grad, theirs_flat.grad, f"{stage}: sharded grad of unit {index}")
        if config.use_orig_params:
            ours_grads, theirs_grads = _grads_by_name(ours), _grads_by_name(theirs)
            assert ours_grads.keys() == theirs_grads.keys()
            for name, grad in theirs_grads.items():
                if grad is None:
                    assert ours_grads[name] is None, f"{stage}: {name}.grad should be None as in torch"
                else:
                    assert_close(ours_grads[name], grad, f"{stage}: {name}.grad")

    compare("after construction")
    our_opt, their_opt = optimizer(ours), optimizer(theirs)
    for step in range(config.steps):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            our_loss = loss_of(ours(batch(config, step)))
            their_loss = loss_of(theirs(batch(config, step)))
            our_loss.backward()
            their_loss.backward()
        assert_close(our_loss, their_loss, f"loss at step {step}")
        compare(f"after backward {step}")
        our_opt.step()
        their_opt.step()
        compare(f"after optimizer step {step}")
        our_opt.zero_grad(set_to_none=config.set_to_none)
        their_opt.zero_grad(set_to_none=config.set_to_none)
        if config.no_grad_step == step:
            with torch.no_grad():
                assert_close(ours(batch(config, 99)), theirs(batch(config, 99)), "no_grad forward output")


TORCH_MATRIX = [(c, w) for c, w in MATRIX if c.model != "frozen"]


@pytest.mark.parametrize("config,world_size", TORCH_MATRIX, ids=[f"{c.name()}_w{w}" for c, w in TORCH_MATRIX])
def test_matches_torch_fsdp1(config: Config, world_size: int) -> None:
    run_on_ranks(_torch_fsdp_parity, world_size, config)
