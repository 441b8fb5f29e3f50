"""Activation-checkpoint wrappers (torch.distributed.algorithms._checkpoint.checkpoint_wrapper) around FSDP units'
modules, applied after wrapping as Accelerate and Lightning do, or before: state dicts of every type, summon,
optimizer state. Oracle: torch's FSDP1 with the same wrappers, and the plain model's own state dict keys."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
from test_optim_state import osd
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

import fsdp_legacy
import models
from fsdp_legacy.state import state_dict as our_state_dict
from fsdp_utils import MODELS, Config, assert_close, batch, build_ours, build_torch_fsdp, loss_of, optimizer
from harness import run_on_ranks

CONFIG = Config("transformer", policy="block")
RECORD_SUFFIX = "_meta"  # fsdp_legacy's layout record beside each LOCAL flat parameter (docs/compatibility.md)


def _checkpoint_blocks(model: torch.nn.Module) -> None:
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, models.TransformerBlock),
    )


def _pair(use_orig_params: bool, strategy: str = "FULL_SHARD") -> tuple[torch.nn.Module, torch.nn.Module]:
    config = Config(CONFIG.model, strategy, CONFIG.policy, use_orig_params)
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    for model in (ours, theirs):
        _checkpoint_blocks(model)
        assert any(type(m).__name__ == "CheckpointWrapper" for m in model.modules())
        opt = optimizer(model)
        for step in range(2):
            loss_of(model(batch(config, step))).backward()
            opt.step()
            opt.zero_grad()
    return ours, theirs


def _values(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, ShardedTensor):
            shards = value.local_shards()
            value = shards[0].tensor if shards else None
        out[key] = value
    return out


def _state_dicts_match_torch(use_orig_params: bool, strategy: str) -> None:
    ours, theirs = _pair(use_orig_params, strategy)
    plain_keys = list(MODELS[CONFIG.model][0]().state_dict())
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        states = []
        for model, enums in ((ours, fsdp_legacy), (theirs, _torch_fsdp())):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with type(model).state_dict_type(model, enums.StateDictType[kind]):
                    states.append(model.state_dict())
        mine, torch_s = states
        mine = {k: v for k, v in mine.items() if not k.endswith(RECORD_SUFFIX)}
        assert list(mine) == list(torch_s), kind
        if kind != "LOCAL_STATE_DICT" and strategy != "NO_SHARD":
            assert list(mine) == plain_keys, f"{kind}: the plain model's keys, complete and clean"
        for key, value in _values(mine).items():
            expected = _values(torch_s)[key]
            if value is None or expected is None:
                assert value is expected, key
            else:
                assert_close(value, expected, f"{kind} {key}")


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_state_dicts_with_wrappers_applied_after_wrapping_match_torch(use_orig_params: bool, strategy: str) -> None:
    run_on_ranks(_state_dicts_match_torch, 2, use_orig_params, strategy)


@pytest.mark.parametrize("world_size", [1, 4])
def test_state_dicts_with_wrappers_at_one_and_four_ranks_match_torch(world_size: int) -> None:
    run_on_ranks(_state_dicts_match_torch, world_size, True, "FULL_SHARD")


def _torch_fsdp():  # type: ignore[no-untyped-def]
    import torch.distributed.fsdp as torch_fsdp

    return torch_fsdp


def _summon_and_optimizer_state_match_torch(use_orig_params: bool) -> None:
    ours, theirs = _pair(use_orig_params)
    summoned = []
    for model in (ours, theirs):
        with type(model).summon_full_params(model):
            summoned.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert list(summoned[0]) == list(summoned[1])
    for name, value in summoned[0].items():
        assert_close(value, summoned[1][name], f"summoned {name}")
    osds = []
    torch_fsdp = _torch_fsdp()
    for model, lib, optim_config in (
        (ours, fsdp_legacy, None),
        # torch's default FULL optimizer config (offload_to_cpu) returns aliased values on CPU (test_optim_state)
        (theirs, torch_fsdp, torch_fsdp.FullOptimStateDictConfig(offload_to_cpu=False)),
    ):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        loss_of(model(batch(CONFIG, 5))).backward()
        opt.step()
        osds.append(osd(model, opt, lib, "FULL_STATE_DICT", optim_config))
    assert list(osds[0]["state"]) == list(osds[1]["state"])
    for fqn, state in osds[0]["state"].items():
        for name, value in state.items():
            assert_close(value, osds[1]["state"][fqn][name], f"optimizer {fqn}.{name}")


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_summon_and_optimizer_state_with_wrappers_applied_after_wrapping(use_orig_params: bool) -> None:
    run_on_ranks(_summon_and_optimizer_state_match_torch, 2, use_orig_params)


def _round_trip(use_orig_params: bool, source_wrapped: bool, destination_wrapped: bool, kind: str) -> None:
    """Save from a model with (or without) checkpoint wrappers, load into one without (or with) them."""
    config = Config(CONFIG.model, "FULL_SHARD", CONFIG.policy, use_orig_params)
    _, source = build_ours(config)
    if source_wrapped:
        _checkpoint_blocks(source)
    opt = optimizer(source)
    loss_of(source(batch(config, 0))).backward()
    opt.step()
    _, destination = build_ours(config, seed=1)
    if destination_wrapped:
        _checkpoint_blocks(destination)
    state_type = fsdp_legacy.StateDictType[kind]
    config_cls = fsdp_legacy.FullStateDictConfig if kind == "FULL_STATE_DICT" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = (config_cls(offload_to_cpu=True, rank0_only=False),) if config_cls else ()
        with fsdp_legacy.FullyShardedDataParallel.state_dict_type(source, state_type, *args):
            saved = source.state_dict()
        with fsdp_legacy.FullyShardedDataParallel.state_dict_type(destination, state_type):
            result = destination.load_state_dict(saved)
    assert not result.missing_keys and not result.unexpected_keys
    for model in (source, destination):
        model.eval()
    with torch.no_grad():
        assert_close(destination(batch(config, 1)), source(batch(config, 1)), "outputs after the round trip")
    dist.barrier()


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"])
@pytest.mark.parametrize("wrapped", [(True, False), (False, True), (True, True)], ids=["source", "destination", "both"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_round_trip_across_wrapping(use_orig_params: bool, wrapped: tuple[bool, bool], kind: str) -> None:
    run_on_ranks(_round_trip, 2, use_orig_params, *wrapped, kind)


def _wrapped_before_fsdp(use_orig_params: bool) -> None:
    """Checkpoint wrappers applied first, FSDP units around them: clean keys too, equal to torch's."""
    states = []
    for fsdp_module, wrap_module, extra in (
        (fsdp_legacy, fsdp_legacy.wrap, {}),
        (_torch_fsdp(), _torch_fsdp().wrap, {"device_id": torch.device("cpu")}),
    ):
        torch.manual_seed(0)
        model = MODELS[CONFIG.model][0]()
        _checkpoint_blocks(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = fsdp_module.FullyShardedDataParallel(
                model,
                auto_wrap_policy=wrap_module.ModuleWrapPolicy({models.TransformerBlock}),
                use_orig_params=use_orig_params,
                **extra,
            )
            loss_of(wrapped(batch(CONFIG, 0))).backward()
            states.append(wrapped.state_dict())
    assert list(states[0]) == list(states[1]) == list(MODELS[CONFIG.model][0]().state_dict())
    for key, value in states[0].items():
        assert_close(value, states[1][key], key)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_wrappers_applied_before_wrapping(use_orig_params: bool) -> None:
    run_on_ranks(_wrapped_before_fsdp, 2, use_orig_params)


def _incomplete_state_dict_raises() -> None:
    _, ours = build_ours(CONFIG)
    original = our_state_dict._walk

    def losing_a_module(unit):  # type: ignore[no-untyped-def]
        return [(path, module, nested) for path, module, nested in original(unit) if path != "norm"]

    our_state_dict._walk = losing_a_module
    try:
        with pytest.raises(RuntimeError, match="could not place .*incomplete"):
            ours.state_dict()
    finally:
        our_state_dict._walk = original


def test_a_state_dict_that_would_miss_parameters_raises_on_every_rank() -> None:
    run_on_ranks(_incomplete_state_dict_raises, 2)
