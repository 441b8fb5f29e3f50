"""Optimizer state dicts (FSDP.optim_state_dict / optim_state_dict_to_load and the deprecated API) against torch's
FSDP1 on CPU as an oracle: keys, order, shapes, values and ShardedTensor metadata after Adam steps; round trips;
loads across use_orig_params settings; checkpoints exchanged with torch's FSDP1 in both directions.

Torch's FULL optimizer state dict runs with offload_to_cpu=False: its default (True) returns aliased, wrong values on
CPU (FACTS CPU bug #2). Ours runs with the default config and must give torch's correct values.
"""

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

import fsdp_legacy
import models
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import wrap as our_wrap
from fsdp_utils import (
    Config,
    assert_close,
    batch,
    build_ours,
    build_torch_fsdp,
    full_params,
    loss_of,
)
from harness import run_on_ranks

FULL, SHARDED, LOCAL = "FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"
LIBS = {"ours": fsdp_legacy, "torch_fsdp1": torch_fsdp}


# --------------------------------------------------------------------------------------------------------------------
# Helpers (run inside the ranks)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: nn.Module, optim: torch.optim.Optimizer, config: Config, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        loss = loss_of(model(batch(config, step)))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def quiet(fn, *args, **kwargs) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def osd(model: nn.Module, optim: torch.optim.Optimizer, lib: Any, kind: str, optim_config: Any = None) -> dict:
    """`lib.FullyShardedDataParallel.optim_state_dict` under `kind`; `lib` is fsdp_legacy or torch's fsdp."""
    fsdp = lib.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp.state_dict_type(model, lib.StateDictType[kind], None, optim_config):
            return fsdp.optim_state_dict(model, optim)


def to_load(model: nn.Module, optim: torch.optim.Optimizer, lib: Any, kind: str, saved: dict, **kwargs: Any) -> dict:
    fsdp = lib.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp.state_dict_type(model, lib.StateDictType[kind]):
            return fsdp.optim_state_dict_to_load(model, optim, saved, **kwargs)


def model_sd(model: nn.Module, lib: Any, kind: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType[kind]):
            return model.state_dict()


def load_model(model: nn.Module, lib: Any, kind: str, sd: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType[kind]):
            model.load_state_dict(sd)


def describe(value: Any) -> tuple:
    """What must match: the type, global shape, dtype, per-shard metadata; the data comes last."""
    if isinstance(value, ShardedTensor):
        meta = value.metadata()
        shards = [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in meta.shards_metadata]
        local = [(s.metadata.shard_offsets, s.tensor) for s in value.local_shards()]
        return ("ShardedTensor", tuple(meta.size), meta.tensor_properties.dtype, shards, local)
    if isinstance(value, torch.Tensor):
        return ("Tensor", tuple(value.shape), value.dtype, value)
    return (type(value).__name__, value)


def assert_same_osd(ours: dict, theirs: dict, what: str, ordered_names: bool = True, values: bool = True) -> None:
    """Same keys in the same order, same hyperparameters and FQN lists, same metadata and (if `values`) values. The
    order of the state names within a parameter is checked only where torch's is deterministic (not in
    optim_state_dict_to_load's output, which comes out of a set)."""
    assert list(ours) == list(theirs), what
    assert list(ours["state"]) == list(theirs["state"]), (
        f"{what}: state keys/order\n{list(ours['state'])}\n{list(theirs['state'])}"
    )
    assert ours["param_groups"] == theirs["param_groups"], what
    for key, states in theirs["state"].items():
        names, expected_names = list(ours["state"][key]), list(states)
        if not ordered_names:
            names, expected_names = sorted(names), sorted(expected_names)
        assert names == expected_names, f"{what}: {key} state names {names} {expected_names}"
        for name, value in states.items():
            a, b = describe(ours["state"][key][name]), describe(value)
            assert a[:-1] == b[:-1], f"{what}: {key}.{name}:\n ours  {a[:-1]}\n torch {b[:-1]}"
            if not values:
                continue
            if a[0] == "ShardedTensor":
                assert [o for o, _ in a[-1]] == [o for o, _ in b[-1]], f"{what}: {key}.{name} local offsets"
                for (_, x), (_, y) in zip(a[-1], b[-1], strict=True):
                    assert_close(x, y, f"{what}: {key}.{name} local shard")
            elif a[0] == "Tensor":
                assert_close(a[-1], b[-1], f"{what}: {key}.{name}")
            else:
                assert a == b, f"{what}: {key}.{name}"


def trained_pair(config: Config) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    """Ours and torch's FSDP1 from the same initialisation, after the same 2 Adam steps."""
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    ours_opt, theirs_opt = adam(ours), adam(theirs)
    for step_losses in zip(
        train(ours, ours_opt, config, range(2)), train(theirs, theirs_opt, config, range(2)), strict=True
    ):
        assert_close(*step_losses, "training loss")
    return ours, ours_opt, theirs, theirs_opt


# --------------------------------------------------------------------------------------------------------------------
# optim_state_dict against torch


def _against_torch(config: Config) -> None:
    ours, ours_opt, theirs, theirs_opt = trained_pair(config)
    expected_full = osd(theirs, theirs_opt, torch_fsdp, FULL, torch_fsdp.FullOptimStateDictConfig(offload_to_cpu=False))
    full = osd(ours, ours_opt, fsdp_legacy, FULL)  # default config: offload_to_cpu=True
    assert_same_osd(full, expected_full, "FULL")
    for states in full["state"].values():  # no aliasing between the gathered states (torch's CPU bug #2)
        assert not torch.equal(states["exp_avg"], states["exp_avg_sq"])
        assert states["exp_avg"].untyped_storage().data_ptr() != states["exp_avg_sq"].untyped_storage().data_ptr()

    rank0 = osd(ours, ours_opt, fsdp_legacy, FULL, fsdp_legacy.FullOptimStateDictConfig(rank0_only=True))
    assert rank0 == {} if dist.get_rank() else list(rank0["state"]) == list(full["state"])
    if dist.get_rank() == 0:
        assert_same_osd(rank0, expected_full, "FULL rank0_only")

    sharded = osd(ours, ours_opt, fsdp_legacy, SHARDED)
    assert_same_osd(sharded, osd(theirs, theirs_opt, torch_fsdp, SHARDED), "SHARDED")
    assert_same_osd(osd(ours, ours_opt, fsdp_legacy, LOCAL), osd(theirs, theirs_opt, torch_fsdp, LOCAL), "LOCAL")

    # optim_state_dict_to_load of the same FULL dict: torch's int keys, flat/piece shapes and values.
    ours_local = to_load(ours, ours_opt, fsdp_legacy, FULL, full)
    theirs_local = to_load(theirs, theirs_opt, torch_fsdp, FULL, full)
    assert_same_osd(ours_local, theirs_local, "to_load FULL", ordered_names=False)
    assert_same_osd(ours_local, ours_opt.state_dict(), "to_load FULL vs the live optimizer", ordered_names=False)
    assert_same_osd(
        to_load(ours, ours_opt, fsdp_legacy, SHARDED, sharded),
        ours_opt.state_dict(),
        "to_load SHARDED",
        ordered_names=False,
    )


@pytest.mark.parametrize("model", ["net", "transformer"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_optim_state_dict_matches_torch(model: str, uop: bool) -> None:
    run_on_ranks(_against_torch, 2, Config(model, use_orig_params=uop))


@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_optim_state_dict_matches_torch_mixed_precision_size_policy(uop: bool) -> None:
    config = Config("net", policy="size", use_orig_params=uop, mixed_precision=("bfloat16", "float32", "bfloat16"))
    run_on_ranks(_against_torch, 2, config)


@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_optim_state_dict_matches_torch_always_policy(uop: bool) -> None:
    run_on_ranks(_against_torch, 2, Config("net", policy="always", use_orig_params=uop))


@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_optim_state_dict_matches_torch_no_shard(uop: bool) -> None:
    run_on_ranks(_against_torch, 2, Config("net", strategy="NO_SHARD", use_orig_params=uop))


@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_optim_state_dict_matches_torch_world4(uop: bool) -> None:
    # Net at world 4: several parameters have no element on some ranks.
    run_on_ranks(_against_torch, 4, Config("net", use_orig_params=uop), timeout=300)


def _ignored_against_torch(uop: bool) -> None:
    """A parameter outside every unit (ignored_modules): its state is copied under its FQN, as torch does."""
    config = Config("net", use_orig_params=uop)
    built = []
    for lib in (fsdp_legacy, torch_fsdp):
        torch.manual_seed(0)
        net = models.Net()
        extra = {"device_id": torch.device("cpu")} if lib is torch_fsdp else {}
        policy = (our_wrap if lib is fsdp_legacy else torch_wrap).ModuleWrapPolicy({models.Block})
        model = quiet(
            lib.FullyShardedDataParallel,
            net,
            auto_wrap_policy=policy,
            ignored_modules=[net.l2],
            use_orig_params=uop,
            **extra,
        )
        optim = adam(model)
        train(model, optim, config, range(2))
        built.append((model, optim))
    (ours, ours_opt), (theirs, theirs_opt) = built
    full = osd(ours, ours_opt, fsdp_legacy, FULL)
    assert "l2.weight" in full["state"]
    expected = osd(theirs, theirs_opt, torch_fsdp, FULL, torch_fsdp.FullOptimStateDictConfig(offload_to_cpu=False))
    assert_same_osd(full, expected, "FULL with ignored parameters")
    assert_same_osd(
        osd(ours, ours_opt, fsdp_legacy, SHARDED),
        osd(theirs, theirs_opt, torch_fsdp, SHARDED),
        "SHARDED with ignored parameters",
    )
    assert_same_osd(
        to_load(ours, ours_opt, fsdp_legacy, FULL, full), ours_opt.state_dict(), "to_load", ordered_names=False
    )


@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_ignored_parameters_match_torch(uop: bool) -> None:
    run_on_ranks(_ignored_against_torch, 2, uop)


# --------------------------------------------------------------------------------------------------------------------
# Round trips and cross loads


def _round_trip(kind: str, save_uop: bool, load_uop: bool, model: str) -> None:
    """Save model + optimizer, load into a fresh model and optimizer (maybe the other use_orig_params): the next
    steps give the same losses and parameters as continuing the original."""
    source_config, target_config = Config(model, use_orig_params=save_uop), Config(model, use_orig_params=load_uop)
    _, source = build_ours(source_config)
    source_opt = adam(source)
    train(source, source_opt, source_config, range(2))
    saved_model, saved_optim = model_sd(source, fsdp_legacy, kind), osd(source, source_opt, fsdp_legacy, kind)

    _, target = build_ours(target_config, seed=1)
    target_opt = adam(target)
    load_model(target, fsdp_legacy, kind, saved_model)
    loaded = to_load(target, target_opt, fsdp_legacy, kind, saved_optim, load_directly=True)
    assert_same_osd(target_opt.state_dict(), loaded, "load_directly")

    continued = train(source, source_opt, source_config, range(2, 5))
    resumed = train(target, target_opt, target_config, range(2, 5))
    for a, b in zip(resumed, continued, strict=True):
        assert_close(a, b, "loss after resuming", atol=1e-6, rtol=1e-6)
    expected = full_params(source)
    for name, value in full_params(target).items():
        assert_close(value, expected[name], f"{name} after resuming", atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", [FULL, SHARDED])
@pytest.mark.parametrize(
    "save_uop,load_uop",
    [(False, False), (True, True), (False, True), (True, False)],
    ids=["flat", "uop", "flat_to_uop", "uop_to_flat"],
)
def test_round_trip(kind: str, save_uop: bool, load_uop: bool) -> None:
    run_on_ranks(_round_trip, 2, kind, save_uop, load_uop, "net")


def test_round_trip_tied_transformer() -> None:
    run_on_ranks(_round_trip, 2, FULL, False, True, "transformer")


def _exchange_with_torch(uop: bool, kind: str, path: str) -> None:
    """Checkpoints load both ways between ours and torch's FSDP1, and training continues identically: FULL dicts in
    memory, SHARDED ones through DCP files (each implementation's own SHARDED save, loaded by the other)."""
    config = Config("net", use_orig_params=uop)
    ours, ours_opt, theirs, theirs_opt = trained_pair(config)
    theirs_config = torch_fsdp.FullOptimStateDictConfig(offload_to_cpu=False) if kind == FULL else None
    from_ours = (model_sd(ours, fsdp_legacy, kind), osd(ours, ours_opt, fsdp_legacy, kind))
    from_theirs = (model_sd(theirs, torch_fsdp, kind), osd(theirs, theirs_opt, torch_fsdp, kind, theirs_config))

    # Each into a fresh instance of the other implementation (different initialisation).
    _, ours2 = build_ours(config, seed=1)
    theirs2 = build_torch_fsdp(config, seed=1)
    ours2_opt, theirs2_opt = adam(ours2), adam(theirs2)
    if kind == SHARDED:  # real checkpoints: each implementation's DCP files, read by the other
        _save_dcp(from_ours, f"{path}/ours")
        _save_dcp(from_theirs, f"{path}/theirs")
        from_theirs = _load_dcp(ours2, ours2_opt, fsdp_legacy, f"{path}/theirs", config)
        from_ours = _load_dcp(theirs2, theirs2_opt, torch_fsdp, f"{path}/ours", config)
    load_model(ours2, fsdp_legacy, kind, from_theirs[0])
    to_load(ours2, ours2_opt, fsdp_legacy, kind, from_theirs[1], load_directly=True)
    load_model(theirs2, torch_fsdp, kind, from_ours[0])
    theirs2_opt.load_state_dict(to_load(theirs2, theirs2_opt, torch_fsdp, kind, from_ours[1]))

    runs = [
        train(m, o, config, range(2, 4))
        for m, o in [(ours, ours_opt), (theirs, theirs_opt), (ours2, ours2_opt), (theirs2, theirs2_opt)]
    ]
    for losses in runs[1:]:
        for a, b in zip(losses, runs[0], strict=True):
            assert_close(a, b, "loss after exchanging checkpoints")
    full_config = torch_fsdp.FullOptimStateDictConfig(offload_to_cpu=False)
    expected = osd(theirs, theirs_opt, torch_fsdp, FULL, full_config)
    assert_same_osd(osd(ours2, ours2_opt, fsdp_legacy, FULL), expected, "ours loaded from torch")
    assert_same_osd(osd(theirs2, theirs2_opt, torch_fsdp, FULL, full_config), expected, "torch loaded from ours")


def _save_dcp(saved: tuple[dict, dict], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": saved[0], "optim": saved[1]}, checkpoint_id=path)


def _load_dcp(model: nn.Module, optim: torch.optim.Optimizer, lib: Any, path: str, config: Config) -> tuple[dict, dict]:
    """(model, optimizer) SHARDED dicts read from DCP files into templates made by `model` of implementation `lib`;
    its optimizer takes a step first so that its state exists (DCP loads in place; the values are overwritten)."""
    import torch.distributed.checkpoint as dcp

    train(model, optim, config, range(1))
    template = {"model": model_sd(model, lib, SHARDED), "optim": osd(model, optim, lib, SHARDED)}
    dcp.load(template, checkpoint_id=path)
    return template["model"], template["optim"]


@pytest.mark.parametrize("kind", [FULL, SHARDED])
@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_exchange_with_torch(tmp_path, uop: bool, kind: str) -> None:
    run_on_ranks(_exchange_with_torch, 2, uop, kind, str(tmp_path))


def _cross_uop_with_torch() -> None:
    """A FULL dict saved by torch with use_orig_params=False loads into ours with True, and the reverse."""
    for save_uop in (False, True):
        config, target_config = Config("net", use_orig_params=save_uop), Config("net", use_orig_params=not save_uop)
        _, _, theirs, theirs_opt = trained_pair(config)
        saved = osd(theirs, theirs_opt, torch_fsdp, FULL, torch_fsdp.FullOptimStateDictConfig(offload_to_cpu=False))
        _, target = build_ours(target_config, seed=1)
        target_opt = adam(target)
        load_model(target, fsdp_legacy, FULL, model_sd(theirs, torch_fsdp, FULL))
        to_load(target, target_opt, fsdp_legacy, FULL, saved, load_directly=True)
        resumed = train(target, target_opt, target_config, range(2, 4))
        for a, b in zip(resumed, train(theirs, theirs_opt, config, range(2, 4)), strict=True):
            assert_close(a, b, "loss after a cross-use_orig_params load")


def test_cross_uop_from_torch() -> None:
    run_on_ranks(_cross_uop_with_torch, 2)


# --------------------------------------------------------------------------------------------------------------------
# The deprecated API


def deprecation(name: str, replacement: str) -> str:
    return (
        f"``FullyShardedDataParallel.{name}``is being deprecated and is replaced by "
        f"``FullyShardedDataParallel.{replacement}``. ``FullyShardedDataParallel.{name}`` may be removed after "
        "PyTorch 2.2."
    )


def caught(fn, *args, **kwargs) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return result, [str(r.message) for r in records if r.category is FutureWarning]


def _deprecated_api(uop: bool) -> None:
    config = Config("net", use_orig_params=uop)
    ours, ours_opt, theirs, theirs_opt = trained_pair(config)
    rank = dist.get_rank()
    full = osd(ours, ours_opt, fsdp_legacy, FULL)
    local = ours_opt.state_dict()

    result, messages = caught(FSDP.full_optim_state_dict, ours, ours_opt)  # rank0_only=True by default
    assert messages == [deprecation("full_optim_state_dict", "optim_state_dict")]
    if rank:
        assert result == {}
    else:
        assert_same_osd(result, full, "full_optim_state_dict")
    expected = quiet(torch_fsdp.FullyShardedDataParallel.full_optim_state_dict, theirs, theirs_opt)
    assert (expected == {}) == (rank != 0), "torch's rank0_only default"
    if rank == 0 and uop:  # torch offloads to CPU here: wrong values with use_orig_params (CPU bug #2)
        assert_same_osd(result, expected, "full_optim_state_dict vs torch", values=False)
    elif rank == 0:
        assert_same_osd(result, expected, "full_optim_state_dict vs torch")
    result, messages = caught(
        FSDP.full_optim_state_dict, ours, ours_opt, optim_input=list(ours.parameters()), rank0_only=False
    )
    assert_same_osd(result, full, "full_optim_state_dict(rank0_only=False)")
    assert messages[0] == deprecation("full_optim_state_dict", "optim_state_dict")
    assert messages[1].startswith("The `optim_input` argument is deprecated")

    sharded, messages = caught(FSDP.sharded_optim_state_dict, ours, ours_opt)
    assert messages[0] == deprecation("sharded_optim_state_dict", "optim_state_dict")
    assert_same_osd(sharded, osd(ours, ours_opt, fsdp_legacy, SHARDED), "sharded_optim_state_dict")

    result, messages = caught(FSDP.shard_full_optim_state_dict, full, ours, optim=ours_opt)
    assert messages == [deprecation("shard_full_optim_state_dict", "optim_state_dict_to_load")]
    assert_same_osd(result, local, "shard_full_optim_state_dict", ordered_names=False)
    result, messages = caught(FSDP.flatten_sharded_optim_state_dict, sharded, ours, ours_opt)
    assert messages[0] == deprecation("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    assert_same_osd(result, local, "flatten_sharded_optim_state_dict", ordered_names=False)
    result, messages = caught(FSDP.scatter_full_optim_state_dict, full if rank == 0 else None, ours, optim=ours_opt)
    assert messages == [deprecation("scatter_full_optim_state_dict", "optim_state_dict_to_load")]
    assert_same_osd(result, local, "scatter_full_optim_state_dict", ordered_names=False)

    # optim_state_dict_to_load under FULL rank0_only: only rank 0 passes the dict.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(
            ours, fsdp_legacy.StateDictType.FULL_STATE_DICT, None, fsdp_legacy.FullOptimStateDictConfig(rank0_only=True)
        ):
            result = FSDP.optim_state_dict_to_load(ours, ours_opt, full if rank == 0 else {})
    assert_same_osd(result, local, "optim_state_dict_to_load rank0_only", ordered_names=False)

    if not uop:
        with pytest.raises(ValueError, match="use_orig_params=False"):
            FSDP.rekey_optim_state_dict(full, fsdp_legacy.OptimStateKeyType.PARAM_ID, ours)
    wrong = {
        **full,
        "state": {**full["state"], "l1.weight": {**full["state"]["l1.weight"], "exp_avg": torch.zeros(2, 2)}},
    }
    with pytest.raises(ValueError, match=r"'exp_avg' of l1.weight has shape \(2, 2\) but the parameter has shape"):
        quiet(FSDP.optim_state_dict_to_load, ours, ours_opt, wrong)


@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_deprecated_api(uop: bool) -> None:
    run_on_ranks(_deprecated_api, 2, uop)


# --------------------------------------------------------------------------------------------------------------------
# DTensor values, parameter groups, the optim_state_dict argument, other world sizes


def _device_mesh_against_torch(uop: bool) -> None:
    """With a device mesh, SHARDED values are DTensors chunked on dim 0, as torch's; they load back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    config = Config("net", use_orig_params=uop, extra={"device_mesh": mesh})
    ours, ours_opt, theirs, theirs_opt = trained_pair(config)
    sharded, expected = osd(ours, ours_opt, fsdp_legacy, SHARDED), osd(theirs, theirs_opt, torch_fsdp, SHARDED)
    assert list(sharded["state"]) == list(expected["state"]) and sharded["param_groups"] == expected["param_groups"]
    for fqn, states in expected["state"].items():
        assert list(sharded["state"][fqn]) == list(states), fqn
        for name, value in states.items():
            mine = sharded["state"][fqn][name]
            assert type(mine) is type(value), f"{fqn}.{name}: {type(mine)} vs {type(value)}"
            if isinstance(value, DTensor):
                assert (mine.shape, mine.placements) == (value.shape, value.placements), f"{fqn}.{name}"
                assert_close(mine.to_local(), value.to_local(), f"{fqn}.{name} local")
            else:
                assert_close(mine, value, f"{fqn}.{name}")
    assert_same_osd(
        to_load(ours, ours_opt, fsdp_legacy, SHARDED, sharded),
        ours_opt.state_dict(),
        "to_load DTensor",
        ordered_names=False,
    )


@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
def test_device_mesh_dtensor_matches_torch(uop: bool) -> None:
    run_on_ranks(_device_mesh_against_torch, 2, uop)


def _param_groups_against_torch() -> None:
    """use_orig_params=True with two parameter groups (biases without weight decay, another lr): torch's
    param_groups; the groups' hyperparameters survive a load into differently configured groups; the
    optim_state_dict argument is used instead of optim.state_dict()."""
    config = Config("net", use_orig_params=True)

    def grouped(model: nn.Module, lr: float = 0.01) -> torch.optim.Optimizer:
        params = list(model.named_parameters())
        return torch.optim.AdamW(
            [
                {"params": [p for n, p in params if not n.endswith("bias")], "weight_decay": 0.1},
                {"params": [p for n, p in params if n.endswith("bias")], "weight_decay": 0.0, "lr": lr * 2},
            ],
            lr=lr,
        )

    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    ours_opt, theirs_opt = grouped(ours), grouped(theirs)
    train(ours, ours_opt, config, range(2))
    train(theirs, theirs_opt, config, range(2))
    full = osd(ours, ours_opt, fsdp_legacy, FULL)
    expected = osd(theirs, theirs_opt, torch_fsdp, FULL, torch_fsdp.FullOptimStateDictConfig(offload_to_cpu=False))
    assert_same_osd(full, expected, "FULL with two parameter groups")
    assert [g["lr"] for g in full["param_groups"]] == [0.01, 0.02]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(ours, fsdp_legacy.StateDictType.FULL_STATE_DICT):
            from_argument = FSDP.optim_state_dict(ours, ours_opt, optim_state_dict=ours_opt.state_dict())
    assert_same_osd(from_argument, full, "optim_state_dict argument")

    _, target = build_ours(config, seed=1)
    target_opt = grouped(target, lr=0.5)  # other hyperparameters: the checkpoint's must win
    load_model(target, fsdp_legacy, FULL, model_sd(ours, fsdp_legacy, FULL))
    to_load(target, target_opt, fsdp_legacy, FULL, full, load_directly=True)
    assert [g["lr"] for g in target_opt.param_groups] == [0.01, 0.02]
    for a, b in zip(
        train(target, target_opt, config, range(2, 4)), train(ours, ours_opt, config, range(2, 4)), strict=True
    ):
        assert_close(a, b, "loss after loading two parameter groups")


def test_param_groups_match_torch() -> None:
    run_on_ranks(_param_groups_against_torch, 2)


def _save_full(uop: bool) -> tuple[dict, dict, list[torch.Tensor]]:
    config = Config("net", use_orig_params=uop)
    _, model = build_ours(config)
    optim = adam(model)
    train(model, optim, config, range(2))
    return model_sd(model, fsdp_legacy, FULL), osd(model, optim, fsdp_legacy, FULL), full_params(model)


def _load_full(uop: bool, saved_model: dict, saved_optim: dict) -> None:
    config = Config("net", use_orig_params=uop)
    _, model = build_ours(config, seed=1)
    optim = adam(model)
    load_model(model, fsdp_legacy, FULL, saved_model)
    to_load(model, optim, fsdp_legacy, FULL, saved_optim, load_directly=True)
    # The other use_orig_params setting orders FQNs and state names its own way: compare the content.
    reloaded = osd(model, optim, fsdp_legacy, FULL)
    reordered = {
        "state": {fqn: {n: saved_optim["state"][fqn][n] for n in states} for fqn, states in reloaded["state"].items()},
        "param_groups": [
            {**g, "params": r["params"]}
            for g, r in zip(saved_optim["param_groups"], reloaded["param_groups"], strict=True)
        ],
    }
    assert [sorted(g["params"]) for g in reloaded["param_groups"]] == [
        sorted(g["params"]) for g in saved_optim["param_groups"]
    ]
    assert reloaded["state"].keys() == saved_optim["state"].keys()
    assert_same_osd(reloaded, reordered, "reloaded at another world size")


@pytest.mark.parametrize("save_uop,load_uop", [(False, True), (True, False)], ids=["flat_to_uop", "uop_to_flat"])
def test_full_checkpoint_across_world_sizes(save_uop: bool, load_uop: bool) -> None:
    saved_model, saved_optim, _ = run_on_ranks(_save_full, 2, save_uop)[0]
    run_on_ranks(_load_full, 4, load_uop, saved_model, saved_optim, timeout=300)
    run_on_ranks(_load_full, 1, load_uop, saved_model, saved_optim)


def _rekey_like_torch() -> None:
    """rekey_optim_state_dict against torch's: a FULL checkpoint to a plain model's ids and back, and a wrapped
    (use_orig_params=True) model's own id-keyed state to names."""
    config = Config("transformer", "FULL_SHARD", "block", True)
    ours, ours_opt, theirs, theirs_opt = trained_pair(config)
    reference = models.Transformer()  # a plain model of the same structure
    full = osd(ours, ours_opt, fsdp_legacy, FULL)
    by_name, by_id = fsdp_legacy.OptimStateKeyType.PARAM_NAME, fsdp_legacy.OptimStateKeyType.PARAM_ID
    torch_by_name, torch_by_id = torch_fsdp.OptimStateKeyType.PARAM_NAME, torch_fsdp.OptimStateKeyType.PARAM_ID
    rekey, torch_rekey = FSDP.rekey_optim_state_dict, torch_fsdp.FullyShardedDataParallel.rekey_optim_state_dict

    ids = rekey(full, by_id, reference)
    assert_same_osd(ids, torch_rekey(full, torch_by_id, reference), "names -> plain ids")
    plain_opt = adam(reference)
    plain_opt.load_state_dict(ids)  # what the re-keying is for
    names = rekey(plain_opt.state_dict(), by_name, reference)
    assert_same_osd(names, torch_rekey(plain_opt.state_dict(), torch_by_name, reference), "plain ids -> names")
    # Round trip: the same states; torch's re-keying sorts each group's parameter names.
    sorted_full = {**full, "param_groups": [{**g, "params": sorted(g["params"])} for g in full["param_groups"]]}
    assert_same_osd(names, sorted_full, "round trip", ordered_names=False)
    assert rekey(full, by_name, reference) is full  # already keyed so: returned as is, as torch does

    # A wrapped model with its own (sharded, 1-D) optimizer state: ids -> names, with the optimizer's numbering.
    ours_names = rekey(ours_opt.state_dict(), by_name, ours, optim=ours_opt)
    theirs_names = quiet(torch_rekey, theirs_opt.state_dict(), torch_by_name, theirs, optim=theirs_opt)
    assert_same_osd(ours_names, theirs_names, "wrapped ids -> names", ordered_names=False, values=False)
    with pytest.raises(KeyError, match="'nope' of the optimizer state dict is not a parameter"):
        rekey({"state": {"nope": {}}, "param_groups": []}, by_id, reference)


def test_rekey_optim_state_dict_like_torch() -> None:
    run_on_ranks(_rekey_like_torch, 2)


def test_signatures_match_torch() -> None:
    import inspect

    for name in [
        "optim_state_dict",
        "optim_state_dict_to_load",
        "full_optim_state_dict",
        "sharded_optim_state_dict",
        "shard_full_optim_state_dict",
        "flatten_sharded_optim_state_dict",
        "scatter_full_optim_state_dict",
        "rekey_optim_state_dict",
    ]:
        ours, theirs = (inspect.signature(getattr(lib, name)) for lib in (FSDP, torch_fsdp.FullyShardedDataParallel))
        assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == [
            (p.name, p.default, p.kind) for p in theirs.parameters.values()
        ], name


# --------------------------------------------------------------------------------------------------------------------
# Migration of model and optimizer state to FSDP2 (fully_shard) through DCP


def _save_sharded_for_fsdp2(uop: bool, path: str) -> tuple[list[torch.Tensor], dict]:
    import torch.distributed.checkpoint as dcp

    config = Config("net", use_orig_params=uop)
    _, model = build_ours(config)
    optim = adam(model)
    train(model, optim, config, range(2))
    with quiet(FSDP.state_dict_type, model, fsdp_legacy.StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}, checkpoint_id=path)
    losses = train(model, optim, config, range(2, 4))  # what continuing with fsdp_legacy gives
    return losses, full_params(model)


def load_into_fsdp2(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """A fully_shard model and its optimizer load a DCP checkpoint {"model": ..., "optim": ...} with torch's helpers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])


def _continue_in_fsdp2(uop: bool, path: str) -> tuple[list[torch.Tensor], dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(123)  # a different initialisation: everything must come from the checkpoint
    model = models.Net()
    fully_shard(model.block)
    fully_shard(model)
    optim = adam(model)
    load_into_fsdp2(model, optim, path)
    losses = train(model, optim, Config("net", use_orig_params=uop), range(2, 4))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return losses, {name: tensor for name, tensor in full.items() if name != "buf"}


@pytest.mark.parametrize("uop", [False, True])
def test_training_continues_identically_in_fsdp2(tmp_path, uop: bool) -> None:
    """Model and Adam state saved by fsdp_legacy (SHARDED, DCP) load into FSDP2, which then trains exactly as
    fsdp_legacy would have."""
    expected = run_on_ranks(_save_sharded_for_fsdp2, 2, uop, str(tmp_path))
    actual = run_on_ranks(_continue_in_fsdp2, 2, uop, str(tmp_path))
    for rank in range(2):
        (want_losses, want_params), (got_losses, got_params) = expected[rank], actual[rank]
        for step, (a, b) in enumerate(zip(got_losses, want_losses, strict=True)):
            assert_close(a, b, f"rank {rank} loss {step + 2}")
        assert got_params.keys() == want_params.keys()
        for name in want_params:
            assert_close(got_params[name], want_params[name], f"rank {rank} {name}")


def _save_from_fsdp2(path: str) -> tuple[list[torch.Tensor], dict]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = models.Net()
    fully_shard(model.block)
    fully_shard(model)
    optim = adam(model)
    config = Config("net")
    train(model, optim, config, range(2))
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=path
    )
    losses = train(model, optim, config, range(2, 4))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return losses, {name: tensor for name, tensor in full.items() if name != "buf"}


def _continue_in_ours(uop: bool, path: str) -> tuple[list[torch.Tensor], dict]:
    model, optim = _load_ours(uop, path)
    return train(model, optim, Config("net", use_orig_params=uop), range(2, 4)), full_params(model)


def _load_ours(uop: bool, path: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Our model and Adam loaded from a DCP checkpoint {"model": ..., "optim": ...} in FSDP2's layout."""
    import torch.distributed.checkpoint as dcp

    config = Config("net", use_orig_params=uop)
    _, model = build_ours(config, seed=123)
    optim = adam(model)
    # DCP loads into existing tensors, and Adam creates its state lazily: make it exist first with a step that
    # changes nothing (zero gradients, lr 0), as torch's get_optimizer_state_dict does for FSDP2.
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optim.param_groups[0]["lr"] = 0.0
    optim.step()
    optim.zero_grad()
    with quiet(FSDP.state_dict_type, model, fsdp_legacy.StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))
    return model, optim


@pytest.mark.parametrize("uop", [False, True])
def test_fsdp2_checkpoint_continues_identically_in_ours(tmp_path, uop: bool) -> None:
    """The reverse direction: an FSDP2 checkpoint (model and Adam state, DCP) loads into fsdp_legacy."""
    expected = run_on_ranks(_save_from_fsdp2, 2, str(tmp_path))
    actual = run_on_ranks(_continue_in_ours, 2, uop, str(tmp_path))
    for rank in range(2):
        (want_losses, want_params), (got_losses, got_params) = expected[rank], actual[rank]
        for step, (a, b) in enumerate(zip(got_losses, want_losses, strict=True)):
            assert_close(a, b, f"rank {rank} loss {step + 2}")
        for name in want_params:
            assert_close(got_params[name], want_params[name], f"rank {rank} {name}")


def _fsdp2_net(seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = models.Net()
    fully_shard(model.block)
    fully_shard(model)
    return model


def _full_state(model: nn.Module, optim: torch.optim.Optimizer, impl: str) -> dict:
    """Model and optimizer state, full and by FQN, as each implementation gives them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    if impl == "ours":
        return {"model": model_sd(model, fsdp_legacy, FULL), "optim": osd(model, optim, fsdp_legacy, FULL)["state"]}
    if impl == "torch_fsdp1":  # (offload_to_cpu=False: torch's default returns aliased values on CPU)
        config = torch_fsdp.FullOptimStateDictConfig(offload_to_cpu=False)
        return {
            "model": model_sd(model, torch_fsdp, FULL),
            "optim": osd(model, optim, torch_fsdp, FULL, config)["state"],
        }
    full = StateDictOptions(full_state_dict=True)
    return {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, optim, options=full)["state"],
    }


def _save_for_migration(impl: str, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    builders = {
        "ours": lambda: build_ours(Config("net"))[1],
        "torch_fsdp1": lambda: quiet(build_torch_fsdp, Config("net")),
        "fsdp2": lambda: _fsdp2_net(0),
    }
    model = builders[impl]()
    optim = adam(model)
    train(model, optim, Config("net"), range(2))
    if impl != "fsdp2":
        _save_dcp((model_sd(model, LIBS[impl], SHARDED), osd(model, optim, LIBS[impl], SHARDED)), path)
    else:
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=path
        )
    return _full_state(model, optim, impl)


def _load_for_migration(impl: str, path: str) -> dict:
    if impl == "ours":
        model, optim = _load_ours(False, path)
    elif impl == "torch_fsdp1":
        model = quiet(build_torch_fsdp, Config("net"), seed=123)
        optim = adam(model)
        model_state, optim_state = _load_dcp(model, optim, torch_fsdp, path, Config("net"))
        load_model(model, torch_fsdp, SHARDED, model_state)
        optim.load_state_dict(to_load(model, optim, torch_fsdp, SHARDED, optim_state))
    else:
        model = _fsdp2_net(123)
        optim = adam(model)
        load_into_fsdp2(model, optim, path)
    return _full_state(model, optim, impl)


def _assert_same_state(actual: Any, expected: Any, what: str) -> None:
    if isinstance(expected, dict):
        assert set(actual) == set(expected), f"{what}: {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            _assert_same_state(actual[key], expected[key], f"{what}.{key}")
    else:
        assert_close(actual, expected, what)


@pytest.mark.parametrize(
    "save_impl,save_world,load_impl,load_world",
    [
        ("ours", 2, "fsdp2", 1),
        ("ours", 1, "fsdp2", 2),
        ("fsdp2", 2, "ours", 1),
        ("fsdp2", 1, "ours", 2),
        ("torch_fsdp1", 2, "ours", 1),
        ("torch_fsdp1", 1, "ours", 2),
        ("ours", 2, "torch_fsdp1", 1),
        ("ours", 1, "torch_fsdp1", 2),
    ],
)
def test_migration_across_world_sizes(tmp_path, save_impl: str, save_world: int, load_impl: str, load_world: int):
    """Model and Adam state move between fsdp_legacy and FSDP2, and between torch's FSDP1 and fsdp_legacy, through
    SHARDED DCP checkpoints while the world size changes (2 -> 1, 1 -> 2): every value of the full state after
    loading equals the full state that was saved."""
    saved = run_on_ranks(_save_for_migration, save_world, save_impl, str(tmp_path))[0]
    for rank, loaded in enumerate(run_on_ranks(_load_for_migration, load_world, load_impl, str(tmp_path))):
        _assert_same_state(loaded, saved, f"{save_impl}@{save_world} -> {load_impl}@{load_world}, rank {rank}")
