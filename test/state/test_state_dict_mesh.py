"""SHARDED model and optimizer state dicts of models built with a `device_mesh`, against torch's FSDP1 (the oracle,
side by side on CPU gloo): DTensors Shard(0) on a 1-D mesh, (Replicate(), Shard(0)) on HYBRID_SHARD's 2-D mesh, for
evenly and unevenly sharded models; loading them back (with offload_to_cpu either way round), LOCAL_STATE_DICT
refused, a root module that is not FSDP, and torch's `_use_dtensor` flags. (torch's own tests of this,
test_fsdp_dtensor_state_dict.py and test_hsdp_dtensor_state_dict.py, are not in the wheel: these follow them.)
"""

import copy
import importlib
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp_legacy
from fsdp_utils import assert_close
from harness import run_on_ranks

EVEN = (8, 16, 32, 64, 8)  # every dim 0 divides by 2 and 4
UNEVEN = (5, 7, 3, 9, 2)  # 7 and 9 split unevenly, 3 leaves the 4th rank empty, 9 fills only 3 chunks at 4 ranks
LOCAL_WITH_MESH = "DeviceMesh is not compatible with LOCAL_STATE_DICT."


class Dense(nn.Module):
    """torch's DenseModel of those tests, with sizes to choose."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        a, b, c, d, e = sizes
        self.net1 = nn.Sequential(nn.Linear(a, b), nn.ReLU())
        self.net2 = nn.Sequential(nn.Linear(b, c), nn.ReLU())
        self.net3 = nn.Linear(c, d)
        self.net4 = nn.Sequential(nn.ReLU(), nn.Linear(d, e))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net4(self.net3(self.net2(self.net1(x))))


class RootNotFsdp(nn.Module):
    """torch's FakeMPModel: an FSDP unit inside a plain root, beside a parameter each rank has alone."""

    def __init__(self, lib: Any, mesh: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = build(lib, Dense(EVEN), use_orig_params=True, device_mesh=mesh, sharding_strategy="HYBRID_SHARD")
        if dist.get_rank() == 0:
            self.sparse0 = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        else:
            self.sparse1 = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sparse = self.sparse0(x) if dist.get_rank() == 0 else self.sparse1(x)
        dist.all_reduce(sparse)
        return self.dense(sparse)


# --------------------------------------------------------------------------------------------------------------------
# Helpers (run inside the ranks); `lib` is fsdp_legacy or torch.distributed.fsdp


def build(lib: Any, module: nn.Module, sharding_strategy: str = "FULL_SHARD", **kwargs: Any) -> nn.Module:
    if lib is torch_fsdp:
        kwargs["device_id"] = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lib.FullyShardedDataParallel(
            module,
            auto_wrap_policy=importlib.import_module(f"{lib.__name__}.wrap").ModuleWrapPolicy({nn.Sequential}),
            sharding_strategy=lib.ShardingStrategy[sharding_strategy],
            **kwargs,
        )


def step(model: nn.Module, optim: torch.optim.Optimizer, in_features: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(100 * seed + dist.get_rank())
    model(torch.rand(4, in_features, generator=generator)).sum().backward()
    optim.step()
    optim.zero_grad()


def trained(lib: Any, sizes: tuple[int, ...], **kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build(lib, Dense(sizes), **kwargs)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    step(model, optim, sizes[0], 0)
    return model, optim


def settings(lib: Any, kind: str, offload_to_cpu: bool | None = None) -> tuple:
    if offload_to_cpu is None:
        return (lib.StateDictType[kind],)
    return (
        lib.StateDictType[kind],
        lib.ShardedStateDictConfig(offload_to_cpu=offload_to_cpu),
        lib.ShardedOptimStateDictConfig(offload_to_cpu=offload_to_cpu),
    )


def save(lib: Any, model: nn.Module, optim: torch.optim.Optimizer, kind: str, offload: bool | None = None) -> tuple:
    """(model state dict, optimizer state dict) under `kind`."""
    fsdp = lib.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp.state_dict_type(model, *settings(lib, kind, offload)):
            return model.state_dict(), fsdp.optim_state_dict(model, optim)


def load(lib: Any, model: nn.Module, optim: torch.optim.Optimizer, saved: tuple, offload: bool | None = None) -> None:
    fsdp = lib.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp.state_dict_type(model, *settings(lib, "SHARDED_STATE_DICT", offload)):
            model.load_state_dict(saved[0])
            optim.load_state_dict(fsdp.optim_state_dict_to_load(model, optim, saved[1]))


def describe(value: Any) -> tuple:
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        return ("DTensor", tuple(value.shape), value.dtype, tuple(value.placements), mesh.mesh.tolist(), mesh.ndim)
    return (type(value).__name__, tuple(getattr(value, "shape", ())), getattr(value, "dtype", None))


def local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def assert_same_values(ours: Any, theirs: Any, what: str) -> None:
    """Same keys in the same order, same containers and metadata (mesh, placements, global shape), same local data
    (dicts, or tuples of them)."""
    if isinstance(theirs, tuple):
        ours, theirs = dict(enumerate(ours)), dict(enumerate(theirs))
    assert list(ours) == list(theirs), f"{what}: keys\n ours  {list(ours)}\n torch {list(theirs)}"
    for key, value in theirs.items():
        if isinstance(value, dict):
            assert_same_values(ours[key], value, f"{what}.{key}")
        elif isinstance(value, list):
            assert ours[key] == value, f"{what}.{key}"
        elif isinstance(value, torch.Tensor):
            assert describe(ours[key]) == describe(value), f"{what}.{key}: {describe(ours[key])} vs {describe(value)}"
            assert local(ours[key]).device == local(value).device, f"{what}.{key}: device"
            assert_close(local(ours[key]), local(value), f"{what}.{key}")
        else:
            assert ours[key] == value, f"{what}.{key}"


def assert_dtensors_on(sd: dict, osd: dict, mesh: Any, placements: tuple, what: str) -> None:
    """torch's checks: every parameter and every non-`step` optimizer state is a DTensor with these placements on
    `mesh`."""
    for key, value in sd.items():
        if not key.endswith("buf"):
            assert isinstance(value, DTensor) and value.device_mesh == mesh, f"{what}: {key}"
            assert tuple(value.placements) == placements, f"{what}: {key} {value.placements}"
    for fqn, states in osd["state"].items():
        for name, value in states.items():
            if name != "step":
                assert isinstance(value, DTensor) and value.device_mesh == mesh, f"{what}: {fqn}.{name}"
                assert tuple(value.placements) == placements, f"{what}: {fqn}.{name}"


def full(lib: Any, model: nn.Module) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType.FULL_STATE_DICT):
            return model.state_dict()


def init_facts(lib: Any, model: nn.Module, mesh: Any) -> list[tuple]:
    """What initialisation from a mesh gives each unit: its shard and replicate groups' ranks, rank and world size,
    its mesh, its flat parameter's size."""
    facts = []
    for unit in lib.FullyShardedDataParallel.fsdp_modules(model):
        replicate = getattr(unit, "_inter_node_pg", None)
        facts.append(
            (
                dist.get_process_group_ranks(unit.process_group),
                dist.get_process_group_ranks(replicate) if replicate is not None else None,
                unit.rank,
                unit.world_size,
                unit._device_mesh is mesh,
                [p.numel() for p in unit.params],
            )
        )
    return facts


def use_dtensor_flags(lib: Any, model: nn.Module, optim: torch.optim.Optimizer) -> tuple[bool, bool]:
    """The configs' `_use_dtensor` after saving under SHARDED_STATE_DICT set for good (torch's test does so)."""
    fsdp = lib.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fsdp.set_state_dict_type(model, lib.StateDictType.SHARDED_STATE_DICT)
        model.state_dict()
        fsdp.optim_state_dict(model, optim)
        found = fsdp.get_state_dict_type(model)
        fsdp.set_state_dict_type(model, lib.StateDictType.FULL_STATE_DICT)
    return found.state_dict_config._use_dtensor, found.optim_state_dict_config._use_dtensor


# --------------------------------------------------------------------------------------------------------------------
# The cases


def _round_trip(mesh_shape: tuple[int, ...], sizes: tuple[int, ...], use_orig_params: bool, offload: bool) -> None:
    """Save SHARDED model and optimizer state (offload_to_cpu=`offload`), train on, load the saved state back under
    the other offload_to_cpu setting: ours and torch's alike at every point."""
    strategy = "HYBRID_SHARD" if len(mesh_shape) == 2 else "FULL_SHARD"
    placements = tuple(torch.distributed.tensor.Replicate() for _ in mesh_shape[1:]) + (
        torch.distributed.tensor.Shard(0),
    )
    models, facts = {}, {}
    for lib in (fsdp_legacy, torch_fsdp):
        mesh = init_device_mesh("cpu", mesh_shape)
        model, optim = trained(
            lib, sizes, device_mesh=mesh, sharding_strategy=strategy, use_orig_params=use_orig_params
        )
        saved = save(lib, model, optim, "SHARDED_STATE_DICT", offload)
        assert_dtensors_on(*saved, mesh, placements, lib.__name__)
        facts[lib] = init_facts(lib, model, mesh)
        assert use_dtensor_flags(lib, model, optim) == (True, True), lib.__name__
        saved = copy.deepcopy(saved)
        step(model, optim, sizes[0], 1)
        load(lib, model, optim, saved, not offload)
        models[lib] = model, optim, saved
    ours, theirs = models[fsdp_legacy], models[torch_fsdp]
    assert facts[fsdp_legacy] == facts[torch_fsdp], f"initialisation from the mesh: {facts}"
    assert [p.numel() for p in ours[0].parameters()] == [p.numel() for p in theirs[0].parameters()], "parameters"
    assert_same_values(ours[2][0], theirs[2][0], "model state dict")
    assert_same_values(ours[2][1], theirs[2][1], "optimizer state dict")
    assert_same_values(full(fsdp_legacy, ours[0]), full(torch_fsdp, theirs[0]), "loaded model")
    assert_same_values(
        save(fsdp_legacy, *ours[:2], "SHARDED_STATE_DICT"),
        save(torch_fsdp, *theirs[:2], "SHARDED_STATE_DICT"),
        "reloaded",
    )
    # Reloaded, ours gives back what it saved, and trains on as torch's does.
    assert_same_values(save(fsdp_legacy, *ours[:2], "SHARDED_STATE_DICT"), ours[2], "saved again")
    step(*ours[:2], sizes[0], 2)
    step(*theirs[:2], sizes[0], 2)
    assert_same_values(full(fsdp_legacy, ours[0]), full(torch_fsdp, theirs[0]), "trained after loading")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sizes", [EVEN, UNEVEN], ids=["even", "uneven"])
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "uop"])
def test_1d_mesh_round_trip_matches_torch(world_size: int, sizes: tuple, use_orig_params: bool) -> None:
    run_on_ranks(_round_trip, world_size, (world_size,), sizes, use_orig_params, world_size == 4, timeout=300)


@pytest.mark.parametrize("sizes", [EVEN, UNEVEN], ids=["even", "uneven"])
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "uop"])
@pytest.mark.parametrize("offload", [False, True], ids=["saved_on_device", "saved_offloaded"])
def test_hsdp_2d_mesh_round_trip_matches_torch(sizes: tuple, use_orig_params: bool, offload: bool) -> None:
    run_on_ranks(_round_trip, 4, (2, 2), sizes, use_orig_params, offload, timeout=300)


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "uop"])
def test_hsdp_one_replica_of_four_shards_matches_torch(use_orig_params: bool) -> None:
    """A (1, 4) mesh: the uneven model's short dims leave shard ranks with empty pieces."""
    run_on_ranks(_round_trip, 4, (1, 4), UNEVEN, use_orig_params, False, timeout=300)


def _dcp_across_meshes(path: str, use_orig_params: bool) -> None:
    """Our HYBRID_SHARD checkpoint on the (2, 2) mesh, saved with DCP, loads into torch's FSDP1 on the same mesh and
    into ours on a 1-D mesh of the 4 ranks (DCP reshards the DTensors), model and optimizer: all equal the source."""
    import torch.distributed.checkpoint as dcp

    source, source_optim = trained(
        fsdp_legacy,
        UNEVEN,
        device_mesh=init_device_mesh("cpu", (2, 2)),
        sharding_strategy="HYBRID_SHARD",
        use_orig_params=use_orig_params,
    )
    saved = save(fsdp_legacy, source, source_optim, "SHARDED_STATE_DICT")
    dcp.save({"model": saved[0], "optim": saved[1]}, checkpoint_id=path)
    checkpoint_full = full(fsdp_legacy, source)
    step(source, source_optim, UNEVEN[0], 6)
    next_full = full(fsdp_legacy, source)
    for lib, mesh_shape, strategy in ((torch_fsdp, (2, 2), "HYBRID_SHARD"), (fsdp_legacy, (4,), "FULL_SHARD")):
        torch.manual_seed(1)
        model = build(
            lib,
            Dense(UNEVEN),
            device_mesh=init_device_mesh("cpu", mesh_shape),
            sharding_strategy=strategy,
            use_orig_params=use_orig_params,
        )
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        step(model, optim, UNEVEN[0], 5)
        state = save(lib, model, optim, "SHARDED_STATE_DICT")
        holder = {"model": state[0], "optim": state[1]}
        dcp.load(holder, checkpoint_id=path)
        load(lib, model, optim, (holder["model"], holder["optim"]))
        what = f"{lib.__name__} on {mesh_shape}"
        assert_same_values(full(lib, model), checkpoint_full, what)
        step(model, optim, UNEVEN[0], 6)  # the optimizer state came along: the next step is the source's
        assert_same_values(full(lib, model), next_full, f"{what}, one step on")


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "uop"])
def test_hsdp_dcp_checkpoint_loads_into_torch_and_other_meshes(tmp_path: Any, use_orig_params: bool) -> None:
    run_on_ranks(_dcp_across_meshes, 4, str(tmp_path / "ckpt"), use_orig_params, timeout=300)


def _local_state_dict_refused(mesh_shape: tuple[int, ...]) -> None:
    """LOCAL_STATE_DICT with a mesh: torch's RuntimeError from state_dict() and from optim_state_dict()."""
    strategy = "HYBRID_SHARD" if len(mesh_shape) == 2 else "FULL_SHARD"
    messages = {}
    for lib in (fsdp_legacy, torch_fsdp):
        model, optim = trained(lib, EVEN, device_mesh=init_device_mesh("cpu", mesh_shape), sharding_strategy=strategy)
        fsdp = lib.FullyShardedDataParallel
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with fsdp.state_dict_type(model, lib.StateDictType.LOCAL_STATE_DICT):
                with pytest.raises(RuntimeError, match=LOCAL_WITH_MESH) as model_error:
                    model.state_dict()
                with pytest.raises(RuntimeError, match=LOCAL_WITH_MESH) as optim_error:
                    fsdp.optim_state_dict(model, optim)
        messages[lib] = str(model_error.value), str(optim_error.value)
        if len(model_error.value.args) > 1:  # torch 2.11 passes the sentences as separate arguments: a tuple's repr
            return
    assert messages[fsdp_legacy] == messages[torch_fsdp]


@pytest.mark.parametrize("world_size", [2, 4])
def test_local_state_dict_with_a_mesh_is_refused_as_torch(world_size: int) -> None:
    run_on_ranks(_local_state_dict_refused, world_size, (world_size,))


def test_local_state_dict_with_a_2d_mesh_is_refused_as_torch() -> None:
    run_on_ranks(_local_state_dict_refused, 4, (2, 2))


def _same_as_process_groups(mesh_shape: tuple[int, ...], use_orig_params: bool) -> None:
    """A model built from a mesh and the same model built from the mesh's process groups (HYBRID_SHARD: the (shard,
    replicate) pair) hold the same values: the DTensors' local pieces and offsets are the ShardedTensors' (torch's
    test_dtensor_sharded_tensor_state_dict_identical)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", mesh_shape)
    hybrid = len(mesh_shape) == 2
    groups = (mesh.get_group(1), mesh.get_group(0)) if hybrid else mesh.get_group()
    kwargs = dict(sharding_strategy="HYBRID_SHARD" if hybrid else "FULL_SHARD", use_orig_params=use_orig_params)
    found = {}
    for lib in (fsdp_legacy, torch_fsdp):
        with_mesh = save(lib, *trained(lib, UNEVEN, device_mesh=mesh, **kwargs), "SHARDED_STATE_DICT")
        with_groups = save(lib, *trained(lib, UNEVEN, process_group=groups, **kwargs), "SHARDED_STATE_DICT")
        pairs = [(with_mesh[0][k], with_groups[0][k]) for k in with_mesh[0] if not k.endswith("buf")]
        pairs += [
            (states[name], with_groups[1]["state"][fqn][name])
            for fqn, states in with_mesh[1]["state"].items()
            for name in states
            if name != "step"
        ]
        pieces = []
        for dtensor, sharded in pairs:
            shape, offset = compute_local_shape_and_global_offset(
                dtensor.shape, dtensor.device_mesh, dtensor.placements
            )
            shards = sharded.local_shards()
            if not shards:
                assert dtensor.to_local().numel() == 0
                continue
            assert list(offset) == list(shards[0].metadata.shard_offsets), (offset, shards[0].metadata)
            assert_close(dtensor.to_local(), shards[0].tensor, "DTensor vs ShardedTensor")
            pieces.append((tuple(shape), tuple(offset), dtensor.to_local()))
        found[lib] = pieces
    assert len(found[fsdp_legacy]) == len(found[torch_fsdp])
    for mine, theirs in zip(found[fsdp_legacy], found[torch_fsdp], strict=True):
        assert mine[:2] == theirs[:2]
        assert_close(mine[2], theirs[2], "ours vs torch")


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "uop"])
def test_hsdp_dtensors_hold_the_sharded_tensors_pieces(use_orig_params: bool) -> None:
    run_on_ranks(_same_as_process_groups, 4, (2, 2), use_orig_params, timeout=300)


@pytest.mark.parametrize("world_size", [2, 4])
def test_1d_mesh_dtensors_hold_the_sharded_tensors_pieces(world_size: int) -> None:
    run_on_ranks(_same_as_process_groups, world_size, (world_size,), False, timeout=300)


def _root_not_fsdp() -> None:
    """torch's test_root_module_is_not_FSDP: the optimizer state of the FSDP unit is DTensors on the 2-D mesh, that of
    each rank's own parameter plain tensors; the whole thing loads back."""
    found = {}
    for lib in (fsdp_legacy, torch_fsdp):
        mesh = init_device_mesh("cpu", (2, 2))
        model = RootNotFsdp(lib, mesh)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        step(model, optim, 8, 0)
        saved = copy.deepcopy(save(lib, model, optim, "SHARDED_STATE_DICT"))
        for fqn, states in saved[1]["state"].items():
            for name, value in states.items():
                if "sparse" in fqn or name == "step":
                    assert type(value) is torch.Tensor, f"{fqn}.{name}"
                else:
                    assert isinstance(value, DTensor) and value.device_mesh == mesh, f"{fqn}.{name}"
        step(model, optim, 8, 1)
        load(lib, model, optim, saved)
        found[lib] = model, optim, saved
    ours, theirs = found[fsdp_legacy], found[torch_fsdp]
    assert_same_values(ours[2][0], theirs[2][0], "model state dict")
    assert_same_values(ours[2][1], theirs[2][1], "optimizer state dict")
    assert_same_values(save(fsdp_legacy, *ours[:2], "SHARDED_STATE_DICT"), ours[2], "loaded back")
    assert_same_values(ours[1].state_dict(), theirs[1].state_dict(), "optimizer after loading")


def test_root_module_that_is_not_fsdp_matches_torch() -> None:
    run_on_ranks(_root_not_fsdp, 4, timeout=300)
