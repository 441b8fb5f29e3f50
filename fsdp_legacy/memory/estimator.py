"""The estimator: FSDP training steps on fake tensors and a fake process group, measured by the MemoryTracker.

Under FakeTensorMode every op computes its output's shape, dtype and device but allocates nothing, and the fake
process group makes this one process any rank of any world size. The same code as a real run executes (wrapping,
sharding, all-gathers into the unsharded buffers, frees, reductions, the optimizer), so the tracker sees the same
storages come and go as on a real rank, and the estimate is the measurement of a run that never happened.
"""

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .fake_world import fake_process_group
from .profile import MemoryProfile
from .training import Instrument, LossFn, OptimizerFn, profile_training, sgd


def estimate_memory(
    build: Callable[..., nn.Module],
    loss_fn: LossFn,
    world_size: int,
    fsdp_kwargs: dict[str, Any] | None = None,
    optimizer_fn: OptimizerFn = sgd,
    steps: int = 2,
    rank: int = 0,
    mesh_shape: tuple[int, int] | None = None,
    hybrid_shape: tuple[int, int] | None = None,
    instrument: Instrument | None = None,
) -> MemoryProfile:
    """Predict rank `rank`'s peak memory per phase when `build()`'s model is trained with FSDP(**fsdp_kwargs) on
    `world_size` ranks, `loss_fn(model, step)` making each step's batch and loss. Nothing real is allocated: a 7B
    model on 64 ranks runs on a laptop. Call it in a process without a process group (it installs a fake one).

    Tensor parallelism (torch's 2-D recipe): with `mesh_shape=(dp, tp)` a ("dp", "tp") mesh is made over the fake
    world, `build(mesh)` gets it (to parallelize its modules over mesh["tp"]) and FSDP gets device_mesh=mesh["dp"].

    Hybrid sharding: with `hybrid_shape=(replicas, shard)` a ("replicate", "shard") mesh is made over the fake world and
    FSDP gets it as device_mesh (pass sharding_strategy=HYBRID_SHARD or _HYBRID_SHARD_ZERO2 in fsdp_kwargs), as a
    job builds it with init_device_mesh.

    `instrument` is profile_training's (segment marks, for memory/repeated.py).
    """
    if mesh_shape is not None and (len(mesh_shape) != 2 or mesh_shape[0] * mesh_shape[1] != world_size):
        raise ValueError(f"mesh_shape={mesh_shape} must be (dp, tp) with dp * tp = world_size = {world_size}.")
    if hybrid_shape is not None and (len(hybrid_shape) != 2 or hybrid_shape[0] * hybrid_shape[1] != world_size):
        raise ValueError(f"hybrid_shape={hybrid_shape} must be (replicas, shard) with their product = {world_size}.")
    if hybrid_shape is not None and mesh_shape is not None:
        raise ValueError("hybrid_shape and mesh_shape (tensor parallelism) are not estimated together.")
    if mesh_shape is not None and len(inspect.signature(build).parameters) != 1:
        raise TypeError("With mesh_shape, build takes the 2-D device mesh: build(mesh) -> model.")
    with fake_process_group(world_size, rank):
        args: tuple[DeviceMesh, ...] = ()
        kwargs = dict(fsdp_kwargs or {})
        if mesh_shape is not None:  # (made outside FakeTensorMode: a mesh holds real rank tensors)
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
            args, kwargs["device_mesh"] = (mesh,), mesh["dp"]
        if hybrid_shape is not None:
            kwargs["device_mesh"] = init_device_mesh("cpu", hybrid_shape, mesh_dim_names=("replicate", "shard"))
        with FakeTensorMode():
            return profile_training(build(*args), loss_fn, kwargs, optimizer_fn, steps, instrument)
