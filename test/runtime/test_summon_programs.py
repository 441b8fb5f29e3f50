"""summon_full_params as programs use it, side by side with torch's FSDP1 on the same model: nn.Module._apply inside
it (verl moves the summoned model with `.to()`), and state dicts taken inside it after in-place edits (verl merges
LoRA adapters into the summoned base weights, then reads the state dict of the wrapped module, its nested units
set to SHARDED_STATE_DICT). Every value ours shows or saves must equal torch's bit for bit."""

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap
from parameterized import parameterized
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

import fsdp_legacy
import fsdp_legacy.wrap
import models
from harness import run_on_ranks


def _wrapped(implementation: Any, use_orig_params: bool) -> nn.Module:
    torch.manual_seed(0)
    return implementation.FullyShardedDataParallel(
        models.Transformer(),
        auto_wrap_policy=implementation.wrap.ModuleWrapPolicy({models.TransformerBlock}),
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )


def _plain(value: Any) -> Any:
    """A state-dict value as comparable tensors: a ShardedTensor's local shards, a tensor as it is."""
    if isinstance(value, ShardedTensor):
        return [shard.tensor for shard in value.local_shards()]
    return value


def _snapshot(value: Any) -> Any:
    return [t.clone() for t in _plain(value)] if isinstance(value, ShardedTensor) else value.clone()


def _assert_bits(ours: dict[str, Any], theirs: dict[str, Any], what: str) -> None:
    assert list(ours) == list(theirs), f"{what}: keys {list(ours)} vs torch's {list(theirs)}"
    for key, value in theirs.items():
        mine, expected = _plain(ours[key]), _plain(value)
        if isinstance(expected, list):
            assert len(mine) == len(expected), f"{what} {key}: {len(mine)} vs {len(expected)} local shards"
            pairs = list(zip(mine, expected, strict=True))
        else:
            pairs = [(mine, expected)]
        for a, b in pairs:
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what} {key}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
            assert torch.equal(a, b), f"{what} {key}: off torch's FSDP1 by {float((a - b).abs().max())}"


def _full(implementation: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    with implementation.FullyShardedDataParallel.summon_full_params(model, writeback=False):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def _merge(model: nn.Module) -> None:
    """A LoRA-style merge: every weight matrix gets a low-rank update, in place."""
    for param in model.parameters():
        if param.dim() == 2:
            rows, cols = param.shape
            a = torch.linspace(-1, 1, rows).unsqueeze(1)
            b = torch.linspace(0, 1, cols).unsqueeze(0)
            param.data.add_(1e-2 * a @ b)


def _apply_inside(implementation: Any, use_orig_params: bool, writeback: bool, convert: str) -> dict[str, Any]:
    fsdp = implementation.FullyShardedDataParallel
    model = _wrapped(implementation, use_orig_params)
    model(models.Transformer.batch(dist.get_rank())).sum().backward()
    if convert == "half":  # torch's FSDP1 cannot take half gradients back into its float flat gradient
        model.zero_grad(set_to_none=True)
    seen: dict[str, Any] = {}
    with fsdp.summon_full_params(model, writeback=writeback):
        getattr(model, convert)() if convert != "to_cpu" else model.to("cpu")
        seen["inside"] = {name: p.detach().clone() for name, p in model.named_parameters()}
        _merge(model)
    seen["after"] = _full(implementation, model)
    seen["flat"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss = model(models.Transformer.batch(10 + dist.get_rank())).sum()
    seen["loss"] = loss.detach()
    return seen


def _state_dict_inside(implementation: Any, use_orig_params: bool, kind: str, of_inner: bool) -> dict[str, Any]:
    fsdp = implementation.FullyShardedDataParallel
    model = _wrapped(implementation, use_orig_params)
    state_dict_type = implementation.StateDictType[kind]
    seen: dict[str, Any] = {}
    with fsdp.state_dict_type(model, state_dict_type):
        with fsdp.summon_full_params(model, writeback=True):
            _merge(model)
            # Copied inside: torch's values may be views of the summoned storage, which the summon's end frees.
            inside = (model.module if of_inner else model).state_dict()
            seen["inside"] = {key: _snapshot(value) for key, value in inside.items()}
    seen["after"] = _full(implementation, model)
    return seen


def _side_by_side(check: Callable[..., dict[str, Any]], *args: Any) -> None:
    observed = {}
    for implementation in (torch_fsdp, fsdp_legacy):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            observed[implementation is fsdp_legacy] = check(implementation, *args)
        dist.barrier()
    ours, theirs = observed[True], observed[False]
    for what, value in theirs.items():
        if isinstance(value, dict):
            _assert_bits(ours[what], value, what)
        else:
            assert torch.equal(ours[what], value), f"{what}: {ours[what]} vs torch's {value}"


def _check(check_name: str, *args: Any) -> None:
    _side_by_side({"apply": _apply_inside, "state_dict": _state_dict_inside}[check_name], *args)


APPLY_CASES = [
    (f"{convert}_{'uop' if uop else 'flat'}_{'writeback' if writeback else 'discard'}", uop, writeback, convert)
    for convert in ("to_cpu", "float", "half")
    for uop in (False, True)
    for writeback in (True, False)
]


@parameterized.expand(APPLY_CASES)
def test_module_apply_inside_summon_as_torch(_: str, use_orig_params: bool, writeback: bool, convert: str) -> None:
    run_on_ranks(_check, 2, "apply", use_orig_params, writeback, convert)


STATE_DICT_CASES = [
    (f"{kind}_{'inner' if inner else 'root'}_{'uop' if uop else 'flat'}", uop, kind, inner)
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
    for inner in (True, False)
    for uop in (False, True)
]


@parameterized.expand(STATE_DICT_CASES)
def test_state_dict_inside_summon_shows_its_edits_as_torch(
    _: str, use_orig_params: bool, kind: str, inner: bool
) -> None:
    run_on_ranks(_check, 2, "state_dict", use_orig_params, kind, inner)
