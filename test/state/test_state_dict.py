"""Model state dicts (FULL, SHARDED, LOCAL) against torch's FSDP1 and the unwrapped model: the settings API, keys,
order, values and ShardedTensor/DTensor metadata of every type, round trips (also through torch.save and DCP, across
world sizes), cross-loads to and from torch's FSDP1, and every load error.

Torch's FSDP1 runs on CPU (device_id=cpu) as an oracle; its CPU bug with offload_to_cpu=True is never triggered.
"""

import contextlib
import copy
import io
import warnings
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp_legacy
import models
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import StateDictType
from fsdp_legacy.convert.record import records_in_metadata
from fsdp_legacy.state import state_dict as our_state_dict
from fsdp_utils import Config, assert_close, batch, build_ours, build_torch_fsdp, full_params, loss_of, train
from harness import run_on_ranks

TYPES = ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"]
NO_SHARD_WARNING = "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned."


# --------------------------------------------------------------------------------------------------------------------
# Helpers (run inside the ranks)


def state_dict(model: nn.Module, lib: Any, kind: str, config: Any = None) -> dict:
    """`model.state_dict()` under `kind`; `lib` is fsdp_legacy or torch.distributed.fsdp."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType[kind], config):
            return model.state_dict()


def load(model: nn.Module, lib: Any, kind: str, sd: dict, strict: bool = True) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType[kind]):
            return model.load_state_dict(sd, strict=strict)


def describe(value: Any) -> tuple:
    """What must match torch: the container type, global shape and dtype, per-shard metadata, the local data.

    TensorProperties.requires_grad is left out on purpose: torch's LOCAL shards are grad-requiring views of the
    FlatParameter, ours are detached."""
    if isinstance(value, ShardedTensor):
        meta = value.metadata()
        shards = [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in meta.shards_metadata]
        props = meta.tensor_properties
        local = [(s.metadata.shard_offsets, s.tensor) for s in value.local_shards()]
        return ("ShardedTensor", tuple(meta.size), props.dtype, props.layout, props.memory_format, shards, local)
    if isinstance(value, DTensor):
        return ("DTensor", tuple(value.shape), value.dtype, tuple(map(str, value.placements)), value.to_local())
    return ("Tensor", tuple(value.shape), value.dtype, value)


def checked_records(sd: dict) -> dict:
    """`sd` itself, after checking that each LOCAL flat parameter's layout record is in its _metadata (not among the
    keys, which are torch's: docs/compatibility.md) and describes it."""
    flats = [key for key in sd if key.endswith("_flat_param")]
    records = {r.flat_key: r for r in records_in_metadata(getattr(sd, "_metadata", None), "sd")}
    assert sorted(records) == sorted(flats), (sorted(records), flats)
    assert all(records[key].numel == sd[key].size(0) for key in flats)
    return sd


def assert_same(ours: dict, theirs: dict, what: str) -> None:
    assert list(ours) == list(theirs), (
        f"{what}: keys or their order differ:\n ours  {list(ours)}\n torch {list(theirs)}"
    )
    for key in theirs:
        a, b = describe(ours[key]), describe(theirs[key])
        assert a[:-1] == b[:-1], f"{what}: {key} differs:\n ours  {a[:-1]}\n torch {b[:-1]}"
        if a[0] == "ShardedTensor":
            assert [o for o, _ in a[-1]] == [o for o, _ in b[-1]], f"{what}: {key} local shard offsets"
            for (_, x), (_, y) in zip(a[-1], b[-1], strict=True):
                assert_close(x, y, f"{what}: {key} local shard")
        else:
            assert_close(a[-1], b[-1], f"{what}: {key}")


def torch_full(model: nn.Module) -> dict:
    """torch FSDP1's FULL_STATE_DICT (default config: offload_to_cpu=False works on CPU)."""
    return state_dict(model, torch_fsdp, "FULL_STATE_DICT")


def assert_full_equal(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{what}: {key}"


def next_loss(model: nn.Module, config: Config, step: int = 50) -> torch.Tensor:
    """A plain-SGD step's loss (no momentum state, so a reloaded model and its source must agree exactly)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss = loss_of(model(batch(config, step)))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def is_sharded(unit: FSDP) -> bool:
    handle = unit._handle
    if handle is None:
        return True
    return handle.flat_param.data_ptr() == handle.local_shard.data_ptr() and (
        not handle.sharded or handle.full_padded.untyped_storage().size() == 0
    )


# --------------------------------------------------------------------------------------------------------------------
# Settings: set_state_dict_type / get_state_dict_type / state_dict_type


def _settings_api() -> None:
    _, ours = build_ours(Config("net"))
    theirs = build_torch_fsdp(Config("net"))
    torch_get = torch_fsdp.FullyShardedDataParallel.get_state_dict_type
    fields = lambda s: (s.state_dict_type.name, vars(s.state_dict_config), vars(s.optim_state_dict_config))  # noqa: E731
    assert fields(FSDP.get_state_dict_type(ours)) == fields(torch_get(theirs)), "torch's defaults"

    def captured(fn, *args) -> tuple[Any, list]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            return fn(*args), [(w.category, str(w.message)) for w in caught]

    for kind in TYPES:
        ours_prev, ours_warnings = captured(FSDP.set_state_dict_type, ours, fsdp_legacy.StateDictType[kind])
        theirs_prev, theirs_warnings = captured(
            torch_fsdp.FullyShardedDataParallel.set_state_dict_type, theirs, torch_fsdp.StateDictType[kind]
        )
        assert ours_warnings == theirs_warnings and ours_warnings[0][0] is FutureWarning
        assert fields(ours_prev) == fields(theirs_prev), "the previous settings are returned"
        now = FSDP.get_state_dict_type(ours)
        assert fields(now) == fields(torch_get(theirs))
        assert all(u._state_dict_config is now.state_dict_config for u in FSDP.fsdp_modules(ours)), "all units set"
    FSDP.set_state_dict_type(ours, StateDictType.FULL_STATE_DICT)

    with pytest.raises(
        RuntimeError,
        match="Expected state_dict_config of type .*ShardedStateDictConfig.* but got .*FullStateDictConfig",
    ):
        FSDP.set_state_dict_type(ours, StateDictType.SHARDED_STATE_DICT, fsdp_legacy.FullStateDictConfig())
    with pytest.raises(RuntimeError, match="Expected optim_state_dict_config of type"):
        FSDP.set_state_dict_type(ours, StateDictType.FULL_STATE_DICT, None, fsdp_legacy.ShardedOptimStateDictConfig())

    # The context manager warns on enter and on exit (torch calls set_state_dict_type twice) and restores.
    config = fsdp_legacy.ShardedStateDictConfig(offload_to_cpu=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with FSDP.state_dict_type(ours, StateDictType.SHARDED_STATE_DICT, config):
            assert FSDP.get_state_dict_type(ours).state_dict_config is config
    assert [w.category for w in caught] == [FutureWarning, FutureWarning]
    assert FSDP.get_state_dict_type(ours).state_dict_type == StateDictType.FULL_STATE_DICT
    # Unlike torch, the settings come back after an exception too.
    with pytest.raises(KeyError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(ours, StateDictType.LOCAL_STATE_DICT):
            raise KeyError("boom")
    assert FSDP.get_state_dict_type(ours).state_dict_type == StateDictType.FULL_STATE_DICT

    # torch's enums and configs are accepted (mixed imports); a non-FSDP container works; no units gives None.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        FSDP.set_state_dict_type(
            nn.Sequential(ours), torch_fsdp.StateDictType.SHARDED_STATE_DICT, torch_fsdp.ShardedStateDictConfig()
        )
    settings = FSDP.get_state_dict_type(ours)
    assert settings.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert type(settings.state_dict_config) is fsdp_legacy.ShardedStateDictConfig
    assert FSDP.get_state_dict_type(nn.Linear(2, 2)) is None

    # Units with different settings are refused.
    ours.block._state_dict_type = StateDictType.LOCAL_STATE_DICT
    with pytest.raises(AssertionError, match="All FSDP modules must have the same state dict settings"):
        FSDP.get_state_dict_type(ours)
    with pytest.raises(AssertionError, match="All FSDP modules should have the same state_dict_type"):
        FSDP.set_state_dict_type(ours, StateDictType.FULL_STATE_DICT)


def test_settings_api() -> None:
    run_on_ranks(_settings_api, 2)


# --------------------------------------------------------------------------------------------------------------------
# Against torch's FSDP1 and the unwrapped model


def _matches_torch(config: Config) -> None:
    reference, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    train(ours, config)
    train(theirs, config)
    train(DDP(reference), config)
    for kind in TYPES:
        assert_same(checked_records(state_dict(ours, fsdp_legacy, kind)), state_dict(theirs, torch_fsdp, kind), kind)
    full = state_dict(ours, fsdp_legacy, "FULL_STATE_DICT")
    expected = reference.state_dict()
    assert list(full) == list(expected), "FULL keys in the unwrapped model's order"
    for key, value in expected.items():
        assert_close(full[key], value, f"FULL {key} against the unwrapped model")
    if config.model == "transformer":  # tied: both names, separate copies
        assert full["head.weight"].data_ptr() != full["tok.weight"].data_ptr()
        assert torch.equal(full["head.weight"], full["tok.weight"])
    assert all(is_sharded(u) for u in FSDP.fsdp_modules(ours)), "state_dict() leaves every unit sharded"


TORCH_CASES = (
    [(Config("net", use_orig_params=uop, steps=2), world) for uop in (False, True) for world in (2, 4)]
    + [(Config("transformer", use_orig_params=uop, steps=2), 2) for uop in (False, True)]
    + [
        (Config("net", policy="always", use_orig_params=True, steps=2), 2),
        (Config("net", strategy="SHARD_GRAD_OP", policy="size", steps=2), 4),
    ]
)


@pytest.mark.parametrize("config,world_size", TORCH_CASES, ids=[f"{c.name()}_w{w}" for c, w in TORCH_CASES])
def test_matches_torch_fsdp1(config: Config, world_size: int) -> None:
    run_on_ranks(_matches_torch, world_size, config)


def _ignored_params_match_torch(use_orig_params: bool) -> None:
    torch.manual_seed(0)
    net = models.Net()
    ours = FSDP(net, use_orig_params=use_orig_params, ignored_states=[net.l1.weight])
    torch.manual_seed(0)
    net = models.Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torch_fsdp.FullyShardedDataParallel(
            net, use_orig_params=use_orig_params, ignored_states=[net.l1.weight], device_id=torch.device("cpu")
        )
    for kind in TYPES:
        assert_same(checked_records(state_dict(ours, fsdp_legacy, kind)), state_dict(theirs, torch_fsdp, kind), kind)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_ignored_params_match_torch_fsdp1(use_orig_params: bool) -> None:
    run_on_ranks(_ignored_params_match_torch, 2, use_orig_params)


def _device_mesh_dtensor() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    config = Config("net", use_orig_params=True, steps=2, extra={"device_mesh": mesh})
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    train(ours, config)
    train(theirs, config)
    sharded = state_dict(ours, fsdp_legacy, "SHARDED_STATE_DICT")
    assert_same(sharded, state_dict(theirs, torch_fsdp, "SHARDED_STATE_DICT"), "SHARDED with a device mesh")
    assert isinstance(sharded["l1.weight"], DTensor)
    for model, lib in ((ours, fsdp_legacy), (theirs, torch_fsdp)):
        with pytest.raises(RuntimeError, match="DeviceMesh is not compatible with LOCAL_STATE_DICT"):
            state_dict(model, lib, "LOCAL_STATE_DICT")
    _, fresh = build_ours(Config("net", use_orig_params=True, extra={"device_mesh": mesh}), seed=1)
    load(fresh, fsdp_legacy, "SHARDED_STATE_DICT", sharded)
    assert_full_equal(full_params(fresh), full_params(ours), "DTensor round trip")


def test_device_mesh_gives_dtensor() -> None:
    run_on_ranks(_device_mesh_dtensor, 2)


# --------------------------------------------------------------------------------------------------------------------
# FULL_STATE_DICT options, NO_SHARD, memory


def _full_options() -> None:
    config = Config("transformer", policy="block", steps=2)
    reference, ours = build_ours(config)
    train(ours, config)
    train(DDP(reference), config)
    expected = reference.state_dict()
    rank0 = state_dict(ours, fsdp_legacy, "FULL_STATE_DICT", fsdp_legacy.FullStateDictConfig(rank0_only=True))
    if dist.get_rank() == 0:
        assert list(rank0) == list(expected)
    else:
        assert rank0 == {}, "rank0_only: the other ranks get an empty dict"
    # offload_to_cpu works on CPU (torch crashes there) and the values are copies the model does not share.
    for kind, config_cls in (
        ("FULL_STATE_DICT", fsdp_legacy.FullStateDictConfig),
        ("SHARDED_STATE_DICT", fsdp_legacy.ShardedStateDictConfig),
        ("LOCAL_STATE_DICT", fsdp_legacy.LocalStateDictConfig),
    ):
        offloaded = state_dict(ours, fsdp_legacy, kind, config_cls(offload_to_cpu=True))
        assert_same(offloaded, state_dict(ours, fsdp_legacy, kind), f"{kind} offload_to_cpu")
    full = state_dict(ours, fsdp_legacy, "FULL_STATE_DICT", fsdp_legacy.FullStateDictConfig(offload_to_cpu=True))
    for key, value in expected.items():
        assert_close(full[key], value, key)
    before = full_params(ours)
    for key in before:  # parameters only: buffers are the module's own tensors, as nn.Module (and torch) give them
        full[key].add_(1.0)
    assert_full_equal(full_params(ours), before, "editing a FULL state dict's parameters leaves the model alone")
    assert all(is_sharded(u) for u in FSDP.fsdp_modules(ours))


def test_full_rank0_only_and_offload_to_cpu() -> None:
    run_on_ranks(_full_options, 2)


def _one_unit_at_a_time() -> None:
    _, ours = build_ours(Config("net", policy="always"))
    units_with_params = [u for u in FSDP.fsdp_modules(ours) if u._handle is not None]
    assert len(units_with_params) == 4  # l1, block.fc1, block.fc2, l2
    gathered: list[weakref.ref] = []
    original = our_state_dict._gathered

    def released(ref: weakref.ref) -> bool:
        return ref() is None or ref().untyped_storage().size() == 0

    @contextlib.contextmanager
    def tracking(handle):
        assert all(map(released, gathered)), "a unit's unsharded flat parameter outlived its turn"
        with original(handle) as full:
            gathered.append(weakref.ref(full))
            yield full

    our_state_dict._gathered = tracking
    try:
        # SHARDED gathers nothing: the ranks exchange dim-0 chunks (test_checkpoint_memory.py bounds its memory).
        for kind, gathers in (("FULL_STATE_DICT", len(units_with_params)), ("SHARDED_STATE_DICT", 0)):
            gathered.clear()
            state_dict(ours, fsdp_legacy, kind)
            assert len(gathered) == gathers and all(map(released, gathered))
    finally:
        our_state_dict._gathered = original


def test_gathers_one_unit_at_a_time() -> None:
    run_on_ranks(_one_unit_at_a_time, 2)


def _no_shard(use_orig_params: bool) -> None:
    config = Config("net", strategy="NO_SHARD", use_orig_params=use_orig_params, steps=2)
    reference, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    train(ours, config)
    train(theirs, config)
    train(DDP(reference), config)
    for kind in TYPES:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with FSDP.state_dict_type(ours, StateDictType[kind]):
                sd = ours.state_dict()
        assert NO_SHARD_WARNING in [str(w.message) for w in caught if w.category is UserWarning], kind
        assert_same(sd, state_dict(theirs, torch_fsdp, kind), f"NO_SHARD {kind}")
        assert list(sd) == list(reference.state_dict())
        _, fresh = build_ours(config, seed=1)
        load(fresh, fsdp_legacy, kind, sd)
        assert_full_equal(full_params(fresh), full_params(ours), f"NO_SHARD {kind} round trip")


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_no_shard_gives_full_state_dict(use_orig_params: bool) -> None:
    run_on_ranks(_no_shard, 2, use_orig_params)


# --------------------------------------------------------------------------------------------------------------------
# Round trips


def _round_trip(config: Config, kind: str, through_bytes: bool, nested: bool) -> None:
    _, ours = build_ours(config)
    train(ours, config)
    _, fresh = build_ours(config, seed=1)
    if nested:  # the FSDP root inside a plain module: keys get the outer prefix
        ours, fresh = nn.Sequential(ours), nn.Sequential(fresh)
    sd = state_dict(ours, fsdp_legacy, kind)
    if nested:
        assert all(key.startswith("0.") for key in sd)
    if through_bytes:
        buffer = io.BytesIO()
        torch.save(sd, buffer)
        buffer.seek(0)
        sd = torch.load(buffer, weights_only=False)
    assert not any(full_params(fresh)[k].equal(v) for k, v in full_params(ours).items() if v.numel() > 1)
    result = load(fresh, fsdp_legacy, kind, sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_full_equal(full_params(fresh), full_params(ours), f"{kind} round trip")
    assert all(is_sharded(u) for u in FSDP.fsdp_modules(fresh))
    assert torch.equal(next_loss(fresh, config), next_loss(ours, config)), "the next step's loss"
    assert torch.equal(next_loss(fresh, config, 51), next_loss(ours, config, 51)), "and the one after"


ROUND_TRIPS = (
    [
        (Config("net", use_orig_params=uop, steps=2), kind, world, False, False)
        for kind in TYPES
        for uop in (False, True)
        for world in (2, 4)
    ]
    + [(Config("transformer", use_orig_params=True, steps=2), kind, 2, True, False) for kind in TYPES]
    + [
        (Config("transformer", steps=2), "FULL_STATE_DICT", 2, False, True),
        (Config("net", policy="always", use_orig_params=True, steps=2), "SHARDED_STATE_DICT", 2, False, True),
    ]
)


@pytest.mark.parametrize(
    "config,kind,world_size,through_bytes,nested",
    ROUND_TRIPS,
    ids=[f"{k}_{c.name()}_w{w}{'_bytes' if b else ''}{'_nested' if n else ''}" for c, k, w, b, n in ROUND_TRIPS],
)
def test_round_trip(config: Config, kind: str, world_size: int, through_bytes: bool, nested: bool) -> None:
    run_on_ranks(_round_trip, world_size, config, kind, through_bytes, nested)


def _dcp_save(config: Config, kind: str, path: str) -> dict:
    _, ours = build_ours(config)
    train(ours, config)
    dcp.save({"model": state_dict(ours, fsdp_legacy, kind)}, checkpoint_id=path)
    return full_params(ours)


def _dcp_load(config: Config, kind: str, path: str) -> dict:
    _, fresh = build_ours(config, seed=1)
    sd = state_dict(fresh, fsdp_legacy, kind)
    dcp.load({"model": sd}, checkpoint_id=path)
    load(fresh, fsdp_legacy, kind, sd)
    return full_params(fresh)


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_dcp_checkpoint_loads_at_another_world_size(tmp_path, kind: str, use_orig_params: bool) -> None:
    config = Config("net", use_orig_params=use_orig_params, steps=2)
    saved = run_on_ranks(_dcp_save, 2, config, kind, str(tmp_path))[0]
    for loaded in run_on_ranks(_dcp_load, 4, config, kind, str(tmp_path)):
        assert_full_equal(loaded, saved, f"{kind} saved with DCP at world size 2, loaded at 4")


# --------------------------------------------------------------------------------------------------------------------
# Cross-loads with torch's FSDP1 (world size 2)


def _torch_to_ours(config: Config, kind: str) -> None:
    theirs = build_torch_fsdp(config)
    train(theirs, config)
    _, ours = build_ours(config, seed=1)
    result = load(ours, fsdp_legacy, kind, state_dict(theirs, torch_fsdp, kind))
    assert result.missing_keys == [] and result.unexpected_keys == []
    expected = torch_full(theirs)
    assert_full_equal(state_dict(ours, fsdp_legacy, "FULL_STATE_DICT"), expected, f"torch {kind} into ours")


def _ours_to_torch(config: Config, kind: str) -> None:
    _, ours = build_ours(config)
    train(ours, config)
    theirs = build_torch_fsdp(config, seed=1)
    sd = state_dict(ours, fsdp_legacy, kind)
    if kind == "LOCAL_STATE_DICT" and config.use_orig_params:
        # torch's own LOCAL dict with use_orig_params fails its strict load the same way: it reports its _flat_param
        # keys unexpected, and loads the named 1-D views beside them (our layout records are outside the keys).
        result = load(theirs, torch_fsdp, kind, sd, strict=False)
        assert result.missing_keys == [] and all(k.endswith("_flat_param") for k in result.unexpected_keys)
    else:  # LOCAL without use_orig_params too: exactly torch's keys, the layout records ride in _metadata
        load(theirs, torch_fsdp, kind, sd)
    assert_full_equal(torch_full(theirs), state_dict(ours, fsdp_legacy, "FULL_STATE_DICT"), f"ours {kind} into torch")


CROSS = [(kind, uop) for kind in TYPES for uop in (False, True)]


@pytest.mark.parametrize("kind,use_orig_params", CROSS, ids=[f"{k}_{'uop' if u else 'flat'}" for k, u in CROSS])
def test_torch_fsdp1_state_dict_loads_into_ours(kind: str, use_orig_params: bool) -> None:
    run_on_ranks(_torch_to_ours, 2, Config("transformer", use_orig_params=use_orig_params, steps=2), kind)


@pytest.mark.parametrize("kind,use_orig_params", CROSS, ids=[f"{k}_{'uop' if u else 'flat'}" for k, u in CROSS])
def test_our_state_dict_loads_into_torch_fsdp1(kind: str, use_orig_params: bool) -> None:
    run_on_ranks(_ours_to_torch, 2, Config("transformer", use_orig_params=use_orig_params, steps=2), kind)


# --------------------------------------------------------------------------------------------------------------------
# Load errors


def _missing_and_unexpected(use_orig_params: bool) -> None:
    config = Config("net", use_orig_params=use_orig_params, steps=1)
    _, ours = build_ours(config)
    train(ours, config)
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        sd = state_dict(ours, fsdp_legacy, kind)
        _, fresh = build_ours(config, seed=1)
        partial = {k: v for k, v in sd.items() if k not in ("l1.weight", "block.fc1.bias")}
        with pytest.raises(
            RuntimeError,
            match=r'Missing key\(s\) in state_dict: "l1.weight", "block.fc1.bias"\. '
            r"(.|\n)*strict=False",
        ):
            load(fresh, fsdp_legacy, kind, partial)
        _, fresh = build_ours(config, seed=1)
        result = load(fresh, fsdp_legacy, kind, partial, strict=False)
        assert result.missing_keys == ["l1.weight", "block.fc1.bias"] and result.unexpected_keys == []
        loaded, expected = full_params(fresh), full_params(ours)
        assert not loaded["l1.weight"].equal(expected["l1.weight"]), "a missing key is left alone"
        assert all(loaded[k].equal(v) for k, v in expected.items() if k not in ("l1.weight", "block.fc1.bias"))

        extra = {**sd, "l9.weight": torch.zeros(1), "block.extra": torch.zeros(1)}
        with pytest.raises(
            RuntimeError,
            match=r'Unexpected key\(s\) in state_dict: "l9.weight", "block.extra"'
            r"(.|\n)*strict=False",
        ):
            load(fresh, fsdp_legacy, kind, extra)
        result = load(fresh, fsdp_legacy, kind, extra, strict=False)
        assert result.missing_keys == [] and result.unexpected_keys == ["l9.weight", "block.extra"]
        assert_full_equal(full_params(fresh), expected, f"{kind} non-strict with extra keys")

    # The wrong type, strict or not: a LOCAL dict under FULL, a FULL dict under LOCAL.
    local = state_dict(ours, fsdp_legacy, "LOCAL_STATE_DICT")
    full = state_dict(ours, fsdp_legacy, "FULL_STATE_DICT")
    for strict in (True, False):
        with pytest.raises(
            RuntimeError,
            match=r"_flat_param is a LOCAL_STATE_DICT entry, but the model loads a "
            r"FULL_STATE_DICT: .*StateDictType.LOCAL_STATE_DICT",
        ):
            load(fresh, fsdp_legacy, "FULL_STATE_DICT", local, strict=strict)
        with pytest.raises(
            RuntimeError,
            match=r"l1.weight is a parameter by name, but the model loads a "
            r"LOCAL_STATE_DICT .*StateDictType.FULL_STATE_DICT",
        ):
            load(fresh, fsdp_legacy, "LOCAL_STATE_DICT", full, strict=strict)
    partial = {k: v for k, v in local.items() if k != "block._flat_param"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "block._flat_param"'):
        load(fresh, fsdp_legacy, "LOCAL_STATE_DICT", partial)
    assert load(fresh, fsdp_legacy, "LOCAL_STATE_DICT", partial, strict=False).missing_keys == ["block._flat_param"]


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_missing_and_unexpected_keys(use_orig_params: bool) -> None:
    run_on_ranks(_missing_and_unexpected, 2, use_orig_params)


def _retyped(st: ShardedTensor, dtype: torch.dtype) -> ShardedTensor:
    meta = st.metadata()
    props = copy.copy(meta.tensor_properties)
    props.dtype = dtype
    shards = [type(s)(s.tensor.to(dtype), s.metadata) for s in st.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(meta.shards_metadata, meta.size, props)
    )


def _shape_and_dtype(use_orig_params: bool) -> None:
    config = Config("net", use_orig_params=use_orig_params)
    _, ours = build_ours(config)
    full = state_dict(ours, fsdp_legacy, "FULL_STATE_DICT")
    sharded = state_dict(ours, fsdp_legacy, "SHARDED_STATE_DICT")
    local = state_dict(ours, fsdp_legacy, "LOCAL_STATE_DICT")
    cases = [
        (
            "FULL_STATE_DICT",
            {**full, "l1.weight": torch.zeros(4, 3)},
            (
                r"size mismatch for l1.weight: copying a param with shape torch.Size\(\[4, 3\]\) from checkpoint, "
                r"the shape in current model is torch.Size\(\[5, 3\]\)\. Load a checkpoint of this model"
            ),
        ),
        (
            "FULL_STATE_DICT",
            {**full, "block.fc2.weight": full["block.fc2.weight"].double()},
            (
                r"dtype mismatch for block.fc2.weight: the checkpoint holds torch.float64, the model's parameter is "
                r"torch.float32\. .*convert the checkpoint"
            ),
        ),
        (
            "SHARDED_STATE_DICT",
            {**sharded, "l1.bias": _retyped(sharded["l1.bias"], torch.float64)},
            r"dtype mismatch for l1.bias",
        ),
        ("SHARDED_STATE_DICT", {**sharded, "l2.weight": sharded["l1.weight"]}, r"size mismatch for l2.weight"),
        (
            "LOCAL_STATE_DICT",
            {**local, "_flat_param": _retyped(local["_flat_param"], torch.float64)},
            r"dtype mismatch for _flat_param",
        ),
        (
            "LOCAL_STATE_DICT",
            {**local, "_flat_param": local["block._flat_param"]},
            r"size mismatch for _flat_param: the checkpoint's flat parameter has",
        ),
        (
            "LOCAL_STATE_DICT",
            {**local, "_flat_param": torch.zeros(3)},
            r"_flat_param of a LOCAL_STATE_DICT must be a ShardedTensor",
        ),
    ]
    before = full_params(ours)
    for kind, sd, message in cases:
        for strict in (True, False):  # raised in non-strict mode too, as nn.Module does for size mismatches
            with pytest.raises(RuntimeError, match=message):
                load(ours, fsdp_legacy, kind, sd, strict=strict)
    # The offending entries were skipped; everything else loaded unchanged values.
    assert_full_equal(full_params(ours), before, "after the failed loads")
    with pytest.raises(RuntimeError, match=r"load_state_dict\(assign=True\) is not supported by FSDP"):
        ours.load_state_dict(full, assign=True)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_shape_and_dtype_mismatch(use_orig_params: bool) -> None:
    run_on_ranks(_shape_and_dtype, 2, use_orig_params)


def _local_other_world_size() -> None:
    """A LOCAL_STATE_DICT laid out for 4 ranks (chunks of 7 of the root's 28 elements), loaded on 2 ranks."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata

    _, ours = build_ours(Config("net"))
    local = state_dict(ours, fsdp_legacy, "LOCAL_STATE_DICT")
    meta = local["_flat_param"].metadata()
    rank = dist.get_rank()
    chunks = [ShardMetadata([7 * i], [7], f"rank:{i % 2}/cpu") for i in range(4)]
    shards = [Shard(torch.zeros(7), m) for m in chunks if m.placement.rank() == rank]
    four_ranks = ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(chunks, meta.size, meta.tensor_properties)
    )
    with pytest.raises(
        RuntimeError,
        match=r"_flat_param is a LOCAL_STATE_DICT saved with world size 4 .* this model "
        r"runs with world size 2.*SHARDED_STATE_DICT or FULL_STATE_DICT",
    ):
        load(ours, fsdp_legacy, "LOCAL_STATE_DICT", {**local, "_flat_param": four_ranks})


def test_local_state_dict_from_another_world_size() -> None:
    run_on_ranks(_local_other_world_size, 2)


# --------------------------------------------------------------------------------------------------------------------
# Between forward and backward


def _load_between_forward_and_backward() -> None:
    """The root keeps its unsharded parameters from forward to backward; a load in between must not leave them stale."""
    config = Config("net", steps=1)
    _, ours = build_ours(config)
    _, other = build_ours(config, seed=1)
    sd = state_dict(other, fsdp_legacy, "FULL_STATE_DICT")
    ours(batch(config, 0))  # a forward with grad and no backward
    assert not is_sharded(ours)
    load(ours, fsdp_legacy, "FULL_STATE_DICT", sd)
    assert_full_equal(full_params(ours), full_params(other), "loaded")
    assert torch.equal(next_loss(ours, config), next_loss(other, config))


def test_load_between_forward_and_backward() -> None:
    run_on_ranks(_load_between_forward_and_backward, 2)


# --------------------------------------------------------------------------------------------------------------------
# Migration of the model to FSDP2 (fully_shard) through DCP


def _fsdp2_load(config: Config, path: str) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)  # a different initialisation: everything must come from the checkpoint
    model = models.Net()
    fully_shard(model.block)
    fully_shard(model)
    sd = get_model_state_dict(model)
    dcp.load({"model": sd}, checkpoint_id=path)
    set_model_state_dict(model, sd)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: tensor for name, tensor in full.items() if name != "buf"}


@pytest.mark.parametrize("world_size", [2, 1])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_sharded_checkpoint_loads_into_fsdp2(tmp_path, use_orig_params: bool, world_size: int) -> None:
    """Our SHARDED model state dict saved with DCP loads into torch's FSDP2 (fully_shard), also at another size."""
    config = Config("net", use_orig_params=use_orig_params, steps=2)
    saved = run_on_ranks(_dcp_save, 2, config, "SHARDED_STATE_DICT", str(tmp_path))[0]
    for loaded in run_on_ranks(_fsdp2_load, world_size, config, str(tmp_path)):
        assert_full_equal(loaded, saved, f"FSDP2 at world size {world_size}")
