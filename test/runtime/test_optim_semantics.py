"""Optimizer-state edge cases of torch's FSDP1 (issue 20, parts 1-6), on a nested model wrapped by hand whose root is
not FSDP (parameters beside the units), as torch's own tests build it: optimizers whose parameter order differs across
ranks, parameters outside FSDP, a nonzero rank missing states, dicts without `param_groups`, re-keying to names, and
full dicts loaded into another wrapping or half the world. Oracle: torch's FSDP1 running the same steps on the same
ranks, output key for key (and the optimizer's own state where torch's tests check that)."""

from __future__ import annotations

import copy
import functools
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
        extra = self._parameters.get("unmanaged_param")  # a parameter beside the units, trained by the root
        return torch.relu(self.block2(x)) + self.bias + (0 if extra is None else extra.sum())

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

    if wrap == "none":
        return model
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


def both(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """`fn(lib, *args, **kwargs)` for ours and torch's."""
    return fn(fsdp_legacy, *args, **kwargs), fn(torch_fsdp, *args, **kwargs)


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


def by_key(osd: dict) -> dict:
    """`osd` with its states in key order, as an optimizer's own state dict has them (torch orders loaded states by
    the model's parameters, full ones by its own walk)."""
    return {**osd, "state": dict(sorted(osd["state"].items()))}


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


def _stateless_everywhere(lib: Any) -> Any:
    model = nested_model(lib, uop=True)
    params = list(model.parameters())
    # The last parameter has no element on rank 0 and is left out of rank 1's optimizer: no rank has its state.
    optim = torch.optim.Adam(params if dist.get_rank() == 0 else params[:-1], lr=0.01)
    step(model, optim)
    fsdp = lib.FullyShardedDataParallel
    return with_type(lib, model, "FULL_STATE_DICT", lambda: fsdp.optim_state_dict(model, optim))


def _no_state_anywhere() -> None:
    ours, theirs = both(_stateless_everywhere)
    assert theirs.startswith("RuntimeError: block2.2.bias_module1.bias is not in the optimizer state."), theirs
    # Beyond torch: saved without it, as a plain optimizer's state dict leaves out a parameter without state.
    names = [name for name, _ in Nested().named_parameters()]
    assert sorted(ours["state"]) == sorted(set(names) - {"block2.2.bias_module1.bias"})


def test_uop_parameter_without_state_on_any_rank_saves_without_it() -> None:
    run_on_ranks(_no_state_anywhere, 2)


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


# --------------------------------------------------------------------------------------------------------------------
# Part 6: rekey_optim_state_dict to names, loaded into the wrapped model


def _rekeyed(lib: Any, groups: bool, uop: bool) -> tuple:
    fsdp, key_type = lib.FullyShardedDataParallel, lib.OptimStateKeyType
    wrapped, wrapped_optim, _ = trained(lib, groups, uop=uop)
    plain, plain_optim, plain_input = trained(lib, groups, wrap="none")
    names = quiet(fsdp.rekey_optim_state_dict, plain_optim.state_dict(), key_type.PARAM_NAME, plain, optim=plain_optim)
    by_input = quiet(
        fsdp.rekey_optim_state_dict, plain_optim.state_dict(), key_type.PARAM_NAME, plain, optim_input=plain_input
    )
    sharded = quiet(fsdp.shard_full_optim_state_dict, names, wrapped, optim=wrapped_optim)
    full = with_type(lib, wrapped, "FULL_STATE_DICT", lambda: fsdp.optim_state_dict(wrapped, wrapped_optim))
    ids = quiet(fsdp.rekey_optim_state_dict, full, key_type.PARAM_ID, plain, optim=plain_optim)
    return names, by_input, sharded, wrapped_optim.state_dict(), full, ids, plain_optim.state_dict()


def _rekey_to_names(groups: bool, uop: bool) -> None:
    ours, theirs = both(_rekeyed, groups, uop)
    assert_same(ours, theirs, "rekey")
    names, _, sharded, live, full, ids, plain = ours
    assert_same(by_key(sharded), live, "the re-keyed plain state sharded = the wrapped optimizer's own")
    assert_same(by_key(ids)["state"], plain["state"], "full re-keyed to plain ids.state")


@pytest.mark.parametrize("groups", [False, True], ids=["one_group", "two_groups"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_rekey_to_names_as_torch(groups: bool, uop: bool) -> None:
    run_on_ranks(_rekey_to_names, 2, groups, uop)


# --------------------------------------------------------------------------------------------------------------------
# Part 1: the optimizer's parameter order differs across ranks


def _every_api(lib: Any, groups: bool, reverse: bool, uop: bool, **model_kwargs: Any) -> dict[str, Any]:
    """Every optimizer-state API's output (and the dicts it loads), of a model trained 2 steps."""
    model, optim, inputs = trained(lib, groups, reverse, uop=uop, **model_kwargs)
    fsdp, full_type, sharded_type = lib.FullyShardedDataParallel, "FULL_STATE_DICT", "SHARDED_STATE_DICT"
    out: dict[str, Any] = {}
    for rank0_only in (False, True):
        full = with_type(lib, model, full_type, lambda: fsdp.optim_state_dict(model, optim), rank0_only)
        out[f"full rank0_only={rank0_only}"] = full
        load = functools.partial(fsdp.optim_state_dict_to_load, model, optim, full)
        out[f"loaded full rank0_only={rank0_only}"] = with_type(lib, model, full_type, load, rank0_only)
    sharded = with_type(lib, model, sharded_type, lambda: fsdp.optim_state_dict(model, optim))
    out["sharded"] = sharded
    local = with_type(lib, model, "LOCAL_STATE_DICT", lambda: fsdp.optim_state_dict(model, optim))
    out["local"] = local
    out["loaded local"] = with_type(
        lib, model, "LOCAL_STATE_DICT", lambda: fsdp.optim_state_dict_to_load(model, optim, local)
    )
    out["loaded sharded"] = with_type(
        lib, model, sharded_type, lambda: fsdp.optim_state_dict_to_load(model, optim, sharded)
    )
    # full_optim_state_dict offloads, which aliases torch's values on CPU with use_orig_params (FACTS bug #2).
    legacy = out["full rank0_only=False"] if uop else quiet(fsdp.full_optim_state_dict, model, optim, rank0_only=False)
    if not uop:
        out["full_optim_state_dict"] = legacy
        out["full_optim_state_dict rank0_only"] = quiet(fsdp.full_optim_state_dict, model, optim)
    out["sharded_optim_state_dict"] = quiet(fsdp.sharded_optim_state_dict, model, optim)
    out["flatten_sharded"] = quiet(fsdp.flatten_sharded_optim_state_dict, out["sharded_optim_state_dict"], model, optim)
    out["shard_full optim"] = quiet(fsdp.shard_full_optim_state_dict, legacy, model, optim=optim)
    out["shard_full optim_input"] = quiet(fsdp.shard_full_optim_state_dict, legacy, model, optim_input=inputs)
    rank0 = legacy if dist.get_rank() == 0 else None
    out["scatter optim"] = quiet(fsdp.scatter_full_optim_state_dict, rank0, model, optim=optim)
    out["scatter optim_input"] = quiet(fsdp.scatter_full_optim_state_dict, rank0, model, optim_input=inputs)
    out["live"] = optim.state_dict()
    return out


def _orders_differ(groups: bool, uop: bool) -> None:
    ours, theirs = both(_every_api, groups, True, uop)
    for what, value in ours.items():
        assert not isinstance(value, str), (what, value)
        assert_same(value, theirs[what], what)
        if what.startswith(("loaded", "shard_full", "scatter", "flatten")):
            assert_same(by_key(value), ours["live"], f"{what} = the optimizer's own state")
    same_order = _every_api(fsdp_legacy, groups, False, uop)
    for what in ("full rank0_only=False", "full rank0_only=True", "full_optim_state_dict"):
        if what in ours:  # the states (param_groups list each rank's own order, in torch too)
            state, expected = ours[what].get("state"), same_order[what].get("state")
            assert_same(state, expected, f"{what}: as with the same order.state")


@pytest.mark.parametrize("groups", [False, True], ids=["one_group", "two_groups"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_parameter_order_differing_across_ranks_as_torch(groups: bool, uop: bool) -> None:
    run_on_ranks(_orders_differ, 2, groups, uop)


def test_parameter_order_differing_across_four_ranks_as_torch() -> None:
    run_on_ranks(_orders_differ, 4, True, False)


# --------------------------------------------------------------------------------------------------------------------
# Part 3: parameters outside FSDP in the optimizer


def _outside_fsdp(where: str, uop: bool) -> None:
    kwargs = {"ignore": True} if where == "ignored" else {"unmanaged": "root"}
    ours, theirs = both(_every_api, where == "ignored", False, uop, **kwargs)  # groups leave out root parameters
    outside = "block2.2.bias_module0.bias" if where == "ignored" else "unmanaged_param"
    assert outside in ours["full rank0_only=False"]["state"]
    for what, value in ours.items():
        assert not isinstance(value, str), (what, value)
        assert_same(value, theirs[what], what)
        if what.startswith(("loaded", "shard_full", "scatter", "flatten")):
            assert_same(by_key(value), ours["live"], f"{what} = the optimizer's own state")


@pytest.mark.parametrize("where", ["ignored", "beside"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_parameters_outside_fsdp_as_torch(where: str, uop: bool) -> None:
    run_on_ranks(_outside_fsdp, 2, where, uop)


def _into_unmanaged(lib: Any, where: str) -> Any:
    """torch's case: a full dict of the plain wrapping loaded into a model with one more parameter, beside the units
    (loads; the parameter has no state) or inside one (refused: its flat parameter would need an invented `step`)."""
    model, optim, _ = trained(lib)
    full = quiet(lib.FullyShardedDataParallel.full_optim_state_dict, model, optim, rank0_only=False)
    target = nested_model(lib, unmanaged=where)
    return quiet(
        lib.FullyShardedDataParallel.shard_full_optim_state_dict, full, target, optim_input=list(target.parameters())
    )


def _load_with_unmanaged(world_size: int) -> None:
    for where in ("root", "unit"):
        ours, theirs = both(_into_unmanaged, where)
        if where == "unit":
            assert isinstance(theirs, str) and theirs.startswith("ValueError: All unflattened parameters comprising")
        assert_same(ours, theirs, f"unmanaged parameter on the {where}")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_full_dict_into_model_with_unmanaged_parameter_as_torch(world_size: int) -> None:
    run_on_ranks(_load_with_unmanaged, world_size, world_size)


# --------------------------------------------------------------------------------------------------------------------
# Part 2: a full dict loaded into another wrapping ("wrap_alt") or half the world ("halve_world_size")


def _elsewhere(lib: Any, groups: bool, wrap: str, group: Any) -> tuple:
    """The full dict of the usual wrapping over the world, loaded into `wrap` over `group` by both older APIs; and
    what the target's own optimizer holds after the same steps."""
    fsdp = lib.FullyShardedDataParallel
    model, optim, _ = trained(lib, groups)
    full = quiet(fsdp.full_optim_state_dict, model, optim)  # rank0_only: rank 0 alone holds it
    if group is None:  # not in the smaller world
        return ()
    target, target_optim, _ = trained(lib, groups, wrap=wrap, group=group)
    holder = [full]
    dist.broadcast_object_list(holder, group=group, group_src=0)
    sharded = quiet(fsdp.shard_full_optim_state_dict, holder[0], target, optim=target_optim)
    rank0 = full if dist.get_rank() == 0 else None
    scattered = quiet(fsdp.scatter_full_optim_state_dict, rank0, target, optim=target_optim, group=group)
    return sharded, scattered, target_optim.state_dict()


def _load_elsewhere(groups: bool, wrap: str, halve: bool) -> None:
    world = dist.get_world_size()
    group = dist.new_group(list(range(world // 2))) if halve else dist.group.WORLD
    group = group if dist.get_rank() < (world // 2 if halve else world) else None
    ours, theirs = both(_elsewhere, groups, wrap, group)
    assert_same(ours, theirs, f"{wrap} halve={halve}")
    if ours:
        sharded, scattered, live = ours
        assert_same(by_key(sharded), live, "shard_full_optim_state_dict = the target optimizer's own state")
        assert_same(by_key(scattered), live, "scatter_full_optim_state_dict = the target optimizer's own state")


@pytest.mark.parametrize(
    "world_size,groups,wrap,halve",
    [(2, True, "wrap_alt", False), (2, False, "wrap", True), (4, True, "wrap", True), (4, False, "wrap_alt", True)],
)
def test_full_dict_into_other_wrapping_and_half_world_as_torch(world_size: int, groups: bool, wrap: str, halve: bool):
    run_on_ranks(_load_elsewhere, world_size, groups, wrap, halve)
