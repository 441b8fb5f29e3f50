"""Hybrid sharding (4 ranks as 2 x 2) against DDP, and communication hooks against DDP and torch's FSDP1."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from parameterized import parameterized
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import models
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import ShardingStrategy
from fsdp_legacy.wrap import ModuleWrapPolicy
from fsdp_utils import Config, assert_close, assert_same_params, build_ours, build_torch_fsdp, loss_of, optimizer
from harness import run_on_ranks


def _hybrid(strategy: str, groups: str, use_orig_params: bool) -> None:
    torch.manual_seed(0)
    reference = models.Transformer()
    torch.manual_seed(0)
    model = models.Transformer()
    kwargs = dict(
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=use_orig_params,
        auto_wrap_policy=ModuleWrapPolicy({models.TransformerBlock}),
    )
    rank = dist.get_rank()
    if groups == "mesh":
        kwargs["device_mesh"] = init_device_mesh("cpu", (2, 2))  # dim 0 replicates, dim 1 shards
    elif groups == "tuple":
        shard, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
        replicate, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        kwargs["process_group"] = (shard, replicate)
    else:  # from LOCAL_WORLD_SIZE: two "nodes" of two ranks
        os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        ours = FSDP(model, **kwargs)
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = "4"
    assert ours.process_group.size() == 2 and ours._inter_node_pg.size() == 2
    assert ours.params[0].numel() == ours._handle.layout.padded_numel // 2, "sharded over the shard group"
    ddp = DDP(reference)
    our_opt, ddp_opt = optimizer(ours), optimizer(ddp)
    for step in range(3):
        batch = models.Transformer.batch(10 * step + rank)
        for model, opt in ((ours, our_opt), (ddp, ddp_opt)):
            model(batch).backward()
            opt.step()
            opt.zero_grad()
    assert_same_params(ours, reference)


@parameterized.expand(
    [
        ("HYBRID_SHARD", "mesh", False),
        ("HYBRID_SHARD", "tuple", True),
        ("_HYBRID_SHARD_ZERO2", "mesh", True),
        ("_HYBRID_SHARD_ZERO2", "tuple", False),
        ("HYBRID_SHARD", "nodes", False),
    ]
)
def test_hybrid_sharding_matches_ddp(strategy: str, groups: str, use_orig_params: bool) -> None:
    run_on_ranks(_hybrid, 4, strategy, groups, use_orig_params)


def _hybrid_errors() -> None:
    with pytest.raises(ValueError, match="Manual wrapping with ShardingStrategy.HYBRID_SHARD requires explicit"):
        FSDP(models.Net(), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    mesh = init_device_mesh("cpu", (2, 2))
    ours = FSDP(models.Net(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
    with pytest.raises(AssertionError, match="not supported for hybrid strategies"):
        ours.register_comm_hook(None, default_hooks.reduce_scatter_hook)


def test_hybrid_errors() -> None:
    run_on_ranks(_hybrid_errors, 4)


def _default_hooks(strategy: str, use_orig_params: bool) -> None:
    config = Config("transformer", strategy, "block", use_orig_params)
    reference, ours = build_ours(config)
    hook = default_hooks.allreduce_hook if strategy == "NO_SHARD" else default_hooks.reduce_scatter_hook
    calls = []

    def counting_hook(state, *tensors):
        calls.append(tuple(t.shape for t in tensors))
        hook(state, *tensors)

    ours.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), counting_hook)
    with pytest.raises(AssertionError, match="A communication hook is already registered"):
        ours.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), hook)
    with pytest.raises(AssertionError, match="only be called on a root"):
        FSDP.fsdp_modules(ours)[1].register_comm_hook(None, hook)
    ddp = DDP(reference)
    our_opt, ddp_opt = optimizer(ours), optimizer(ddp)
    for step in range(3):
        batch = models.Transformer.batch(10 * step + dist.get_rank())
        for model, opt in ((ours, our_opt), (ddp, ddp_opt)):
            model(batch).backward()
            opt.step()
            opt.zero_grad()
    assert len(calls) == 3 * len(FSDP.fsdp_modules(ours))
    assert all(len(shapes) == (1 if strategy == "NO_SHARD" else 2) for shapes in calls)
    assert_same_params(ours, reference)


@parameterized.expand([("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", False)])
def test_default_comm_hooks_match_ddp(strategy: str, use_orig_params: bool) -> None:
    run_on_ranks(_default_hooks, 2, strategy, use_orig_params)


def _compress_hook(dtype: torch.dtype):
    """torch's fp16/bf16 compression hooks call record_stream, which fails on CPU tensors; this one does the same
    arithmetic (reduce-scatter in low precision, back to the gradient's dtype) on any device."""

    def hook(state: default_hooks.DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
        low = grad.to(dtype).div_(state.gradient_predivide_factor)
        out = torch.empty(output.shape, dtype=dtype)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # before 2.13
        reduce_scatter(out, low, group=state.process_group)
        output.copy_(out.div_(state.gradient_postdivide_factor))

    return hook


def _compression_hook_matches_torch(dtype: str) -> None:
    config = Config("net", "FULL_SHARD", "block", False)
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    hook = _compress_hook(getattr(torch, dtype))
    for model in (ours, theirs):
        model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), hook)
    our_opt, their_opt = optimizer(ours), optimizer(theirs)
    for step in range(3):
        batch = models.Net.batch(10 * step + dist.get_rank())
        for model in (ours, theirs):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss_of(model(batch)).backward()
        for a, b in zip(FSDP.fsdp_modules(ours), torch_fsdp.FullyShardedDataParallel.fsdp_modules(theirs), strict=True):
            assert_close(a._flat_param.grad, b._flat_param.grad, f"step {step} grad")
        for opt in (our_opt, their_opt):
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_compression_hook_matches_torch(dtype: str) -> None:
    run_on_ranks(_compression_hook_matches_torch, 2, dtype)
