"""fsdp_legacy.checkpoint: torch's state_dict helpers for our models. Oracle: torch's own helpers on torch's FSDP1
(same keys and values), and FSDP2 continuing training from what they saved."""

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as torch_dsd
from test_optim_state import adam, train
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

import models
from fsdp_legacy import checkpoint as our_dsd
from fsdp_utils import Config, assert_close, batch, build_ours, build_torch_fsdp, loss_of
from harness import run_on_ranks


def _full_values(state: dict) -> dict:
    """Tensors (ShardedTensor/DTensor gathered) of a possibly nested state dict, flattened by dotted key."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _full_values(value).items()})
        elif isinstance(value, torch.Tensor):
            out[key] = value
    return out


def _same_as_torch(use_orig_params: bool, full: bool) -> None:
    config = Config("net", use_orig_params=use_orig_params)
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    our_opt, their_opt = adam(ours), adam(theirs)
    train(ours, our_opt, config, range(2))
    train(theirs, their_opt, config, range(2))
    options = StateDictOptions(full_state_dict=full)
    our_model, our_optim = our_dsd.get_state_dict(ours, our_opt, options=options)
    their_model, their_optim = torch_dsd.get_state_dict(theirs, their_opt, options=options)
    assert list(our_model) == list(their_model)
    assert list(our_optim["state"]) == list(their_optim["state"])
    if full:
        for key, value in _full_values({"model": our_model, "optim": our_optim["state"]}).items():
            expected = _full_values({"model": their_model, "optim": their_optim["state"]})[key]
            assert_close(value, expected, key)


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_same_keys_and_values_as_torch_helpers_on_torch_fsdp1(use_orig_params: bool, full: bool) -> None:
    run_on_ranks(_same_as_torch, 2, use_orig_params, full)


def _save(use_orig_params: bool, path: str):
    config = Config("net", use_orig_params=use_orig_params)
    _, ours = build_ours(config)
    optim = adam(ours)
    train(ours, optim, config, range(2))
    model_sd, optim_sd = our_dsd.get_state_dict(ours, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return train(ours, optim, config, range(2, 4))


def _load_into_fresh_ours(use_orig_params: bool, path: str):
    config = Config("net", use_orig_params=use_orig_params)
    _, ours = build_ours(config, seed=123)
    optim = adam(ours)
    model_sd, optim_sd = our_dsd.get_state_dict(ours, optim)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    our_dsd.set_state_dict(ours, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return train(ours, optim, config, range(2, 4))


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_round_trip_through_dcp_continues_identically(tmp_path, use_orig_params: bool) -> None:
    expected = run_on_ranks(_save, 2, use_orig_params, str(tmp_path))
    actual = run_on_ranks(_load_into_fresh_ours, 2, not use_orig_params, str(tmp_path))
    for want, got in zip(expected, actual, strict=True):
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_close(a, b, f"loss {step + 2}")


# --------------------------------------------------------------------------------------------------------------------
# Every option against torch's helpers on torch's FSDP1 (get_*), and loads that restore the source's state (set_*)


def _local(value: Any) -> Any:
    """The local part of a ShardedTensor / DTensor (the rank's shard is what a sharded dict holds), else the value."""
    if isinstance(value, ShardedTensor):
        return value.local_tensor()
    if isinstance(value, DTensor):
        return value.to_local()
    return value


def _assert_same(ours: Any, theirs: Any, where: str = "") -> None:
    """Same structure, keys in the same order, equal values (local shards of sharded tensors)."""
    if isinstance(ours, dict):  # OrderedDict or dict: torch's helper returns either, depending on the options
        assert isinstance(theirs, dict), f"{where}: {type(theirs)} is no dict"
        assert list(ours) == list(theirs), f"{where}: keys {list(ours)} != {list(theirs)}"
        for key in ours:
            _assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(ours, torch.Tensor):
        assert type(ours) is type(theirs), f"{where}: {type(ours)} != {type(theirs)}"
        assert_close(_local(ours), _local(theirs), where)
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def _optimizers(model: nn.Module, count: int, lr: float = 0.01) -> list[torch.optim.Optimizer]:
    """One Adam, or (count=2) Adam for the first unit's parameters and SGD with momentum for the rest (with
    use_orig_params=False each optimizer holds whole flat parameters)."""
    params = list(model.parameters())
    if count == 1:
        return [torch.optim.Adam(params, lr=lr)]
    first = [p for name, p in model.named_parameters() if "block" in name or "body" in name]
    rest = [p for p in params if all(p is not q for q in first)]
    return [torch.optim.Adam(first, lr=lr), torch.optim.SGD(rest, lr=lr * 5, momentum=0.9)]


def _trained(lib: str, model: str, use_orig_params: bool, count: int, seed: int = 0, steps: int = 2):
    config = Config(model, use_orig_params=use_orig_params)
    fsdp = build_ours(config, seed)[1] if lib == "ours" else build_torch_fsdp(config, seed)
    optims = _optimizers(fsdp, count, lr=0.01 if steps else 0.5)  # an untrained target starts with other lrs
    for step in range(steps):
        loss_of(fsdp(batch(config, step))).backward()
        for optim in optims:
            optim.step()
            optim.zero_grad()
    return fsdp, optims


def _get_both(model: str, use_orig_params: bool, count: int, kwargs: dict) -> None:
    ours, our_optims = _trained("ours", model, use_orig_params, count)
    theirs, their_optims = _trained("torch", model, use_orig_params, count)
    options = StateDictOptions(**kwargs)
    _assert_same(
        our_dsd.get_state_dict(ours, our_optims, options=options),
        torch_dsd.get_state_dict(theirs, their_optims, options=options),
    )


GET_CASES = {  # name: (model, optimizers, options)
    "sharded_2optims": ("net", 2, {}),
    "full_2optims": ("net", 2, dict(full_state_dict=True)),
    "flatten_sharded": ("net", 1, dict(flatten_optimizer_state_dict=True)),
    "flatten_full_2optims": ("net", 2, dict(flatten_optimizer_state_dict=True, full_state_dict=True)),
    "ignore_frozen_sharded": ("frozen", 1, dict(ignore_frozen_params=True)),
    "ignore_frozen_full": ("frozen", 2, dict(ignore_frozen_params=True, full_state_dict=True)),
    "broadcast_from_rank0": ("net", 2, dict(broadcast_from_rank0=True, full_state_dict=True)),  # optim: rank 0 only
}


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("case", list(GET_CASES))
def test_get_options_same_as_torch_helpers(case: str, use_orig_params: bool) -> None:
    run_on_ranks(_get_both, 2, *GET_CASES[case][:2], use_orig_params, GET_CASES[case][2])


def _get_offloaded(model: str, use_orig_params: bool, ignore_frozen: bool) -> None:
    """torch's helper is no oracle here: its FULL optimizer dict offloaded on CPU has aliased values (FACTS CPU bug
    #2), and with ignore_frozen_params its ranks other than 0 raise KeyError (they pop from an empty dict). Expected:
    on rank 0 torch's full dicts without offloading (frozen parameters dropped), {} elsewhere."""
    ours, our_optims = _trained("ours", model, use_orig_params, 2)
    theirs, their_optims = _trained("torch", model, use_orig_params, 2)
    got = our_dsd.get_state_dict(
        ours,
        our_optims,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=ignore_frozen),
    )
    model_sd, optim_sd = torch_dsd.get_state_dict(theirs, their_optims, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank():
        assert got == ({}, {})
        return
    frozen = {name for name, p in models.Frozen().named_parameters() if not p.requires_grad} if ignore_frozen else set()
    assert frozen or not ignore_frozen
    _assert_same(got, ({k: v for k, v in model_sd.items() if k not in frozen}, optim_sd))
    assert all(t.device.type == "cpu" for t in _full_values({"m": got[0], "o": got[1]["state"]}).values())


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("model, ignore_frozen", [("net", False), ("frozen", True)])
def test_full_cpu_offload_on_rank0_only(model: str, ignore_frozen: bool, use_orig_params: bool) -> None:
    run_on_ranks(_get_offloaded, 2, model, use_orig_params, ignore_frozen)


def _load_restores(source: str, model: str, use_orig_params: bool, count: int, kwargs: dict) -> None:
    """Load `source`'s (ours or torch's FSDP1) dicts, got with `kwargs`, into a fresh model of ours (other weights
    and lrs); our full dicts must then be the source's."""
    src, src_optims = _trained(source, model, use_orig_params, count)
    dst, dst_optims = _trained("ours", model, use_orig_params, count, seed=123, steps=0)
    get = our_dsd.get_state_dict if source == "ours" else torch_dsd.get_state_dict
    full = StateDictOptions(full_state_dict=True)
    expected = get(src, src_optims, options=full)
    options = StateDictOptions(**kwargs)
    model_sd, optim_sd = get(src, src_optims, options=options)
    if options.broadcast_from_rank0 and dist.get_rank():
        model_sd, optim_sd = {}, {}  # only rank 0 holds the checkpoint
    our_dsd.set_state_dict(dst, dst_optims, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    _assert_same(our_dsd.get_state_dict(dst, dst_optims, options=full), expected)


SET_CASES = {
    "sharded_2optims": (2, {}),
    "full_2optims": (2, dict(full_state_dict=True)),
    "flatten_sharded": (1, dict(flatten_optimizer_state_dict=True)),
    "flatten_full_2optims": (2, dict(flatten_optimizer_state_dict=True, full_state_dict=True)),
    "broadcast_from_rank0_2optims": (2, dict(broadcast_from_rank0=True, full_state_dict=True)),
    "broadcast_from_rank0_flatten": (
        1,
        dict(broadcast_from_rank0=True, full_state_dict=True, flatten_optimizer_state_dict=True),
    ),
}


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("source", ["ours", "torch"])
@pytest.mark.parametrize("case", list(SET_CASES))
def test_set_options_restore_the_saved_state(case: str, source: str, use_orig_params: bool) -> None:
    run_on_ranks(_load_restores, 2, source, "net", use_orig_params, *SET_CASES[case])


@pytest.mark.parametrize("world_size", [1, 4])
def test_broadcast_from_rank0_at_other_world_sizes(world_size: int) -> None:
    run_on_ranks(
        _load_restores, world_size, "torch", "net", True, 2, dict(broadcast_from_rank0=True, full_state_dict=True)
    )


def _frozen_load(use_orig_params: bool, full: bool) -> None:
    """A dict without the frozen parameters loads with strict=False; the frozen ones keep their own values."""
    src, src_optims = _trained("ours", "frozen", use_orig_params, 1)
    dst, dst_optims = _trained("ours", "frozen", use_orig_params, 1, seed=123, steps=0)
    full_options = StateDictOptions(full_state_dict=True)
    expected = our_dsd.get_model_state_dict(src, options=full_options)
    own = our_dsd.get_model_state_dict(dst, options=full_options)
    options = StateDictOptions(ignore_frozen_params=True, full_state_dict=full, strict=False)
    model_sd, optim_sd = our_dsd.get_state_dict(src, src_optims, options=options)
    assert not any(key.startswith("stem.") for key in model_sd) and "stem.0.weight" in expected
    incompatible = our_dsd.set_state_dict(
        dst, dst_optims, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
    )
    assert sorted(incompatible.missing_keys) == ["stem.0.bias", "stem.0.weight"]
    got = our_dsd.get_model_state_dict(dst, options=full_options)
    _assert_same(got, {k: (own if k.startswith("stem.") else expected)[k] for k in expected})


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_ignore_frozen_params_loads_with_strict_false(use_orig_params: bool, full: bool) -> None:
    run_on_ranks(_frozen_load, 2, use_orig_params, full)


def _submodules(use_orig_params: bool) -> None:
    ours, our_optims = _trained("ours", "net", use_orig_params, 1)
    theirs, their_optims = _trained("torch", "net", use_orig_params, 1)
    picks = [{m for m in fsdp.modules() if isinstance(m, models.Block)} for fsdp in (ours, theirs)]
    for keep in (True, False):
        options = StateDictOptions(full_state_dict=True, keep_submodule_prefixes=keep)
        with warnings.catch_warnings(record=True) as our_warnings:
            warnings.simplefilter("always")
            got = our_dsd.get_state_dict(ours, our_optims, submodules=picks[0], options=options)
        with warnings.catch_warnings(record=True) as their_warnings:
            warnings.simplefilter("always")
            expected = torch_dsd.get_state_dict(theirs, their_optims, submodules=picks[1], options=options)
        _assert_same(got, expected)  # the optimizer's dict is not filtered, in torch either
        assert sorted(got[0]) == sorted(f"{'block.' if keep else ''}{k}" for k in models.Block().state_dict())
        deprecations = [
            [str(w.message) for w in ws if w.category is FutureWarning] for ws in (our_warnings, their_warnings)
        ]
        assert deprecations[0] == deprecations[1] and len(deprecations[0]) == 1

    # The deprecated {submodule: its dict} form of set_model_state_dict, with torch's warning.
    dst, _ = _trained("ours", "net", use_orig_params, 1, seed=123, steps=0)
    block = next(m for m in dst.modules() if isinstance(m, models.Block))
    with pytest.warns(FutureWarning, match="Dict\\[nn.Module"):
        our_dsd.set_model_state_dict(dst, {block: got[0]}, options=StateDictOptions(full_state_dict=True, strict=False))
    loaded = our_dsd.get_model_state_dict(dst, options=StateDictOptions(full_state_dict=True))
    _assert_same({k: loaded[f"block.{k}"] for k in got[0]}, got[0])


def test_submodules_deprecated_as_in_torch() -> None:
    run_on_ranks(_submodules, 2, True)
    run_on_ranks(_submodules, 2, False)


def _refused() -> None:
    ours, optims = _trained("ours", "net", False, 1)
    with pytest.raises(ValueError, match="full_state_dict must be True"):
        our_dsd.get_model_state_dict(ours, options=StateDictOptions(broadcast_from_rank0=True))
    with pytest.raises(RuntimeError, match="model state dict .* empty"):
        our_dsd.set_model_state_dict(ours, {})
    assert our_dsd.set_model_state_dict(ours, {}, options=StateDictOptions(strict=False)) == ([], [])
    sd = our_dsd.get_optimizer_state_dict(ours, optims)
    sd["state"].pop(next(iter(sd["state"])))
    with pytest.raises(RuntimeError, match="Missing optimizer state for parameter"):
        our_dsd.set_optimizer_state_dict(ours, optims, sd)


def test_invalid_options_are_refused_as_torch_refuses_them() -> None:
    run_on_ranks(_refused, 2)
