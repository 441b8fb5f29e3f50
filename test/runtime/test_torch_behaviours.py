"""Behaviours tried side by side with torch's FSDP1 on 2 gloo ranks, each case run on both in the same ranks:

* optimizer state holding non-tensor values (a float, None) beside or instead of tensors, through optim_state_dict and
  optim_state_dict_to_load, and the loaded optimizers continuing identically;
* shard_/scatter_full_optim_state_dict when the optimizer also holds parameters no FSDP unit manages (ignored modules,
  a part of the model left unwrapped): the same dicts, which load into the optimizer and train on identically;
* an optimizer keyed by parameter name (torch.distributed.optim's _NamedOptimizer, as torchrec uses) on a model whose
  sparse part differs by rank and stays outside FSDP: optim_state_dict gives torch's dict, the state of a plain Adam;
  optim_state_dict_to_load(is_named_optimizer=True) gives torch's name-keyed dict, which the named optimizer loads;
* the original parameters' gradients after summon_full_params (use_orig_params=True, with_grads=True): the shard's
  again, also after a forward that leaves units unsharded; under no_sync(), the accumulated unsharded ones.

Torch's FULL optimizer state dicts are taken with offload_to_cpu=False (its default aliases values on CPU).
"""

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap as torch_wrap
from test_optim_state import assert_same_osd, load_model, model_sd, osd, to_load
from torch import nn

import fsdp_legacy
import models
from fsdp_legacy import wrap as our_wrap
from fsdp_legacy.naming import clean_fqn
from fsdp_utils import Config, assert_close, batch, build_ours, build_torch_fsdp, loss_of
from harness import run_on_ranks

FULL, SHARDED = "FULL_STATE_DICT", "SHARDED_STATE_DICT"
LIBS = (fsdp_legacy, torch_fsdp)


def full_config(lib: Any) -> Any:
    return lib.FullOptimStateDictConfig(offload_to_cpu=False)


def step(model: nn.Module, optim: Any, loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    optim.step()
    model.zero_grad()  # (a _NamedOptimizer has no zero_grad of its own that works)
    return loss.detach()


def assert_same_losses(runs: list[list[torch.Tensor]], what: str) -> None:
    for index, losses in enumerate(runs[1:], 1):
        for a, b in zip(losses, runs[0], strict=True):
            assert_close(a, b, f"{what}: run {index}")


# --------------------------------------------------------------------------------------------------------------------
# Non-tensor optimizer state


class ScalarAdam(torch.optim.Optimizer):
    """Momentum with a float step size that halves every step, and a None, beside the tensor state."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.01})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(step_size=group["lr"], exp_avg=torch.zeros_like(param), extra=None)
                state["exp_avg"].mul_(0.9).add_(param.grad)
                param.add_(state["exp_avg"], alpha=-state["step_size"])
                state["step_size"] *= 0.5


class ScalarSGD(torch.optim.Optimizer):
    """SGD whose state holds non-tensor values only: a float scale that halves every step, and a None."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.01})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(scale=1.0, extra=None)
                param.add_(param.grad, alpha=-group["lr"] * state["scale"])
                state["scale"] *= 0.5


OPTIMIZERS = {"adam_like": ScalarAdam, "sgd_like": ScalarSGD}


def _build(lib: Any, config: Config, seed: int = 0) -> nn.Module:
    return build_ours(config, seed)[1] if lib is fsdp_legacy else build_torch_fsdp(config, seed)


def _non_tensor_state(uop: bool, optimizer: str) -> None:
    config = Config("net", use_orig_params=uop)
    built = {lib: _build(lib, config) for lib in LIBS}
    optims = {lib: OPTIMIZERS[optimizer](model.parameters()) for lib, model in built.items()}
    assert_same_losses(
        [[step(m, optims[lib], loss_of(m(batch(config, s)))) for s in range(2)] for lib, m in built.items()], "training"
    )

    saved = {}
    for lib, model in built.items():
        full = osd(model, optims[lib], lib, FULL, full_config(lib))
        sharded = osd(model, optims[lib], lib, SHARDED)
        loadable = {kind: to_load(model, optims[lib], lib, kind, d) for kind, d in ((FULL, full), (SHARDED, sharded))}
        saved[lib] = (full, sharded, loadable)
    (full, sharded, loadable), (their_full, their_sharded, their_loadable) = saved[fsdp_legacy], saved[torch_fsdp]
    assert all(values["extra"] is None for values in their_full["state"].values())
    assert_same_osd(full, their_full, "FULL")
    assert_same_osd(sharded, their_sharded, "SHARDED")
    for kind in (FULL, SHARDED):  # (torch's loading orders a flat parameter's names by a set)
        assert_same_osd(loadable[kind], their_loadable[kind], f"to_load {kind}", ordered_names=False)

    # Each implementation loads the other's FULL checkpoint into a fresh model and optimizer and trains on as the
    # originals do.
    runs = []
    for lib, other in ((fsdp_legacy, torch_fsdp), (torch_fsdp, fsdp_legacy)):
        model = _build(lib, config, seed=1)
        optim = OPTIMIZERS[optimizer](model.parameters())
        load_model(model, lib, FULL, model_sd(built[other], other, FULL))
        optim.load_state_dict(to_load(model, optim, lib, FULL, copy.deepcopy(saved[other][0])))
        runs.append([step(model, optim, loss_of(model(batch(config, s)))) for s in range(2, 5)])
    runs += [[step(m, optims[lib], loss_of(m(batch(config, s)))) for s in range(2, 5)] for lib, m in built.items()]
    assert_same_losses(runs, "training on after loading")


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_non_tensor_optimizer_state_as_torch(uop: bool, optimizer: str) -> None:
    run_on_ranks(_non_tensor_state, 2, uop, optimizer)


# --------------------------------------------------------------------------------------------------------------------
# shard_/scatter_full_optim_state_dict with parameters outside every FSDP unit

UNMANAGED = {"ignored": {"l2.weight", "l2.bias"}, "unwrapped": {"l1.weight", "l1.bias", "l2.weight", "l2.bias"}}


def _net_with_unmanaged(lib: Any, uop: bool, how: str, seed: int = 0) -> nn.Module:
    """models.Net with l2 under ignored_modules ("ignored"), or with only its block wrapped ("unwrapped")."""
    torch.manual_seed(seed)
    net = models.Net()
    extra = {"device_id": torch.device("cpu")} if lib is torch_fsdp else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "unwrapped":
            net.block = lib.FullyShardedDataParallel(net.block, use_orig_params=uop, **extra)
            return net
        policy = (our_wrap if lib is fsdp_legacy else torch_wrap).ModuleWrapPolicy({models.Block})
        return lib.FullyShardedDataParallel(
            net, auto_wrap_policy=policy, ignored_modules=[net.l2], use_orig_params=uop, **extra
        )


def _groups(model: nn.Module, how: str) -> list[dict[str, Any]]:
    """Two parameter groups: the parameters FSDP manages, and the others (another learning rate)."""
    names = {param: clean_fqn(name) for name, param in model.named_parameters()}
    outside = [param for param, name in names.items() if name in UNMANAGED[how]]
    inside = [param for param in names if all(param is not other for other in outside)]
    assert outside and inside
    return [{"params": inside}, {"params": outside, "lr": 0.02}]


def _load_call(lib: Any, call: str, full: dict, model: nn.Module, optim: torch.optim.Optimizer, how: str) -> dict:
    fsdp = lib.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if call == "shard with optim":
            return fsdp.shard_full_optim_state_dict(full, model, optim=optim)
        if call == "shard with optim_input":
            return fsdp.shard_full_optim_state_dict(full, model, optim_input=_groups(model, how))
        return fsdp.scatter_full_optim_state_dict(full if dist.get_rank() == 0 else None, model, optim=optim)


def _unmanaged_parameters(uop: bool, how: str) -> None:
    config = Config("net")
    built = {lib: _net_with_unmanaged(lib, uop, how) for lib in LIBS}
    optims = {lib: torch.optim.Adam(_groups(model, how), lr=0.01) for lib, model in built.items()}
    assert_same_losses(
        [[step(m, optims[lib], loss_of(m(batch(config, s)))) for s in range(2)] for lib, m in built.items()], "training"
    )
    fulls = {lib: osd(model, optims[lib], lib, FULL, full_config(lib)) for lib, model in built.items()}
    assert UNMANAGED[how] <= set(fulls[torch_fsdp]["state"])
    assert_same_osd(fulls[fsdp_legacy], fulls[torch_fsdp], "FULL")
    states = {lib: copy.deepcopy(model_sd(model, lib, FULL)) for lib, model in built.items()}  # (live tensors)

    calls = ("shard with optim", "shard with optim_input", "scatter with optim")
    results = {}
    for call in calls:  # (copies: torch's values of parameters outside FSDP alias its live optimizer's state)
        results[call] = {
            lib: copy.deepcopy(_load_call(lib, call, fulls[lib], built[lib], optims[lib], how)) for lib in LIBS
        }
        assert_same_osd(results[call][fsdp_legacy], results[call][torch_fsdp], call, ordered_names=False)

    continued = [[step(m, optims[lib], loss_of(m(batch(config, s)))) for s in range(2, 5)] for lib, m in built.items()]
    for call in calls:
        runs = []
        for lib in LIBS:  # the result loads into a fresh optimizer of a fresh model, which trains on
            model = _net_with_unmanaged(lib, uop, how, seed=1)
            load_model(model, lib, FULL, states[lib])
            optim = torch.optim.Adam(_groups(model, how), lr=0.01)
            optim.load_state_dict(results[call][lib])
            runs.append([step(model, optim, loss_of(model(batch(config, s)))) for s in range(2, 5)])
        # And as the originals do, after shard_full_optim_state_dict. (scatter gives every rank rank 0's state of the
        # parameters outside FSDP, which each rank trains alone; in torch too.)
        assert_same_losses(runs + (continued if call.startswith("shard") else []), call)


@pytest.mark.parametrize("how", list(UNMANAGED))
@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_older_api_with_unmanaged_parameters_as_torch(uop: bool, how: str) -> None:
    run_on_ranks(_unmanaged_parameters, 2, uop, how)


# --------------------------------------------------------------------------------------------------------------------
# An optimizer keyed by parameter name, on a model whose sparse part differs by rank


class Recommender(nn.Module):
    """A dense part (models.Net) and a sparse part, an embedding whose number of rows depends on the rank."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = models.Net()
        self.sparse = nn.Embedding(6 + 2 * dist.get_rank(), 3)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x + self.sparse(ids))


def _recommender(lib: Any, uop: bool, how: str) -> nn.Module:
    """The sparse part outside FSDP: under ignored_modules ("ignored"), or only the dense part wrapped ("dense")."""
    torch.manual_seed(0)
    model = Recommender()
    extra = {"device_id": torch.device("cpu")} if lib is torch_fsdp else {}
    policy = (our_wrap if lib is fsdp_legacy else torch_wrap).ModuleWrapPolicy({models.Block})
    fsdp = lib.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "dense":
            model.dense = fsdp(model.dense, auto_wrap_policy=policy, use_orig_params=uop, **extra)
            return model
        return fsdp(model, auto_wrap_policy=policy, ignored_modules=[model.sparse], use_orig_params=uop, **extra)


def _recommender_loss(model: nn.Module, index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * index + dist.get_rank())
    ids, x = torch.randint(6, (4,), generator=generator), torch.randn(4, 3, generator=generator)
    return model(ids, x).pow(2).sum()


def _named_optimizer(uop: bool, how: str) -> None:
    from torch.distributed.optim.named_optimizer import _NamedOptimizer

    saved: dict[tuple[Any, str], dict[str, dict]] = {}
    for lib in LIBS:
        for kind in ("named", "plain"):
            model = _recommender(lib, uop, how)
            if kind == "named":
                optim: Any = _NamedOptimizer(model.named_parameters(), torch.optim.Adam, lr=0.01)
            else:
                optim = torch.optim.Adam(model.parameters(), lr=0.01)
            for s in range(2):
                step(model, optim, _recommender_loss(model, s))
            saved[lib, kind] = {
                FULL: osd(model, optim, lib, FULL, full_config(lib)),
                SHARDED: osd(model, optim, lib, SHARDED),
            }
    rows = 6 + 2 * dist.get_rank()
    assert saved[torch_fsdp, "named"][FULL]["state"]["sparse.weight"]["exp_avg"].shape == (rows, 3)
    for kind in (FULL, SHARDED):
        assert_same_osd(saved[fsdp_legacy, "named"][kind], saved[torch_fsdp, "named"][kind], f"named {kind}")
        groups = [saved[lib, "named"][kind]["param_groups"] for lib in LIBS]
        assert [list(group) for group in groups[0]] == [list(group) for group in groups[1]], "group key order"
        # The state of a plain Adam on the same model (the groups list the names as the named optimizer has them).
        ours, plain = saved[fsdp_legacy, "named"][kind], saved[fsdp_legacy, "plain"][kind]
        assert_same_osd({**ours, "param_groups": []}, {**plain, "param_groups": []}, f"named vs plain {kind}")
        assert sorted(ours["param_groups"][0]["params"]) == sorted(plain["param_groups"][0]["params"])
    # Loaded back with is_named_optimizer=True into a named optimizer that has stepped once: the same name-keyed
    # dicts as torch's, which the named optimizer loads, and training goes on identically.
    for kind in (FULL, SHARDED):
        loaded, losses = {}, {}
        for lib in LIBS:
            model = _recommender(lib, uop, how)
            named = _NamedOptimizer(model.named_parameters(), torch.optim.Adam, lr=0.01)
            step(model, named, _recommender_loss(model, 5))
            loaded[lib] = to_load(model, named, lib, kind, saved[lib, "named"][kind], is_named_optimizer=True)
            named.load_state_dict(loaded[lib])
            losses[lib] = [step(model, named, _recommender_loss(model, s)) for s in range(2, 4)]
        # (torch orders each parameter's state names as a set iterates there: it varies by process)
        ours, theirs = ({**loaded[lib], "state": _sorted_states(loaded[lib]["state"])} for lib in LIBS)
        assert_same_osd(ours, theirs, f"named, loaded from {kind}")
        assert list(loaded[fsdp_legacy]["state"]) == list(loaded[torch_fsdp]["state"]), "state key order"
        assert_same_losses([losses[torch_fsdp], losses[fsdp_legacy]], f"named, after loading {kind}")


def _sorted_states(state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {key: dict(sorted(values.items())) for key, values in state.items()}


@pytest.mark.parametrize("how", ["ignored", "dense"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_named_optimizer_with_rank_dependent_sparse_part_as_torch(uop: bool, how: str) -> None:
    run_on_ranks(_named_optimizer, 2, uop, how)


def _unknown_name_on_one_rank(uop: bool) -> str:
    from torch.distributed.optim.named_optimizer import _NamedOptimizer

    model = _recommender(fsdp_legacy, uop, "dense")
    optim: Any = _NamedOptimizer(model.named_parameters(), torch.optim.Adam, lr=0.01)
    step(model, optim, _recommender_loss(model, 0))
    state = optim.state_dict()
    if dist.get_rank() == 1:  # a name no parameter has, on one rank only
        state["state"]["no.such.weight"] = next(iter(state["state"].values()))
    with pytest.raises(ValueError, match="name no parameter the optimizer holds") as raised:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with fsdp_legacy.FullyShardedDataParallel.state_dict_type(model, fsdp_legacy.StateDictType[SHARDED]):
                fsdp_legacy.FullyShardedDataParallel.optim_state_dict(model, optim, optim_state_dict=state)
    return str(raised.value)


@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_a_named_optimizer_dict_wrong_on_one_rank_raises_on_every_rank(uop: bool) -> None:
    """Bad input on one rank is an error on every rank (the same message), never a wait for the rank that raised."""
    messages = run_on_ranks(_unknown_name_on_one_rank, 2, uop, timeout=60)
    assert messages[0] == messages[1] and "no.such.weight" in messages[0]


# --------------------------------------------------------------------------------------------------------------------
# Gradients after summon_full_params


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    with warnings.catch_warnings():  # (after a forward, the registered views are no leaves: .grad warns)
        warnings.simplefilter("ignore")
        return {clean_fqn(n): None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_grads(ours: dict, theirs: dict, what: str) -> None:
    assert ours.keys() == theirs.keys(), what
    for name, grad in theirs.items():
        assert (ours[name] is None) == (grad is None), f"{what}: {name} {ours[name]} {grad}"
        if grad is not None:
            assert ours[name].shape == grad.shape, f"{what}: {name} {tuple(ours[name].shape)} {tuple(grad.shape)}"
            assert_close(ours[name], grad, f"{what}: {name}")


def _grads_after_summon(strategy: str, case: str) -> None:
    """use_orig_params=True (torch's with_grads needs it). "forward": a forward after the backward leaves units
    unsharded until the next backward; "no_sync": the gradients are the accumulated unsharded ones (torch refuses
    with_grads then, so the context runs without)."""
    config = Config("net", use_orig_params=True, strategy=strategy)
    seen: dict[str, list] = {}
    for lib in LIBS:
        model = _build(lib, config)
        if case == "no_sync":
            with model.no_sync():
                loss_of(model(batch(config, 0))).backward()
        else:
            loss_of(model(batch(config, 0))).backward()
        if case == "forward":
            model(batch(config, 1))
        before = _grads(model)
        with lib.FullyShardedDataParallel.summon_full_params(model, with_grads=case != "no_sync"):
            inside = _grads(model)
        after = _grads(model)
        if case != "no_sync":
            torch.optim.SGD(model.parameters(), lr=0.1).step()
        seen[lib.__name__] = [before, inside, after, {n: p.detach().clone() for n, p in model.named_parameters()}]
    (*grads, params), (*their_grads, their_params) = seen.values()
    for what, ours, theirs in zip(("before", "inside", "after"), grads, their_grads, strict=True):
        _assert_same_grads(ours, theirs, what)
    for name, param in their_params.items():
        assert_close(params[name], param, f"after a step: {name}")


@pytest.mark.parametrize("case", ["backward", "forward", "no_sync"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_gradients_after_summon_full_params_as_torch(strategy: str, case: str) -> None:
    run_on_ranks(_grads_after_summon, 2, strategy, case)
