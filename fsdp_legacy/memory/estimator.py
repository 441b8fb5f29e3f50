"""The estimator: FSDP training steps on fake tensors and a fake process group, measured by the MemoryTracker.

Under FakeTensorMode every op computes its output's shape, dtype and device but allocates nothing, and the fake
process group makes this one process any rank of any world size. The same code as a real run executes (wrapping,
sharding, all-gathers into the unsharded buffers, frees, reductions, the optimizer), so the tracker sees the same
storages come and go as on a real rank, and the estimate is the measurement of a run that never happened.
"""

from collections.abc import Callable
from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from .fake_world import fake_process_group
from .profile import MemoryProfile
from .training import LossFn, OptimizerFn, profile_training, sgd


def estimate_memory(
    build: Callable[[], nn.Module],
    loss_fn: LossFn,
    world_size: int,
    fsdp_kwargs: dict[str, Any] | None = None,
    optimizer_fn: OptimizerFn = sgd,
    steps: int = 2,
    rank: int = 0,
) -> MemoryProfile:
    """Predict rank `rank`'s peak memory per phase when `build()`'s model is trained with FSDP(**fsdp_kwargs) on
    `world_size` ranks, `loss_fn(model, step)` making each step's batch and loss. Nothing real is allocated: a 7B
    model on 64 ranks runs on a laptop. Call it in a process without a process group (it installs a fake one).
    """
    with fake_process_group(world_size, rank), FakeTensorMode():
        return profile_training(build(), loss_fn, fsdp_kwargs, optimizer_fn, steps)
