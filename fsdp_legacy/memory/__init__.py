"""Memory tools for FSDP1 models: a tracker of live tensor memory (by category, module and phase) and an estimator
that runs the same tracker under FakeTensorMode with a fake process group to predict each rank's peak.

    with MemoryTracker(model) as tracker:          # measure real steps
        ...
    print(tracker.table())

    profile = estimate_memory(build, loss_fn, world_size=64, fsdp_kwargs=dict(auto_wrap_policy=...))
    print(profile.table())                          # predict, allocating nothing
"""

from .categories import Category, Phase
from .estimator import estimate_memory
from .profile import MemoryProfile
from .repeated import estimate_memory_repeated
from .tracker import MemoryTracker, Snapshot
from .training import profile_training

__all__ = [
    "Category",
    "MemoryProfile",
    "MemoryTracker",
    "Phase",
    "Snapshot",
    "estimate_memory",
    "estimate_memory_repeated",
    "profile_training",
]
