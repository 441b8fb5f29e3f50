"""MemoryProfile: one rank's peaks per phase as plain data, and `profile_training`, which measures FSDP training
steps with a MemoryTracker on whatever process group is current (real ranks, or the estimator's fake ones)."""

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from .categories import Category, Phase
from .table import Breakdown, by_category, module_table, phase_table
from .tracker import MemoryTracker

LossFn = Callable[[nn.Module, int], torch.Tensor]  # (model, step) -> loss; builds its own batch
OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes by (module FQN, category) at each phase's peak on one device; picklable."""

    peaks: dict[Phase, Breakdown]
    units: tuple[str, ...] = ()  # FQNs of the FSDP units, for the per-unit table
    device: str = "cpu"

    @classmethod
    def of(cls, tracker: MemoryTracker, device: Optional[str] = None) -> "MemoryProfile":
        device = device or max(tracker.live, key=tracker.live.get, default="cpu")
        tracker.relabel()
        peaks = {p: tracker.peak_snapshot(p, device).bytes for p in Phase if device in tracker.peaks[p]}
        return cls(peaks, tuple(tracker.units()), device)

    def peak(self, phase: Optional[Phase] = None) -> int:
        """The peak of `phase`, or of all phases."""
        phases = [phase] if phase is not None else list(self.peaks)
        return max((sum(self.peaks[p].values()) for p in phases if p in self.peaks), default=0)

    def split(self, phase: Phase) -> dict[Category, int]:
        """How the peak of `phase` splits into categories."""
        return by_category(self.peaks.get(phase, {}))

    def table(self, top_modules: int = 12) -> str:
        overall = max(self.peaks.values(), key=lambda b: sum(b.values()), default={})
        return phase_table(self.peaks) + "\n\n" + module_table(overall, top_modules, self.units)


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def profile_training(
    model: nn.Module,
    loss_fn: LossFn,
    fsdp_kwargs: Optional[dict[str, Any]] = None,
    optimizer_fn: OptimizerFn = sgd,
    steps: int = 2,
) -> MemoryProfile:
    """Wrap the plain `model` in FullyShardedDataParallel and run `steps` training steps (forward, backward,
    optimizer step, zero_grad) under a MemoryTracker; the peaks cover construction too (phase "other").

    The tracker starts after `model` is built: its parameters count once FSDP flattens them, as with meta-device
    initialisation, where each unit is materialised just before it is sharded.
    """
    from ..fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

    with MemoryTracker() as tracker:
        wrapped = FSDP(model, **(fsdp_kwargs or {}))
        del model
        tracker.track(wrapped)
        optimizer = optimizer_fn(wrapped.parameters())
        for step in range(steps):
            loss_fn(wrapped, step).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return tracker.profile()
