"""no_sync, clip_grad_norm_, summon_full_params and apply, against DDP, nn.utils.clip_grad_norm_ and torch's FSDP1."""

import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from parameterized import parameterized
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import models
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy.wrap import ModuleWrapPolicy
from fsdp_utils import (
    Config,
    assert_close,
    assert_same_params,
    batch,
    build_ours,
    build_torch_fsdp,
    clean,
    full_params,
    loss_of,
    optimizer,
    train_net_with_ddp,
)
from harness import run_on_ranks

STRATEGIES_X_UOP = [(s, u) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD") for u in (False, True)]


def _batch(step: int, micro: int = 0) -> torch.Tensor:
    return models.Transformer.batch(100 * step + 10 * micro + dist.get_rank())


def _no_sync(strategy: str, use_orig_params: bool) -> None:
    """Two micro-batches under no_sync, one outside: the same parameters as DDP doing the same."""
    config = Config("transformer", strategy, "block", use_orig_params)
    reference, ours = build_ours(config)
    ddp = DDP(reference)
    our_opt, ddp_opt = optimizer(ours), optimizer(ddp)
    for step in range(2):
        for model, opt in ((ours, our_opt), (ddp, ddp_opt)):
            with model.no_sync():
                for micro in range(2):
                    model(_batch(step, micro)).backward()
            model(_batch(step, 2)).backward()
            opt.step()
            opt.zero_grad()
    assert_same_params(ours, reference)


@parameterized.expand([(s, u, 2) for s, u in STRATEGIES_X_UOP] + [("FULL_SHARD", True, 4)])
def test_no_sync_matches_ddp(strategy: str, use_orig_params: bool, world_size: int) -> None:
    run_on_ranks(_no_sync, world_size, strategy, use_orig_params)


def _no_sync_grad_shapes_match_torch(use_orig_params: bool) -> None:
    config = Config("net", "FULL_SHARD", "block", use_orig_params)
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    for model in (ours, theirs):
        with model.no_sync(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_of(model(models.Net.batch(dist.get_rank()))).backward()
    ours_grads = {n: None if p.grad is None else p.grad.shape for n, p in ours.named_parameters()}
    theirs_grads = {n: None if p.grad is None else p.grad.shape for n, p in theirs.named_parameters()}
    assert ours_grads == theirs_grads
    ours_params = {n: p.shape for n, p in ours.named_parameters()}
    assert ours_params == {n: p.shape for n, p in theirs.named_parameters()}, "parameters stay sharded"
    with pytest.raises(RuntimeError, match="on inner FSDP instances is not supported"):
        with ours.block.no_sync():
            pass


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_no_sync_gradients_look_like_torchs(use_orig_params: bool) -> None:
    run_on_ranks(_no_sync_grad_shapes_match_torch, 2, use_orig_params)


def _clip(strategy: str, use_orig_params: bool, norm_type: float) -> None:
    config = Config("transformer", strategy, "block", use_orig_params)
    reference, ours = build_ours(config)
    ddp = DDP(reference)
    our_opt, ddp_opt = optimizer(ours), optimizer(ddp)
    for step in range(2):
        ours(_batch(step)).backward()
        ddp(_batch(step)).backward()
        ours_norm = ours.clip_grad_norm_(0.05, norm_type)
        ddp_norm = nn.utils.clip_grad_norm_(ddp.parameters(), 0.05, norm_type)
        assert ours_norm.dim() == 0 and ours_norm.dtype == torch.float32
        assert_close(ours_norm, ddp_norm, f"total norm at step {step}", rtol=1e-5)
        our_opt.step()
        ddp_opt.step()
        our_opt.zero_grad()
        ddp_opt.zero_grad()
    assert_same_params(ours, reference)
    with pytest.raises(RuntimeError, match="should only be called on the root FSDP instance"):
        FSDP.fsdp_modules(ours)[1].clip_grad_norm_(1.0)


CLIP_CASES = [
    (s, u, p, 2) for (s, u), p in zip(STRATEGIES_X_UOP, (2.0, 1.0, math.inf, 3.0, 2.0, math.inf), strict=True)
]


@parameterized.expand(CLIP_CASES + [("FULL_SHARD", False, 2.0, 4), ("SHARD_GRAD_OP", True, math.inf, 4)])
def test_clip_grad_norm_matches_ddp(strategy: str, use_orig_params: bool, norm_type: float, world_size: int) -> None:
    run_on_ranks(_clip, world_size, strategy, use_orig_params, norm_type)


def _summon(use_orig_params: bool, strategy: str) -> None:
    config = Config("net", strategy, "block", use_orig_params)
    reference, ours = build_ours(config)
    expected = dict(reference.named_parameters())
    # Full parameters under their original names, with the original shapes and values.
    with FSDP.summon_full_params(ours):
        inside = dict(ours.named_parameters())
        assert inside.keys() == expected.keys()
        for name, param in inside.items():
            assert_close(param.detach(), expected[name].detach(), name)
        assert [n for n, _ in ours.named_buffers()] == ["buf"]
        with pytest.raises(AssertionError, match="already unsharding"):
            with FSDP.summon_full_params(ours):
                pass
    outside = {n: p.shape for n, p in ours.named_parameters()}
    # Writeback persists edits; writeback=False discards them.
    with FSDP.summon_full_params(ours, writeback=False):
        for param in ours.parameters():
            param.data.fill_(7.0)
    with FSDP.summon_full_params(ours):
        # As torch documents, NO_SHARD parameters are the real ones, so edits persist regardless of writeback.
        persisted = all((p == 7.0).all() for p in ours.parameters())
        assert persisted == (strategy == "NO_SHARD"), "writeback=False discards edits of sharded parameters"
        for param in ours.parameters():
            param.data.fill_(1.0)
    assert {n: p.shape for n, p in ours.named_parameters()} == outside, "sharded again afterwards"
    assert all((p == 1.0).all() for p in full_params(ours).values()), "writeback=True persists edits"
    # offload_to_cpu works when the compute device is the CPU (torch's FSDP1 crashes there), and rank0_only.
    with pytest.warns(UserWarning, match="offload_to_cpu=True and rank0_only=False"):
        with FSDP.summon_full_params(ours, offload_to_cpu=True):
            assert all(p.shape == expected[n].shape for n, p in ours.named_parameters())
    with FSDP.summon_full_params(ours, writeback=False, rank0_only=True, offload_to_cpu=True):
        full_shapes = all(n in expected and p.shape == expected[n].shape for n, p in ours.named_parameters())
        assert full_shapes == (dist.get_rank() == 0 or strategy == "NO_SHARD")
    with pytest.raises(NotImplementedError, match="writeback=True and rank0_only=True is not supported yet"):
        with FSDP.summon_full_params(ours, rank0_only=True):
            pass
    # Training continues normally after summoning.
    loss_of(ours(models.Net.batch(0))).backward()


@parameterized.expand(
    [(u, s, 2) for u in (False, True) for s in ("FULL_SHARD", "NO_SHARD")] + [(True, "FULL_SHARD", 4)]
)
def test_summon_full_params(use_orig_params: bool, strategy: str, world_size: int) -> None:
    run_on_ranks(_summon, world_size, use_orig_params, strategy)


def _summon_with_grads(use_orig_params: bool) -> None:
    config = Config("net", "FULL_SHARD", "block", use_orig_params)
    reference, ours = build_ours(config)
    ddp = DDP(reference)
    loss_of(ours(models.Net.batch(dist.get_rank()))).backward()
    loss_of(ddp(models.Net.batch(dist.get_rank()))).backward()
    with FSDP.summon_full_params(ours, with_grads=True):
        grads = {n: p.grad for n, p in ours.named_parameters()}
        for name, param in reference.named_parameters():
            assert_close(grads[name], param.grad, f"{name}.grad")
    sharded = [p.grad.shape for p in ours.parameters() if p.grad is not None]
    assert all(len(s) == 1 for s in sharded), "gradients are sharded again afterwards"


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_summon_with_grads(use_orig_params: bool) -> None:
    """with_grads works for use_orig_params=False too, which torch's FSDP1 refuses."""
    run_on_ranks(_summon_with_grads, 2, use_orig_params)


def _summon_inner_only() -> None:
    _, ours = build_ours(Config("net", "FULL_SHARD", "block"))
    with FSDP.summon_full_params(ours.block):
        names = {n: p.shape for n, p in ours.named_parameters()}
    assert names["_fsdp_wrapped_module.block._fsdp_wrapped_module.fc1.weight"] == (5, 5)
    assert names["_fsdp_wrapped_module._flat_param"] == (14,), "the root stays sharded, with prefixed names"
    with FSDP.summon_full_params(ours, recurse=False):
        names = [n for n, _ in ours.named_parameters()]
    assert "l1.weight" in names and "block._flat_param" in names


def test_summon_inner_unit_and_recurse_false() -> None:
    run_on_ranks(_summon_inner_only, 2)


def _apply(use_orig_params: bool) -> None:
    reference, ours = build_ours(Config("net", "FULL_SHARD", "block", use_orig_params))

    def zero_biases(module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and module.bias is not None:
            with torch.no_grad():
                module.bias.zero_()

    ours.apply(zero_biases)
    reference.apply(zero_biases)
    assert_same_params(ours, reference)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_apply_sees_full_parameters(use_orig_params: bool) -> None:
    run_on_ranks(_apply, 2, use_orig_params)


def _batchnorm_without_mixed_precision() -> None:
    model = nn.Sequential(models.Block(), nn.BatchNorm1d(3), nn.Linear(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mixed-precision warning without mixed precision
        ours = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({models.Block}))
    assert [type(u.module).__name__ for u in FSDP.fsdp_modules(ours)] == ["Sequential", "Block"]


def test_batchnorm_is_not_split_out_without_mixed_precision() -> None:
    run_on_ranks(_batchnorm_without_mixed_precision, 2)


def _torch_summon_matches() -> None:
    config = Config("net", "FULL_SHARD", "block", True)
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    with FSDP.summon_full_params(ours), torch_fsdp.FullyShardedDataParallel.summon_full_params(theirs):
        ours_named = {n: p.detach().clone() for n, p in ours.named_parameters()}
        theirs_named = {n: p.detach().clone() for n, p in theirs.named_parameters()}
    assert ours_named.keys() == theirs_named.keys()
    for name in ours_named:
        assert torch.equal(ours_named[name], theirs_named[name]), name


def test_summon_names_and_values_match_torch() -> None:
    run_on_ranks(_torch_summon_matches, 2)


def _activation_checkpointing(style: str, strategy: str, use_orig_params: bool) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.utils.checkpoint import checkpoint

    config = Config("transformer", strategy, "block", use_orig_params)
    reference, ours = build_ours(config)
    if style == "wrapper":  # torch's helper around the blocks inside each FSDP unit
        apply_activation_checkpointing(ours, check_fn=lambda m: isinstance(m, models.TransformerBlock))
    else:  # torch.utils.checkpoint inside the block's forward
        for block in ours.module.blocks:
            inner = block.module
            original = inner.forward
            inner.forward = lambda x, f=original: checkpoint(f, x, use_reentrant=False)
    ddp = DDP(reference)
    our_opt, ddp_opt = optimizer(ours), optimizer(ddp)
    for step in range(3):
        for model, opt in ((ours, our_opt), (ddp, ddp_opt)):
            model(_batch(step)).backward()
            opt.step()
            opt.zero_grad()
    assert_same_params(ours, reference)


@parameterized.expand(
    [
        ("wrapper", "FULL_SHARD", False),
        ("wrapper", "SHARD_GRAD_OP", True),
        ("inside", "FULL_SHARD", True),
        ("inside", "FULL_SHARD", False),
    ]
)
def test_activation_checkpointing_matches_ddp(style: str, strategy: str, use_orig_params: bool) -> None:
    run_on_ranks(_activation_checkpointing, 2, style, strategy, use_orig_params)


def _cpu_offload(strategy: str, use_orig_params: bool) -> None:
    from fsdp_legacy import CPUOffload

    config = Config("transformer", strategy, "block", use_orig_params, extra={"cpu_offload": CPUOffload(True)})
    reference, ours = build_ours(config)
    ddp = DDP(reference)
    our_opt, ddp_opt = optimizer(ours), optimizer(ddp)
    for step in range(3):
        for model, opt in ((ours, our_opt), (ddp, ddp_opt)):
            model(_batch(step)).backward()
            if model is ours:
                assert all(p.device.type == "cpu" for p in ours.parameters())
                ours_norm = ours.clip_grad_norm_(10.0)
            else:
                assert_close(ours_norm, nn.utils.clip_grad_norm_(ddp.parameters(), 10.0), "norm")
            opt.step()
            opt.zero_grad()
    assert_same_params(ours, reference)
    with FSDP.summon_full_params(ours):
        assert_close(dict(ours.named_parameters())["tok.weight"], reference.tok.weight.detach(), "summoned")


@parameterized.expand(
    [
        ("FULL_SHARD", False, 2),
        ("SHARD_GRAD_OP", True, 2),
        ("NO_SHARD", True, 2),
        ("NO_SHARD", False, 2),
        ("FULL_SHARD", True, 4),
    ]
)
def test_cpu_offload_matches_ddp(strategy: str, use_orig_params: bool, world_size: int) -> None:
    """CPUOffload(offload_params=True) runs on a CPU-only machine (torch's FSDP1 fails there)."""
    run_on_ranks(_cpu_offload, world_size, strategy, use_orig_params)


def _user_hooks_and_device_id() -> None:
    """Forward hooks and forward-pre hooks of the user's own modules keep working inside units; device_id is
    accepted as a torch.device."""
    config = Config("net", "FULL_SHARD", "block")
    reference, ours = build_ours(config)
    torch.manual_seed(0)
    explicit = FSDP(models.Net(), device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({models.Block}))
    assert explicit.compute_device == torch.device("cpu")
    seen = []
    for model in (ours.module, reference):
        model.block.fc1.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        model.block.fc2.register_forward_hook(lambda m, args, out: out + 1)
    ours.module.l2.register_forward_hook(lambda m, args, out: seen.append(tuple(m.weight.shape)))
    train_net_with_ddp(ours, reference)
    assert seen == [(2, 3), (2, 3)], "hooks see the unsharded parameters"
    assert_same_params(ours, reference)


def test_user_module_hooks_and_device_id() -> None:
    run_on_ranks(_user_hooks_and_device_id, 2)


def _batchnorm_under_mixed_precision() -> None:
    def build(fsdp, wrap_module, **extra):
        torch.manual_seed(0)
        model = nn.Sequential(models.Block(), nn.BatchNorm1d(3), nn.Linear(3, 2))
        mp = fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fsdp.FullyShardedDataParallel(
                model, auto_wrap_policy=wrap_module.ModuleWrapPolicy({models.Block}), mixed_precision=mp, **extra
            )

    import torch.distributed.fsdp.wrap

    import fsdp_legacy
    import fsdp_legacy.wrap

    ours = build(fsdp_legacy, fsdp_legacy.wrap)
    theirs = build(torch_fsdp, torch.distributed.fsdp.wrap, device_id=torch.device("cpu"))
    assert [type(u.module).__name__ for u in FSDP.fsdp_modules(ours)] == ["Sequential", "Block", "BatchNorm1d"]
    our_opt, their_opt = optimizer(ours), optimizer(theirs)
    for step in range(3):
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step + dist.get_rank()))
        for model, opt in ((ours, our_opt), (theirs, their_opt)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss_of(model(x)).backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(FSDP.fsdp_modules(ours), torch_fsdp.FullyShardedDataParallel.fsdp_modules(theirs), strict=True):
        assert_close(a._flat_param.detach(), b._flat_param.detach(), type(a.module).__name__)


def test_batchnorm_runs_in_full_precision_under_mixed_precision_like_torch() -> None:
    run_on_ranks(_batchnorm_under_mixed_precision, 2)


def _grads_after_summon(use_orig_params: bool) -> None:
    """summon_full_params after zero_grad() must not bring the old gradients back (it did with use_orig_params=True:
    the next backward accumulated onto them)."""
    config = Config("transformer", use_orig_params=use_orig_params)
    grads = []
    for model in (build_ours(config)[1], build_torch_fsdp(config)):
        opt = optimizer(model)
        for step in range(2):
            loss_of(model(batch(config, step))).backward()
            opt.step()
            opt.zero_grad()
        with type(model).summon_full_params(model):
            pass
        assert all(p.grad is None for p in model.parameters())
        loss_of(model(batch(config, 5))).backward()
        grads.append({clean(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert_close(grad, grads[1][name], f"gradient of {name} after summon_full_params")


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_summon_after_zero_grad_keeps_gradients_cleared(use_orig_params: bool) -> None:
    run_on_ranks(_grads_after_summon, 2, use_orig_params)
