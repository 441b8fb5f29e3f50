"""Activation checkpointing inside an FSDP unit's forward, as transformers' `gradient_checkpointing_enable()` puts it
(the decoder layer's own `__call__` runs `torch.utils.checkpoint.checkpoint`, and the layer is the unit), and as
`checkpoint_wrapper` applied after wrapping does: the part of the unit under checkpoint is recomputed during backward,
from the parameters' attributes the pre-backward hook sets. Both reentrant and non-reentrant, every strategy, uop both
ways. Oracles: torch's FSDP1 (losses and gradients after each backward) and DDP (parameters after training).

A regression test: the pre-backward hook made the attributes' views under autograd's grad mode during backward (off),
so a reentrant recompute gave the unit's parameters no gradient at all, silently, and a non-reentrant one raised
CheckpointError ("A different number of tensors was saved") wherever an op saves an input only when the other one
requires grad (the `weight * x` of an RMSNorm).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

import fsdp_legacy
from fsdp_utils import assert_close, full_params
from harness import run_on_ranks

D, STEPS = 8, 3


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Layer(nn.Module):
    """A decoder layer in the manner of transformers' GradientCheckpointingLayer: when checkpointing is on, its own
    call recomputes its body in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D, bias=False)
        self.use_reentrant: bool | None = None  # None: no checkpointing

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_reentrant is None:
            return self.body(x)
        return checkpoint(self.body, x, use_reentrant=self.use_reentrant)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.norm = RMSNorm()
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def _models(how: str, strategy: str, use_orig_params: bool) -> list[nn.Module]:
    """Ours, torch's FSDP1 and DDP over the same Decoder, with checkpointing applied `how`."""
    import torch.distributed.fsdp as torch_fsdp

    built = []
    for library, extra in ((fsdp_legacy, {}), (torch_fsdp, {"device_id": torch.device("cpu")}), (None, {})):
        torch.manual_seed(0)
        model = Decoder()
        if how in ("reentrant", "non_reentrant"):  # inside the layer's own forward
            for layer in model.layers:
                layer.use_reentrant = how == "reentrant"
        if library is None:
            if how.startswith("wrapper"):
                _wrap_layers(model, how)
            built.append(nn.parallel.DistributedDataParallel(model))
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = library.FullyShardedDataParallel(
                model,
                auto_wrap_policy=library.wrap.ModuleWrapPolicy({Layer}),
                sharding_strategy=library.ShardingStrategy[strategy],
                use_orig_params=use_orig_params,
                **extra,
            )
        if how.startswith("wrapper"):  # checkpoint_wrapper after wrapping, as Accelerate and Lightning apply it
            _wrap_layers(wrapped, how)
        built.append(wrapped)
    return built


def _wrap_layers(model: nn.Module, how: str) -> None:
    impl = CheckpointImpl.REENTRANT if how == "wrapper_reentrant" else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda module: isinstance(module, Layer),
    )


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """The gradient of each parameter the model shows (flat parameters' local shards, or with use_orig_params the
    original parameters' pieces on this rank), by name."""
    return {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.numel() > 0
    }


def _train_and_compare(how: str, strategy: str, use_orig_params: bool) -> None:
    ours, theirs, ddp = _models(how, strategy, use_orig_params)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) for model in (ours, theirs, ddp)]
    for step in range(STEPS):
        losses = []
        for model in (ours, theirs, ddp):
            loss = model(_batch(step)).pow(2).sum()
            loss.backward()
            losses.append(loss.detach())
        assert_close(losses[0], losses[1], f"step {step}: loss vs torch FSDP1")
        assert_close(losses[0], losses[2], f"step {step}: loss vs DDP")
        mine, torch_s = _grads(ours), _grads(theirs)
        assert list(mine) == list(torch_s) and len(mine) >= 4
        for name, grad in mine.items():
            assert grad is not None and torch_s[name] is not None, f"step {step}: {name} has no gradient"
            assert_close(grad, torch_s[name], f"step {step}: {name}'s gradient vs torch FSDP1")
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    full = full_params(ours)
    for name, param in ddp.module.named_parameters():
        name = name.replace("._checkpoint_wrapped_module", "")
        assert_close(full[name], param.detach(), f"{name} after training vs DDP")


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("how", ["reentrant", "non_reentrant"])
def test_checkpoint_in_the_units_forward_trains_as_torch_fsdp1_and_ddp(
    how: str, strategy: str, use_orig_params: bool
) -> None:
    run_on_ranks(_train_and_compare, 2, how, strategy, use_orig_params)


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("how", ["wrapper_reentrant", "wrapper_non_reentrant"])
def test_checkpoint_wrappers_inside_units_train_as_torch_fsdp1_and_ddp(how: str, use_orig_params: bool) -> None:
    run_on_ranks(_train_and_compare, 2, how, "FULL_SHARD", use_orig_params)
