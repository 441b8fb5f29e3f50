"""Initialisation paths: ignored modules and parameters, meta-device models, param_init_fn, sync_module_states."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import fsdp_legacy
import models
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy.wrap import ModuleWrapPolicy
from fsdp_utils import assert_close, full_params, loss_of, optimizer, train_net_with_ddp
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


def _meta_model(use_param_init_fn: bool) -> nn.Module:
    if use_param_init_fn:
        return models.Net()  # the root's buffer is set by the function
    # torch's default materialisation calls reset_parameters() on every module that holds a tensor
    return nn.Sequential(nn.Linear(3, 5), nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 3)), nn.Linear(3, 2))


def _init_per_module(module: nn.Module) -> None:
    """A param_init_fn as torch's FSDP1 calls it: once for each module of a unit, breadth first."""
    module.to_empty(device="cpu", recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    if "buf" in module._buffers:
        module.buf.copy_(torch.arange(2.0))


def _meta_init(use_param_init_fn: bool) -> None:
    """Meta-device models materialise as torch's FSDP1 materialises them (the same modules given to param_init_fn,
    or reset, in the same order, so random initialisation draws the same values), then train like DDP."""
    full = []
    for lib, wrap, extra in (
        (fsdp_legacy, fsdp_legacy.wrap, {}),
        (torch_fsdp, torch_fsdp.wrap, {"device_id": torch.device("cpu")}),
    ):
        with torch.device("meta"):
            meta = _meta_model(use_param_init_fn)
        classes = {models.Block} if use_param_init_fn else {nn.Sequential}
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = lib.FullyShardedDataParallel(
                meta,
                auto_wrap_policy=wrap.ModuleWrapPolicy(classes),
                param_init_fn=_init_per_module if use_param_init_fn else None,
                **extra,
            )
        with lib.FullyShardedDataParallel.summon_full_params(model):
            full.append(
                {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
            )
        if lib is fsdp_legacy:
            ours = model
    assert full[0].keys() == full[1].keys()
    for name, value in full[0].items():
        assert torch.equal(value, full[1][name]), name
    if use_param_init_fn:  # and it trains like DDP from the same weights
        reference = models.Net()
        with torch.no_grad():
            for name, param in reference.named_parameters():
                param.copy_(full[0][name])
        train_net_with_ddp(ours, reference)
        after = full_params(ours)
        for name, param in reference.named_parameters():
            assert_close(after[name], param.detach(), f"{name} after training")


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
