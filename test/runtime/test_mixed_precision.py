"""Mixed precision against torch's FSDP1 with the same MixedPrecision: losses, shards and gradients every step."""

import os

import pytest
import torch
import torch.distributed as dist
from test_parity import _torch_fsdp_parity

import models
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy.buckets import ENV_VAR
from fsdp_utils import Config, build_ours, full_params, loss_of
from harness import run_on_ranks

BF16 = ("bfloat16", "float32", "bfloat16")
FP16 = ("float16", "float16", "float16")
BF16_ALL = ("bfloat16", "bfloat16", "bfloat16")

CASES = [
    (Config("net", "FULL_SHARD", "block", False, mixed_precision=BF16), 2),
    (Config("net", "FULL_SHARD", "block", True, mixed_precision=BF16), 2),
    (Config("net", "SHARD_GRAD_OP", "block", False, mixed_precision=FP16), 2),
    (Config("net", "NO_SHARD", "block", True, mixed_precision=BF16_ALL), 2),
    (Config("transformer", "FULL_SHARD", "block", False, mixed_precision=BF16, no_grad_step=1), 2),
    (Config("transformer", "FULL_SHARD", "block", True, "BACKWARD_POST", mixed_precision=BF16_ALL), 4),
    (Config("transformer", "SHARD_GRAD_OP", "block", True, mixed_precision=FP16), 2),
    (Config("transformer", "NO_SHARD", "block", False, mixed_precision=BF16), 2),
    (Config("net", "FULL_SHARD", "block", False, mixed_precision=("bfloat16", None, None, True)), 2),
    (Config("net", "FULL_SHARD", "always", False, mixed_precision=FP16), 4),
    # (torch's FSDP1 itself fails with keep_low_precision_grads, use_orig_params=True and tied weights.)
    (Config("net", "SHARD_GRAD_OP", "block", True, mixed_precision=("bfloat16", "float32", None, True)), 2),
]


@pytest.mark.parametrize("config,world_size", CASES, ids=[f"{c.name()}_w{w}" for c, w in CASES])
def test_matches_torch_fsdp1(config: Config, world_size: int) -> None:
    run_on_ranks(_torch_fsdp_parity, world_size, config)


def _low_precision_only_while_unsharded(strategy: str) -> None:
    _, ours = build_ours(Config("net", strategy, "block", False, mixed_precision=BF16))
    root, block = FSDP.fsdp_modules(ours)
    out = ours(models.Net.batch(dist.get_rank()))
    assert out.dtype == torch.bfloat16, "compute runs in param_dtype"
    assert root._handle.full_padded.dtype == torch.bfloat16, "only a low-precision unsharded copy exists"
    assert ours.buf.dtype == torch.bfloat16, "buffers in buffer_dtype"
    loss_of(out).backward()
    for unit in (root, block):
        flat = unit._handle.flat_param
        assert flat.dtype == torch.float32 and flat.grad.dtype == torch.float32, "full-precision master and grads"
        assert unit._handle.full_padded.untyped_storage().nbytes() == 0
    assert ours.state_dict()["buf"].dtype == torch.float32, "FULL state dict keeps the buffers' own dtype"
    expected = full_params(ours)
    with FSDP.summon_full_params(ours):
        for name, param in ours.named_parameters():
            assert param.dtype == torch.float32, "summon_full_params shows the full-precision parameters"
            assert torch.equal(param, expected[name]), name


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_full_precision_master_low_precision_compute(strategy: str) -> None:
    run_on_ranks(_low_precision_only_while_unsharded, 2, strategy)


def _full_precision_in_eval(use_orig_params: bool) -> None:
    import os

    reference, ours = build_ours(Config("transformer", "FULL_SHARD", "block", use_orig_params, mixed_precision=BF16))
    x = models.Transformer.batch(dist.get_rank())
    ours.eval()
    reference.eval()
    with torch.no_grad():
        low = ours(x)
        os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
        try:
            full = ours(x)
        finally:
            del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
        expected = reference(x)
    assert full.dtype == torch.float32 and torch.allclose(full, expected, atol=1e-5), "full precision in eval"
    assert low.dtype == torch.bfloat16, "without the switch, eval computes in bf16"
    ours.train()
    out = ours(x)  # training is back to bf16 compute
    loss_of(out).backward()
    assert FSDP.fsdp_modules(ours)[1]._handle.full_padded.dtype == torch.bfloat16


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_full_precision_in_eval_switch(use_orig_params: bool) -> None:
    run_on_ranks(_full_precision_in_eval, 2, use_orig_params)


def _peak_unsharded_bytes(mixed: bool) -> tuple[int, int, int]:
    """(peak bytes of unsharded parameter buffers alive at once during a step, root unit's bf16 bytes, largest
    non-root unit's bf16 bytes), measured by watching every allocation of an unsharded buffer."""
    import fsdp_legacy.handle as handle_module

    config = Config("transformer", "FULL_SHARD", "block", False, mixed_precision=BF16 if mixed else None)
    _, ours = build_ours(config)
    handles = [unit._handle for unit in FSDP.fsdp_modules(ours)]
    peak = 0
    original = handle_module.alloc_storage

    def watching_alloc(tensor: torch.Tensor) -> None:
        nonlocal peak
        original(tensor)
        live = sum(h.full_padded.untyped_storage().nbytes() for h in handles)
        peak = max(peak, live)

    handle_module.alloc_storage = watching_alloc
    # Gather groups (buckets.py) unshard small units ahead by design, up to their budget: off here, so that the
    # bound is that of one unit at a time and measures only what is unsharded in which dtype.
    os.environ[ENV_VAR] = "0"
    try:
        for step in range(2):
            loss_of(ours(models.Transformer.batch(step))).backward()
    finally:
        handle_module.alloc_storage = original
        del os.environ[ENV_VAR]
    sizes = [h.layout.padded_numel * 2 for h in handles]  # bf16 bytes of each unit unsharded
    return peak, sizes[0], max(sizes[1:])


@pytest.mark.parametrize("mixed", [True, False])
def test_only_low_precision_units_are_unsharded(mixed: bool) -> None:
    """Peak unsharded parameter memory <= root + 2 blocks (the current one and one prefetched), counted in bf16: the
    full-precision parameter exists only as the shard. The same bound fails without mixed precision (fp32)."""
    peak, root, block = run_on_ranks(_peak_unsharded_bytes, 2, mixed)[0]
    bound = root + 2 * block
    if mixed:
        assert peak <= bound, f"{peak} bytes unsharded at once > {bound}"
    else:
        assert peak > bound, "the bound must be able to fail: fp32 unsharded units exceed it"
