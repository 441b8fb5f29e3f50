"""A graph kept with `retain_graph=True` and backpropagated again: `loss.backward(retain_graph=True)` twice, two losses
of one forward backpropagated one after the other, and `torch.autograd.grad` of an activation before `backward()`.
Each backward ends by resharding every unit; the next one gathers again where autograd needs the parameters, and the
gradients of the backwards add up. And a gradient penalty (WGAN-GP's): `torch.autograd.grad(out, x,
create_graph=True)` builds a graph that saved views of the gathered parameters, so the units stay gathered until the
loss's backward, which goes through that graph, is over.

Oracle: the plain model on each rank, its gradients averaged over the ranks after the backwards (an all-reduce), which
is what data parallelism means here; DDP's reducer expects one backward per forward and is not one. torch's FSDP1
reads the freed storage in the second backward and raises, in all four (docs/compatibility.md, Differences on purpose).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import models
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_utils import MODELS, Config, assert_close, build_ours, build_torch_fsdp, full_params
from harness import run_on_ranks

STEPS = 3


def _backwards(model: torch.nn.Module, pattern: str, x: torch.Tensor) -> None:
    out = model(x)
    if pattern == "twice":
        loss = out.pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()
    elif pattern == "two_losses":
        out.pow(2).mean().backward(retain_graph=True)
        out.abs().mean().backward()
    else:  # an activation's gradient first (a saliency map, a gradient penalty's first part), then backward
        loss = out.pow(2).mean()
        (grad,) = torch.autograd.grad(loss, [out], retain_graph=True)
        assert grad.shape == out.shape
        loss.backward()


def _train_against_the_plain_model(model_name: str, strategy: str, use_orig_params: bool, backwards) -> None:  # type: ignore[no-untyped-def]
    """Ours and the plain model trained alike, `backwards(model, x, step)` making each step's gradients; the plain
    model's are then averaged over the ranks. Ours must end equal to it."""
    config = Config(model_name, strategy, "block", use_orig_params, steps=STEPS)
    reference, ours = build_ours(config)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) for model in (ours, reference)]
    for step in range(STEPS):
        x = MODELS[model_name][1](100 * step + dist.get_rank())
        for model, opt in zip((ours, reference), optimizers, strict=True):
            backwards(model, x, step)
            if model is reference:
                for param in reference.parameters():
                    dist.all_reduce(param.grad)
                    param.grad /= dist.get_world_size()
            opt.step()
            opt.zero_grad()
    full = full_params(ours)
    for name, param in reference.named_parameters():
        assert_close(full[name], param.detach(), name)


def _train(pattern: str, strategy: str, use_orig_params: bool) -> None:
    _train_against_the_plain_model(
        "transformer", strategy, use_orig_params, lambda model, x, step: _backwards(model, pattern, x)
    )


def _penalised_backward(model: torch.nn.Module, x: torch.Tensor) -> None:
    """A critic's loss with WGAN-GP's gradient penalty on its inputs."""
    x = x.detach().requires_grad_(True)
    out = model(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (out.pow(2).mean() + (grad.norm(dim=1) - 1).pow(2).mean()).backward()


def _train_with_gradient_penalty(strategy: str, use_orig_params: bool) -> None:
    def backwards(model: torch.nn.Module, x: torch.Tensor, step: int) -> None:
        _penalised_backward(model, x)
        if step == 1 and isinstance(model, FSDP):  # a penalty only looked at, never backpropagated, before a step
            inputs = x.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(model(inputs).sum(), inputs, create_graph=True)
            assert grad.requires_grad

    _train_against_the_plain_model("net", strategy, use_orig_params, backwards)


def _torch_fsdp1_raises(pattern: str) -> None:
    model = "net" if pattern == "gradient_penalty" else "transformer"
    theirs = build_torch_fsdp(Config(model, "FULL_SHARD", "block", False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="out of bounds for storage of size 0"):
            if pattern == "gradient_penalty":
                _penalised_backward(theirs, models.Net.batch(dist.get_rank()))
            else:
                _backwards(theirs, pattern, models.Transformer.batch(dist.get_rank()))


PATTERNS = ["twice", "two_losses", "activation_grad_first"]


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_retained_graph_backpropagated_again_trains_as_without_fsdp(
    pattern: str, strategy: str, use_orig_params: bool
) -> None:
    run_on_ranks(_train, 2, pattern, strategy, use_orig_params)


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_a_gradient_penalty_trains_as_without_fsdp(strategy: str, use_orig_params: bool) -> None:
    run_on_ranks(_train_with_gradient_penalty, 2, strategy, use_orig_params)


@pytest.mark.parametrize("pattern", [*PATTERNS, "gradient_penalty"])
def test_torch_fsdp1_cannot(pattern: str) -> None:
    run_on_ranks(_torch_fsdp1_raises, 2, pattern)
