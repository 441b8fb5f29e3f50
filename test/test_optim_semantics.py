"""Optimizer-state edge cases of torch's FSDP1 (issue 20, parts 1-6), on a nested model wrapped by hand whose root is
not FSDP (parameters beside the units), as torch's own tests build it: optimizers whose parameter order differs across
ranks, parameters outside FSDP, a nonzero rank missing states, dicts without `param_groups`, re-keying to names, and
full dicts loaded into another wrapping or half the world. Oracle: torch's FSDP1 running the same steps on the same
ranks, output key for key (and the optimizer's own state where torch's tests check that)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

import fsdp_legacy
from harness import run_on_ranks

LIBS = (fsdp_legacy, torch_fsdp)


class Bias(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class Block(nn.Module):
    """weight, then two biases with a ReLU between (so their gradients differ)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out))
        self.bias_module0, self.bias_module1 = Bias(n_out), Bias(n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bias_module1(torch.relu(self.bias_module0(x @ self.weight)))


class Nested(nn.Module):
    """A root that is never FSDP: `bias` and `block0` stay beside the units that `wrap` makes."""

    def __init__(self) -> None:
        super().__init__()
        self.block0, self.block1 = Block(5, 3), Block(3, 7)
        self.bias = nn.Parameter(torch.randn(5))
        self.block2 = nn.Sequential(Block(7, 9), Block(9, 9), Block(9, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.block1(torch.relu(self.block0(x))))
        return torch.relu(self.block2(x)) + self.bias

    def group0(self) -> list[nn.Parameter]:  # not the model's order, and without `bias`
        return list(self.block1.parameters())

    def group1(self) -> list[nn.Parameter]:
        return list(self.block2.parameters()) + list(self.block0.parameters())


def nested_model(
    lib: Any,
    wrap: str = "wrap",
    group: Any = None,
    uop: bool = False,
    ignore: bool = False,
    unmanaged: str | None = None,
) -> nn.Module:
    """Nested wrapped by hand ("wrap": units inside block1 and block2; "wrap_alt": inside block0 only); `unmanaged`
    registers one more parameter on the root ("root") or inside a unit ("unit") before wrapping."""
    torch.manual_seed(0)
    model = Nested()
    if unmanaged is not None:
        owner = model if unmanaged == "root" else model.block2[2]
        owner.register_parameter("unmanaged_param", nn.Parameter(torch.randn(5, 5)))

    def fsdp(module: nn.Module, **kwargs: Any) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return lib.FullyShardedDataParallel(
                module, process_group=group, use_orig_params=uop, device_id=torch.device("cpu"), **kwargs
            )

    if wrap == "wrap":
        model.block1.bias_module0 = fsdp(model.block1.bias_module0)
        model.block1 = fsdp(model.block1)
        model.block2[1].bias_module0 = fsdp(model.block2[1].bias_module0)
        model.block2[1].bias_module1 = fsdp(model.block2[1].bias_module1)
        model.block2[1] = fsdp(model.block2[1])
        model.block2[2] = fsdp(model.block2[2], ignored_modules=[model.block2[2].bias_module0] if ignore else None)
    else:
        model.block0.bias_module0 = fsdp(model.block0.bias_module0)
        model.block0 = fsdp(model.block0)
    return model


def optim_input(model: Nested, groups: bool, reverse: bool) -> list:
    """The optimizer's input as torch's tests build it: odd ranks reverse it (or each group's list) with `reverse`."""
    items: list = (
        [{"params": model.group0()}, {"params": model.group1(), "weight_decay": 0.9}]
        if groups
        else list(model.parameters())
    )
    if reverse and dist.get_rank() % 2 == 1:
        if groups:
            for group in items:
                group["params"] = list(reversed(group["params"]))
        else:
            items.reverse()
    return items


def step(model: nn.Module, optim: torch.optim.Optimizer, steps: int = 2) -> None:
    torch.manual_seed(0)  # the same input on every rank, so a smaller world trains to the same state
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(8, 5)).sum().backward()
        optim.step()


def trained(lib: Any, groups: bool = False, reverse: bool = False, **kwargs: Any) -> tuple[nn.Module, Any, list]:
    model = nested_model(lib, **kwargs)
    inputs = optim_input(model, groups, reverse)  # type: ignore[arg-type]
    optim = torch.optim.Adam(copy.copy(inputs), lr=0.01)
    step(model, optim)
    return model, optim, inputs


def quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn`'s result, or its error as text (the oracle compares both)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn(*args, **kwargs)
        except (ValueError, RuntimeError, KeyError, TypeError) as error:
            return f"{type(error).__name__}: {error}"


def both(fn: Any, *args: Any) -> tuple[Any, Any]:
    """`fn(lib, *args)` for ours and torch's."""
    return fn(fsdp_legacy, *args), fn(torch_fsdp, *args)


def _same(ours: Any, theirs: Any, what: str) -> None:
    """Same types, keys in the same order (but among one parameter's state names, which torch takes from a set),
    values and ShardedTensor layouts."""
    assert type(ours) is type(theirs), (what, ours, theirs)
    if isinstance(ours, dict):
        names = ".state." in what and what.count(".") >= 2
        assert (sorted(ours, key=str) == sorted(theirs, key=str)) if names else list(ours) == list(theirs), (
            what,
            list(ours),
            list(theirs),
        )
        for key, value in ours.items():
            _same(value, theirs[key], f"{what}.{key}")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), (what, ours, theirs)
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _same(a, b, f"{what}[{index}]")
    elif isinstance(ours, ShardedTensor):
        assert ours.metadata() == theirs.metadata(), what
        for a, b in zip(ours.local_shards(), theirs.local_shards(), strict=True):
            assert a.metadata == b.metadata, what
            torch.testing.assert_close(a.tensor, b.tensor, msg=what)
    elif isinstance(ours, torch.Tensor):
        torch.testing.assert_close(ours, theirs, msg=what)
    else:
        assert ours == theirs, (what, ours, theirs)


def assert_same(ours: Any, theirs: Any, what: str) -> None:
    __tracebackhide__ = True
    _same(ours, theirs, f"rank {dist.get_rank()} {what}")


def with_type(lib: Any, model: nn.Module, kind: str, fn: Any, rank0_only: bool = False) -> Any:
    """`fn()` under state-dict type `kind` (FULL with offload_to_cpu=False: torch's default aliases values on CPU)."""
    config = (
        lib.FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only) if kind == "FULL_STATE_DICT" else None
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType[kind], None, config):
            return quiet(fn)


# --------------------------------------------------------------------------------------------------------------------
# Part 4: a nonzero rank lacking a state rank 0 has


def _missing_on_nonzero(lib: Any) -> str:
    model = nested_model(lib)
    params = list(model.parameters())
    optim = torch.optim.Adam(params if dist.get_rank() == 0 else params[:-1], lr=0.01)
    step(model, optim)
    return quiet(lib.FullyShardedDataParallel.full_optim_state_dict, model, optim)


def _missing_state_raises() -> None:
    ours, theirs = both(_missing_on_nonzero)
    assert theirs.startswith("RuntimeError: FSDP currently requires each rank to have at least the optimizer states")
    assert ours == theirs


@pytest.mark.parametrize("world_size", [2, 4])
def test_nonzero_rank_missing_a_state_raises_on_every_rank(world_size: int) -> None:
    run_on_ranks(_missing_state_raises, world_size)


# --------------------------------------------------------------------------------------------------------------------
# Part 5: no `param_groups`


def _without_param_groups(lib: Any, uop: bool) -> tuple:
    model, optim, _ = trained(lib, uop=uop)
    fsdp = lib.FullyShardedDataParallel
    state_only = {"state": optim.state_dict()["state"]}
    saved = with_type(lib, model, "FULL_STATE_DICT", lambda: fsdp.optim_state_dict(model, optim, state_only))
    loaded = with_type(lib, model, "FULL_STATE_DICT", lambda: fsdp.optim_state_dict_to_load(model, optim, saved))
    sharded = with_type(lib, model, "SHARDED_STATE_DICT", lambda: fsdp.optim_state_dict(model, optim, state_only))
    return saved, loaded, sharded, quiet(fsdp.flatten_sharded_optim_state_dict, sharded, model, optim)


def _no_param_groups(uop: bool) -> None:
    (saved, loaded, *rest), theirs = both(_without_param_groups, uop)
    assert list(saved) == ["state"] and list(loaded) == ["state"], (saved, loaded)
    assert_same((saved, loaded, *rest), theirs, "without param_groups")


@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_state_without_param_groups_as_torch(uop: bool) -> None:
    run_on_ranks(_no_param_groups, 2, uop)
