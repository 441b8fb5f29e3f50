"""use_orig_params=True writeback as torch's FSDP1 does it: a new tensor assigned to an original parameter's `.data`
(same size) or `.grad` between iterations reaches the flat parameter at the next unshard; a size change raises
torch's error; with mixed precision and with SHARD_GRAD_OP too. Also the names inside forward and no_sync under mixed
precision. Oracle: torch's FSDP1 doing the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import models
from fsdp_utils import Config, batch, build_ours, build_torch_fsdp, clean, loss_of, optimizer
from harness import run_on_ranks

BF16 = ("bfloat16",) * 3


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with type(model).summon_full_params(model):
        return {clean(n): p.detach().float().clone() for n, p in model.named_parameters()}


def _edit_between_steps(model: nn.Module, config: Config, edit: str) -> Any:
    opt = optimizer(model)
    loss_of(model(batch(config, 0))).backward()
    opt.step()
    if edit == "grad":  # accumulate onto user-assigned gradients, no zero_grad
        for p in model.parameters():
            if p.grad is not None:
                p.grad = torch.full_like(p.grad, 0.25)
    else:
        opt.zero_grad()
    for p in model.parameters():
        if edit == "data" and p.numel():
            p.data = p.data * 0.5 + 0.1  # a new tensor, not an in-place edit
        if edit == "size" and p.numel():
            p.data = torch.zeros(p.numel() + 1)
            break
    try:
        losses = []
        for step in range(1, 3):
            loss = loss_of(model(batch(config, step)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    except RuntimeError as error:
        return str(error)
    return losses, _full(model)


def _same_as_torch(strategy: str, mixed: bool, edit: str) -> None:
    config = Config("net", strategy, use_orig_params=True, mixed_precision=BF16 if mixed else None)
    ours = _edit_between_steps(build_ours(config)[1], config, edit)
    theirs = _edit_between_steps(build_torch_fsdp(config), config, edit)
    if edit == "size":
        assert ours == theirs and ours.startswith("Cannot writeback when the parameter shape changes"), (ours, theirs)
        return
    for a, b in zip(ours[0], theirs[0], strict=True):
        torch.testing.assert_close(a, b, msg="losses")
    assert ours[1].keys() == theirs[1].keys()
    # bf16: torch's NO_SHARD all-reduces the gradient accumulated onto an existing float32 one in float32, ours
    # reduces this backward's gradient in the reduce dtype and then adds (compatibility.md): rounding differs.
    tolerance = {"atol": 1e-3, "rtol": 1e-2} if mixed else {}
    for name, value in ours[1].items():
        torch.testing.assert_close(value, theirs[1][name], msg=lambda m, name=name: f"{name}: {m}", **tolerance)


@pytest.mark.parametrize("edit", ["data", "grad", "size"])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_writeback_of_replaced_data_and_grads_as_torch(strategy: str, mixed: bool, edit: str) -> None:
    run_on_ranks(_same_as_torch, 2, strategy, mixed, edit)


@pytest.mark.parametrize("world_size", [1, 4])
def test_writeback_at_one_and_four_ranks_as_torch(world_size: int) -> None:
    # (not "size" at 4 ranks: each rank resizes its first non-empty piece, which at 4 ranks lies in different units
    # on different ranks, so some raise at the root's unshard while the others enter its all-gather; torch's FSDP1
    # does the same: the check is local to each rank)
    run_on_ranks(_same_as_torch, world_size, "FULL_SHARD", False, "data")


def _names_inside_forward(use_orig_params: bool) -> None:
    config = Config("net", use_orig_params=use_orig_params)
    seen = []
    for model in (build_ours(config)[1], build_torch_fsdp(config)):
        names: list[str] = []
        block = next(m for m in model.modules() if isinstance(m, models.Block))
        block.register_forward_pre_hook(
            # Names only: inside forward torch shows unsharded views (uop=True) and a flat parameter without its
            # world-size padding, ours the sharded parameters and the padded flat parameter (compatibility.md).
            lambda *_, model=model, names=names: names.extend(n for n, _ in model.named_parameters())
        )
        loss_of(model(batch(config, 0))).backward()
        seen.append(names)
    assert seen[0] == seen[1], seen


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_named_parameters_inside_forward_as_torch(use_orig_params: bool) -> None:
    run_on_ranks(_names_inside_forward, 2, use_orig_params)


def _no_sync_mixed_precision() -> None:
    config = Config("net", use_orig_params=True, mixed_precision=BF16)
    grads = []
    for model in (build_ours(config)[1], build_torch_fsdp(config)):
        with model.no_sync():
            loss_of(model(batch(config, 0))).backward()
        loss_of(model(batch(config, 1))).backward()
        grads.append({clean(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert grad.dtype == grads[1][name].dtype
        torch.testing.assert_close(grad, grads[1][name], msg=name)


def test_no_sync_with_mixed_precision_and_orig_params_gives_torchs_gradients() -> None:
    run_on_ranks(_no_sync_mixed_precision, 2)
