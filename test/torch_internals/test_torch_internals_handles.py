"""FlatParamHandle and the wrapper as code written against torch's FSDP1 reads them, and the module-level helpers such
code imports from torch's private FSDP1 files (`_runtime_utils._lazy_init` / `_unshard` / `_reshard`,
`_traversal_utils._get_fsdp_states` / `_get_fsdp_handles`, `_common_utils._get_module_fsdp_state`), which the switch
points at ours.

Oracle: torch's FSDP1 on the same model, side by side: the same names give the same types and values, and the same
calls (an unshard and reshard of every handle between steps, audiocraft's purge of gathered parameters, an EMA update
over `_get_fsdp_handles`) give the same parameters and the same training after them. Torch's FSDP1 cannot offload
parameters without an accelerator: ours offloaded is held to torch's values without offload.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest
import torch
import torch.distributed.fsdp._common_utils as torch_common
import torch.distributed.fsdp._flat_param as torch_flat_param
import torch.distributed.fsdp._runtime_utils as torch_runtime
import torch.distributed.fsdp._traversal_utils as torch_traversal
from torch import nn

import fsdp_legacy
from fsdp_legacy import naming
from fsdp_utils import Config, assert_close, batch, build_ours, build_torch_fsdp, loss_of, optimizer, switched_on
from harness import run_on_ranks

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
MIXED = ("bfloat16",) * 3


def _config(strategy: str, use_orig_params: bool, mixed: bool, **extra: object) -> Config:
    mixed_precision = MIXED if mixed else None
    return Config("net", strategy, use_orig_params=use_orig_params, mixed_precision=mixed_precision, extra=extra)


def _input(config: Config, step: int) -> torch.Tensor:
    x = batch(config, step)
    return x.to(torch.bfloat16) if config.mixed_precision else x


def _step(model: nn.Module, config: Config, opt: torch.optim.Optimizer, step: int) -> float:
    loss = loss_of(model(_input(config, step)).float())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _units(model: nn.Module) -> list:
    return type(model).fsdp_modules(model)


# ----------------------------------------------------------------------------------------------------------------------
# The names, through a step


def _handle_row(unit: nn.Module, sharded_size: torch.Size) -> dict[str, object]:
    """What code reads of a unit's handle, as comparable values (groups and modules by their role)."""
    handle = unit._handle
    return {
        "process_group is the unit's": handle.process_group is unit.process_group,
        "rank, world_size": (handle.rank, handle.world_size),
        "device": handle.device,
        "_sharding_strategy": (handle._sharding_strategy.name, handle._sharding_strategy.value),
        "uses_sharded_strategy": handle.uses_sharded_strategy,
        "_use_orig_params": handle._use_orig_params,
        "_offload_params": handle._offload_params,
        "_fully_sharded_module": (handle._fully_sharded_module is unit.module, type(handle._fully_sharded_module)),
        "_training_state": handle._training_state.name,
        "dtypes": (handle._fwd_bwd_param_dtype, handle._reduce_dtype, handle._orig_param_dtype),
        "is_sharded(shard-sized, full-sized)": (
            handle.is_sharded(torch.empty(sharded_size)),
            handle.is_sharded(torch.empty(sharded_size.numel() * handle.world_size + 1)),
        ),
        "flat_param is the unit's": handle.flat_param is unit._flat_param,
    }


def _unit_rows(model: nn.Module, sharded_sizes: list[torch.Size], stage: str) -> list[dict[str, object]]:
    rows = []
    for unit, sharded_size in zip(_units(model), sharded_sizes, strict=True):
        row: dict[str, object] = {
            "_is_root": unit._is_root,
            "_fsdp_wrapped_module is module": unit._fsdp_wrapped_module is unit.module,
            **{name: getattr(unit, name) for name in torch_runtime.HOMOGENEOUS_ATTR_NAMES},
            **_handle_row(unit, sharded_size),
            "is_sharded(flat_param)": unit._handle.is_sharded(unit._handle.flat_param),  # (after forward too)
            "_skipped_use_sharded_views": unit._handle._skipped_use_sharded_views,
        }
        rows.append(row)
    if model._is_root:  # torch sets `_all_handles` on the root at lazy init
        rows.append({"_all_handles": [[h is u._handle for u in _units(model)] for h in model._all_handles]})
    return rows


def _names_match_torch(strategy: str, use_orig_params: bool) -> None:
    for mixed in (False, True):
        config = _config(strategy, use_orig_params, mixed)
        theirs = build_torch_fsdp(config)
        _, ours = build_ours(config)
        sizes = [unit._handle.flat_param._sharded_size for unit in _units(theirs)]
        rows: dict[str, list] = {}
        for label, model in (("torch", theirs), ("ours", ours)):
            stages = {"built": _unit_rows(model, sizes, "built")}
            if label == "torch":
                torch_runtime._lazy_init(model, model)
            else:
                model._lazy_init()  # (the wrapper's own, which torch 2.13's lacks)
            stages["lazy init"] = _unit_rows(model, sizes, "lazy init")
            loss = loss_of(model(_input(config, 0)).float())
            stages["forward"] = _unit_rows(model, sizes, "forward")
            loss.backward()
            stages["backward"] = _unit_rows(model, sizes, "backward")
            rows[label] = list(stages.items())
        for (stage, expected), (_, actual) in zip(rows["torch"], rows["ours"], strict=True):
            assert actual == expected, f"{config.name()} after {stage}"
        # Ours are our enums, equal to torch's members of the same name both ways (code compares them with torch's).
        handle = ours._handle
        assert handle._sharding_strategy == torch_flat_param.HandleShardingStrategy[strategy]
        assert torch_flat_param.HandleShardingStrategy[strategy] == handle._sharding_strategy
        handle._training_state = torch_common.HandleTrainingState.BACKWARD_PRE  # as code resets it, torch's member
        assert type(handle.training_state) is fsdp_legacy.handle.HandleTrainingState
        assert handle._training_state == torch_common.HandleTrainingState.BACKWARD_PRE
        handle._training_state = torch_common.HandleTrainingState.IDLE


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_handle_and_wrapper_names_match_torch(strategy: str, use_orig_params: bool) -> None:
    run_on_ranks(_names_match_torch, 2, strategy, use_orig_params)


# ----------------------------------------------------------------------------------------------------------------------
# The helpers under torch's names


def _helpers_resolve_to_ours() -> None:
    config = _config("FULL_SHARD", False, False)
    theirs = build_torch_fsdp(config)
    their_handles = torch_traversal._get_fsdp_handles(theirs)
    their_states = torch_traversal._get_fsdp_states(theirs)
    _, ours = build_ours(config)
    with switched_on():
        # torch's helpers on torch's FSDP1 still answer as torch's (the switch passes what is not ours on).
        assert torch_traversal._get_fsdp_handles(theirs) == their_handles
        assert torch_traversal._get_fsdp_states(theirs) == their_states
        assert torch_common._get_module_fsdp_state(theirs) is theirs
        assert torch_common._get_module_fsdp_state(nn.Linear(2, 2)) is None
        assert torch_traversal._get_fsdp_handles(nn.Linear(2, 2)) == []
        expected_init = torch_runtime._lazy_init(theirs, theirs), torch_runtime._lazy_init(theirs, theirs)
        assert expected_init == (theirs, None)  # torch's: the state once, then None
        # ... and on ours, what they give on torch's.
        assert (torch_runtime._lazy_init(ours, ours), torch_runtime._lazy_init(ours, ours)) == (ours, None)
        assert ours._is_root and not any(unit._is_root for unit in _units(ours)[1:])
        assert torch_traversal._get_fsdp_states(ours) == _units(ours)
        assert torch_traversal._get_fsdp_handles(ours) == [unit._handle for unit in _units(ours)] == ours._all_handles
        assert [torch_common._get_module_fsdp_state(m) for m in ours.modules()] == [
            m if isinstance(m, fsdp_legacy.FullyShardedDataParallel) else None for m in ours.modules()
        ]
        # torch's own helpers that look states up through the names the switch replaced work on ours too.
        assert torch_runtime._get_fsdp_root_states(ours) == [ours]
        assert torch_runtime._is_fsdp_root(ours, ours) and not torch_runtime._is_fsdp_root(_units(ours)[1], ours)
        assert torch_common._get_sharding_strategy(ours._handle) is torch_flat_param.HandleShardingStrategy.FULL_SHARD
        assert torch_common._module_handle(ours, ours) is ours._handle and torch_common._has_fsdp_params(ours, ours)
        # Constants torch exports are plain values our package uses alike.
        assert (torch_common.FSDP_WRAPPED_MODULE, torch_common.FSDP_PREFIX) == (
            naming.FSDP_WRAPPED_MODULE,
            naming.FSDP_PREFIX,
        )
        import torch.distributed.fsdp._unshard_param_utils as torch_unshard_utils

        assert torch_unshard_utils.FLAT_PARAM == naming.FLAT_PARAM == ours._handle.flat_name
        assert [torch_common.clean_tensor_name(name) for name, _ in ours.named_buffers()] == ["buf"]
        for name in torch_runtime.HOMOGENEOUS_ATTR_NAMES:
            assert {getattr(unit, name) for unit in _units(ours)} == {getattr(unit, name) for unit in _units(theirs)}
        # torch before 2.1 took lists: code that finds our units' `_handles` list takes that branch (audiocraft).
        torch_runtime._unshard(ours, ours._handles, None, None)
        assert ours.l1.weight.shape == (5, 3) and not ours._handle.is_sharded(ours._handle.flat_param)
        torch_runtime._reshard(ours, ours._handles, [True for _ in ours._handles])
        assert ours.l1.weight.is_meta and ours._handle.is_sharded(ours._handle.flat_param)
    assert torch_runtime._lazy_init is not fsdp_legacy.torch_helpers._lazy_init
    assert torch_traversal._get_fsdp_handles(ours) == []  # torch's own again: our units are no state of torch's


def test_torch_helpers_under_the_switch_act_on_our_units_as_on_torchs() -> None:
    run_on_ranks(_helpers_resolve_to_ours, 2)


# ----------------------------------------------------------------------------------------------------------------------
# Unshard and reshard every handle between steps, as code drives them


def _gather_every_handle(model: nn.Module, config: Config) -> dict[str, Any]:
    """One step, then every handle unsharded through torch's helpers, what is shown read, resharded, and one more step
    (the helpers are looked up in torch's modules at each call: ours while the switch is on)."""
    opt = optimizer(model)
    seen: dict[str, Any] = {"first loss": _step(model, config, opt, 0)}
    torch_runtime._lazy_init(model, model)
    handles = torch_traversal._get_fsdp_handles(model)
    for unit in _units(model):
        streams = getattr(unit, "_unshard_stream", None), getattr(unit, "_pre_unshard_stream", None)
        torch_runtime._unshard(unit, unit._handle, *streams)
    seen["flat params"] = [handle.flat_param.detach().clone() for handle in handles]
    seen["gathered bytes"] = [
        handle._get_padded_unsharded_flat_param().untyped_storage().size()
        for handle in handles
        if handle.uses_sharded_strategy
    ]
    seen["attributes"] = {
        f"{name}.{attr}": getattr(module, attr).detach().clone()
        for name, module in model.named_modules()
        for attr in ("weight", "bias")
        if isinstance(module, nn.Linear) and getattr(module, attr) is not None
    }
    seen["parameters"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    for unit in _units(model):
        torch_runtime._reshard(unit, unit._handle, unit._handle.uses_sharded_strategy)  # (torch's asserts for NO_SHARD)
    seen["resharded"] = [handle.is_sharded(handle.flat_param) for handle in handles]
    seen["freed bytes"] = [
        handle._get_padded_unsharded_flat_param().untyped_storage().size()
        for handle in handles
        if handle.uses_sharded_strategy
    ]
    seen["parameters after"] = {name: tuple(p.shape) for name, p in model.named_parameters()}
    seen["second loss"] = _step(model, config, opt, 1)
    seen["trained"] = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    return seen


def _unshard_reshard_matches_torch(strategy: str, use_orig_params: bool) -> None:
    for mixed in (False, True):
        config = _config(strategy, use_orig_params, mixed)
        expected = _gather_every_handle(build_torch_fsdp(config), config)
        for offload in (False, True):  # (torch's FSDP1 offloads only with an accelerator: its values without)
            extra = {"cpu_offload": fsdp_legacy.CPUOffload(offload_params=True)} if offload else {}
            _, ours = build_ours(_config(strategy, use_orig_params, mixed, **extra))
            with switched_on():
                actual = _gather_every_handle(ours, config)
            what = f"{config.name()}{' offloaded' if offload else ''}"
            for key in ("first loss", "second loss", "gathered bytes", "resharded", "freed bytes", "parameters after"):
                assert actual[key] == expected[key], f"{what}: {key}"
            for mine, theirs in zip(actual["flat params"], expected["flat params"], strict=True):
                # (ours keeps the world-size padding on the gathered flat parameter; torch shows it unpadded)
                assert_close(mine[: theirs.numel()], theirs, f"{what}: gathered flat parameter")
            for key in ("attributes", "trained") + (("parameters",) if use_orig_params else ()):
                mine_all, theirs_all = actual[key], expected[key]
                assert mine_all.keys() == theirs_all.keys(), f"{what}: {key}"
                for name, value in theirs_all.items():
                    assert_close(mine_all[name], value, f"{what}: {key} {name}")


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unshard_and_reshard_of_every_handle_through_torch_helpers_match_torch(
    strategy: str, use_orig_params: bool
) -> None:
    run_on_ranks(_unshard_reshard_matches_torch, 2, strategy, use_orig_params)


# ----------------------------------------------------------------------------------------------------------------------
# Real code's uses


def _purge_like_audiocraft(model: nn.Module) -> list[int]:
    """audiocraft's `purge_fsdp`: reshard every unit still gathered (before loading other weights into the shards);
    returns the gathered bytes it found."""
    found = []
    for unit in _units(model):
        handle = unit._handle
        size = handle._get_padded_unsharded_flat_param()._typed_storage()._size()
        found.append(size)
        if size:
            torch_runtime._reshard(unit, handle, True)
    return found


@torch.no_grad()
def _ema_update_like_trainers(ema: nn.Module, model: nn.Module, decay: float = 0.5) -> None:
    """An EMA of the flat shards over `_traversal_utils._get_fsdp_handles`, as open-source trainers write it."""
    for ema_handle, handle in zip(
        torch_traversal._get_fsdp_handles(ema), torch_traversal._get_fsdp_handles(model), strict=True
    ):
        if handle.flat_param.requires_grad:
            ema_handle.flat_param.data.mul_(decay).add_(handle.flat_param.data, alpha=1 - decay)


def _real_code(model: nn.Module, ema: nn.Module, config: Config) -> dict[str, Any]:
    opt = optimizer(model)
    with torch.no_grad():  # evaluation
        model(_input(config, 0))
    seen: dict[str, Any] = {"after eval": _purge_like_audiocraft(model)}
    if not config.mixed_precision:  # (torch's FSDP1 in low precision breaks the next step after such a forward)
        loss_of(model(_input(config, 0)).float())  # a forward whose backward never runs: units stay gathered
        seen["after forward"] = _purge_like_audiocraft(model)
    seen["again"] = _purge_like_audiocraft(model)
    seen["losses"] = [_step(model, config, opt, step) for step in (1, 2)]
    _ema_update_like_trainers(ema, model)
    seen["ema shards"] = [handle.flat_param.detach().clone() for handle in torch_traversal._get_fsdp_handles(ema)]
    seen["ema loss"] = loss_of(ema(_input(config, 3)).float()).item()
    return seen


def _real_code_matches_torch(strategy: str) -> None:
    for use_orig_params, mixed in itertools.product((False, True), (False, True)):
        config = _config(strategy, use_orig_params, mixed)
        expected = _real_code(build_torch_fsdp(config), build_torch_fsdp(config, seed=1), config)
        ours, ema = build_ours(config)[1], build_ours(config, seed=1)[1]
        with switched_on():
            actual = _real_code(ours, ema, config)
        resharded = [0] * len(_units(ours))
        # torch keeps the root (SHARD_GRAD_OP: every unit) gathered after a forward without grad, and its next
        # forward reuses that gathered copy even if the shards changed meanwhile; ours reshards every unit there.
        assert expected["after eval"][0] > 0 and actual["after eval"] == resharded, config.name()
        assert actual.get("after forward") == expected.get("after forward"), config.name()
        assert actual["again"] == expected["again"] == resharded, config.name()
        assert actual["losses"] == expected["losses"], config.name()
        assert_close(torch.tensor(actual["ema loss"]), torch.tensor(expected["ema loss"]), f"{config.name()} ema")
        for mine, theirs in zip(actual["ema shards"], expected["ema shards"], strict=True):
            assert_close(mine, theirs, f"{config.name()}: EMA shard")


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_purge_and_ema_over_handles_like_real_code_match_torch(strategy: str) -> None:
    run_on_ranks(_real_code_matches_torch, 2, strategy)


def _handle_methods(ours: bool, use_orig_params: bool) -> list[Any]:
    """The handle driven by its own methods, as code written for torch's does: `needs_unshard()`, `unshard()` (the
    flat parameter then holds the gathered data), `post_unshard()`, `reshard(free_unsharded_flat_param=True)`."""
    config = _config("FULL_SHARD", use_orig_params, False)
    model = build_ours(config)[1] if ours else build_torch_fsdp(config)
    model(_input(config, 0))  # the lazy initialisation
    handle = _units(model)[-1]._handle
    flat = handle.flat_param
    seen: list[Any] = [handle.needs_unshard()]
    handle.pre_unshard()
    handle.unshard()
    unpadded = flat._unpadded_unsharded_size.numel()
    seen += [handle.needs_unshard(), flat[:unpadded].detach().clone()]
    handle.post_unshard()
    handle.reshard(free_unsharded_flat_param=True)
    handle.post_reshard()
    seen += [handle.needs_unshard(), flat.numel(), handle.is_sharded(flat)]
    return seen


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_the_handle_driven_by_its_own_methods_matches_torch(use_orig_params: bool) -> None:
    theirs = run_on_ranks(_handle_methods, 2, False, use_orig_params)

    ours = run_on_ranks(_handle_methods, 2, True, use_orig_params)
    for mine, torchs in zip(ours, theirs, strict=True):
        assert mine[:2] == torchs[:2] and mine[3:] == torchs[3:], (mine, torchs)
        assert torch.equal(mine[2], torchs[2])


def _handle_class_under_the_switch() -> None:
    torch_handle_class = torch_flat_param.FlatParamHandle
    with switched_on():
        _, ours = build_ours(Config("net"))
        assert torch_flat_param.FlatParamHandle is fsdp_legacy.handle.FlatParamHandle
        assert all(isinstance(handle, torch_flat_param.FlatParamHandle) for handle in ours._all_handles)
    assert torch_flat_param.FlatParamHandle is torch_handle_class, "uninstall puts torch's class back"


def test_isinstance_of_torchs_flat_param_handle_holds_under_the_switch() -> None:
    """Code that checks `isinstance(unit._handle, torch.distributed.fsdp._flat_param.FlatParamHandle)` (Galvatron-
    style helpers driving the runtime) finds ours a handle while the switch is on, and torch's class again after."""
    run_on_ranks(_handle_class_under_the_switch, 2)


def _explicit_prefetch(use_orig_params: bool) -> dict[str, Any]:
    import torch.distributed.fsdp as fsdp  # torch's, or ours through the switch

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))
    inner[0] = fsdp.FullyShardedDataParallel(inner[0], device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    inner[2] = fsdp.FullyShardedDataParallel(inner[2], device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    model = fsdp.FullyShardedDataParallel(inner, device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[str, Any] = {"losses": []}
    for step in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step + 10 * torch.distributed.get_rank()))
        if step == 2:  # (torch's needs its lazy init, the first forward, before; step 1 is the baseline)
            assert inner[2]._unshard() is None
            flat = inner[2]._handle.flat_param
            seen["gathered after _unshard()"] = flat.numel() >= flat._unpadded_unsharded_size.numel()
        pending = inner[2]._unshard(async_op=True) if step == 3 else None
        with _counting_our_all_gathers() as gathers:
            loss = model(x).pow(2).sum()
        if pending is not None:  # waited for after the forward that used it: nothing left to do
            pending.wait()
        seen.setdefault("elements our forward gathered", []).append(sum(gathers))
        loss.backward()
        optim.step()
        optim.zero_grad()
        seen["losses"].append(loss.item())
    return seen


@contextlib.contextmanager
def _counting_our_all_gathers() -> Any:
    """The sizes of the all-gathers fsdp_legacy issues meanwhile (none with torch's FSDP1, which does not use ours)."""
    from fsdp_legacy import collectives

    calls: list[int] = []
    original = collectives.all_gather

    def counted(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(output.numel())
        return original(output, *args, **kwargs)

    collectives.all_gather = counted
    try:
        yield calls
    finally:
        collectives.all_gather = original


def _explicit_prefetch_side_by_side(use_orig_params: bool) -> None:
    observed = {}
    for label in ("torch", "ours"):
        with switched_on() if label == "ours" else contextlib.nullcontext():
            observed[label] = _explicit_prefetch(use_orig_params)
    assert observed["ours"]["gathered after _unshard()"] and observed["torch"]["gathered after _unshard()"]
    _, baseline, *prefetched = observed["ours"]["elements our forward gathered"]
    unit = 8 * 5 + 5 + (-(8 * 5 + 5) % 2)  # the prefetched unit's padded flat parameter (use_orig_params: aligned)
    assert all(baseline - n >= unit for n in prefetched), (
        "the forward used the prefetched gather",
        baseline,
        prefetched,
    )
    for a, b in zip(observed["ours"]["losses"], observed["torch"]["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), observed


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_explicit_prefetch_with_unshard_trains_as_torch(use_orig_params: bool) -> None:
    """`unit._unshard()` and `unit._unshard(async_op=True).wait()` (torch's explicit prefetch) before a forward:
    the unit's parameters are gathered ahead, the forward uses them, and training equals torch's FSDP1's."""
    run_on_ranks(_explicit_prefetch_side_by_side, 2, use_orig_params)
