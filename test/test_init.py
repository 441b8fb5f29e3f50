"""Initialisation paths: ignored modules and parameters, meta-device models, param_init_fn, sync_module_states."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import models
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy.wrap import ModuleWrapPolicy
from fsdp_utils import assert_close, assert_same_params, full_params, loss_of, optimizer, train_net_with_ddp
from harness import run_on_ranks


def _ignored(kind: str, use_orig_params: bool) -> None:
    """Ignored parameters stay regular full-size parameters outside every flat parameter, exactly where torch puts
    them, and training the rest matches torch's FSDP1 shard for shard."""

    def build(fsdp_cls, wrap_cls, **extra):
        torch.manual_seed(0)
        net = models.Net()
        ignored = {"modules": dict(ignored_modules=[net.block]), "states": dict(ignored_states=[net.l1.weight])}[kind]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fsdp_cls(
                net, auto_wrap_policy=wrap_cls({models.Block}), use_orig_params=use_orig_params, **ignored, **extra
            )

    ours = build(FSDP, ModuleWrapPolicy)
    theirs = build(torch_fsdp.FullyShardedDataParallel, torch_fsdp.wrap.ModuleWrapPolicy, device_id=torch.device("cpu"))
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in theirs.named_parameters()]
    our_opt, their_opt = optimizer(ours), optimizer(theirs)
    for step in range(3):
        for model, opt in ((ours, our_opt), (theirs, their_opt)):
            loss_of(model(models.Net.batch(10 * step + dist.get_rank()))).backward()
            opt.step()
            opt.zero_grad()
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert_close(a.detach(), b.detach(), name)


@pytest.mark.parametrize("kind,use_orig_params", [(k, u) for k in ("modules", "states") for u in (False, True)])
def test_ignored_states_match_torch(kind: str, use_orig_params: bool) -> None:
    run_on_ranks(_ignored, 2, kind, use_orig_params)


def _meta_init(use_param_init_fn: bool) -> None:
    with torch.device("meta"):
        meta = models.Net()
    torch.manual_seed(0)
    reference = models.Net()
    if use_param_init_fn:

        def init(module: nn.Module) -> None:
            module.to_empty(device="cpu")
            with torch.no_grad():
                for i, param in enumerate(module.parameters()):
                    param.fill_(0.1 * (i + 1))
                module.buf.copy_(torch.arange(2.0))

        init(reference)
        ours = FSDP(meta, param_init_fn=init, auto_wrap_policy=ModuleWrapPolicy({models.Block}))
    else:
        # Without param_init_fn: to_empty + reset_parameters module by module in pre-order, from the same seed.
        torch.manual_seed(1)
        for module in reference.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        torch.manual_seed(1)
        ours = FSDP(meta, auto_wrap_policy=ModuleWrapPolicy({models.Block}))
        ours.buf.copy_(reference.buf)  # buffers have no reset_parameters: to_empty leaves them uninitialised
    assert_same_params(ours, reference)
    train_net_with_ddp(ours, reference)
    full = full_params(ours)
    for name, param in reference.named_parameters():
        assert_close(full[name], param.detach(), f"{name} after training")


@pytest.mark.parametrize("use_param_init_fn", [False, True])
def test_meta_device_initialisation(use_param_init_fn: bool) -> None:
    run_on_ranks(_meta_init, 2, use_param_init_fn)


def _sync_module_states() -> None:
    torch.manual_seed(0)
    rank0_model = models.Net()
    torch.manual_seed(dist.get_rank())  # every rank starts from different weights
    net = models.Net()
    net.buf.fill_(dist.get_rank() + 5.0)
    ours = FSDP(net, sync_module_states=True, auto_wrap_policy=ModuleWrapPolicy({models.Block}))
    objects = [None]
    if dist.get_rank() == 0:
        objects = [{n: p.detach() for n, p in rank0_model.named_parameters()}]
    dist.broadcast_object_list(objects, src=0)
    full = full_params(ours)
    for name, param in objects[0].items():
        assert_close(full[name], param, name)
    assert torch.equal(ours.buf, torch.full((2,), 5.0)), "buffers come from rank 0 too"


def test_sync_module_states_on_cpu() -> None:
    """Works with CPU parameters, where torch's FSDP1 raises."""
    run_on_ranks(_sync_module_states, 2)
