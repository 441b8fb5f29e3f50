"""clip_grad_norm_ bit for bit with torch's FSDP1: the same model, data and steps on both, and after every backward
the gradients, the returned norm and the clipped gradients must be equal in every bit (a last-bit difference in the
norm drifts every clipped run after it, as verl's PPO updates showed)."""

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap
from parameterized import parameterized
from torch import nn

import fsdp_legacy
import fsdp_legacy.wrap
import models
from fsdp_utils import Config, batch, build_ours, build_torch_fsdp, loss_of
from harness import run_on_ranks


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_bits(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str) -> None:
    assert ours.keys() == theirs.keys(), f"{what}: {sorted(ours)} vs {sorted(theirs)}"
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, f"{what} {name}: {ours[name].dtype} vs {tensor.dtype}"
        assert torch.equal(ours[name], tensor), f"{what} {name}: off torch's FSDP1 by {_diff(ours[name], tensor)}"


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _with_ignored_module(implementation: Any, config: Config) -> nn.Module:
    """models.Net with its last layer ignored (parameters no unit manages, whose gradients stay local)."""
    torch.manual_seed(0)
    model = models.Net()
    device = {"device_id": torch.device("cpu")} if implementation is torch_fsdp else {}
    return implementation.FullyShardedDataParallel(
        model,
        auto_wrap_policy=implementation.wrap.ModuleWrapPolicy({models.Block}),
        ignored_modules=[model.l2],
        use_orig_params=config.use_orig_params,
        **device,
    )


def _clip_side_by_side(config: Config, norm_type: float, max_norm: float) -> None:
    if config.extra.get("ignore_last_layer"):
        ours, theirs = (_with_ignored_module(impl, config) for impl in (fsdp_legacy, torch_fsdp))
    else:
        ours, theirs = build_ours(config)[1], build_torch_fsdp(config)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    clipped = 0
    for step in range(3):
        for model in (ours, theirs):
            loss_of(model(batch(config, step))).float().backward()
        _assert_bits(_grads(ours), _grads(theirs), f"step {step}: gradient before clipping")
        our_norm, their_norm = (model.clip_grad_norm_(max_norm, norm_type) for model in (ours, theirs))
        assert our_norm.dtype == their_norm.dtype, f"norm dtype {our_norm.dtype} vs {their_norm.dtype}"
        assert torch.equal(our_norm, their_norm), f"step {step}: norm {our_norm.item()!r} vs {their_norm.item()!r}"
        clipped += bool(their_norm > max_norm)
        _assert_bits(_grads(ours), _grads(theirs), f"step {step}: gradient after clipping")
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    assert clipped, f"max_norm {max_norm} clipped no step: the test would not see the clipped gradients"
    dist.barrier()


_IGNORED = {"ignore_last_layer": True}
_NORMS = (2.0, 1.0, math.inf, 3.0)
CASES = [
    (f"{strategy}_{'uop' if uop else 'flat'}_p{norm}", Config("transformer", strategy, "block", uop), norm, 0.05)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    for uop in (False, True)
    for norm in _NORMS
] + [
    ("frozen_flat", Config("frozen", "FULL_SHARD", "block", False), 2.0, 0.01),
    ("frozen_uop", Config("frozen", "FULL_SHARD", "block", True), 2.0, 0.01),
    ("bf16_params", Config("transformer", "FULL_SHARD", "block", True, mixed_precision=("bfloat16",)), 2.0, 0.05),
    (
        "bf16_low_precision_grads",
        Config("transformer", "FULL_SHARD", "block", False, mixed_precision=("bfloat16", None, None, True)),
        2.0,
        0.05,
    ),
    *(
        (f"ignored_{'uop' if uop else 'flat'}_p{norm}", Config("net", use_orig_params=uop, extra=_IGNORED), norm, 0.5)
        for uop in (False, True)
        for norm in (2.0, math.inf)
    ),
    ("always_wrap_inf", Config("net", "FULL_SHARD", "always", True), math.inf, 0.05),
]


@parameterized.expand(CASES)
def test_clip_grad_norm_bits_equal_torch_fsdp1(_: str, config: Config, norm_type: float, max_norm: float) -> None:
    run_on_ranks(_clip_side_by_side, 2, config, norm_type, max_norm)
