"""profile_training: FSDP training steps measured by a MemoryTracker on whatever process group is current (real
ranks, or the estimator's fake ones)."""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..fully_sharded_data_parallel import FullyShardedDataParallel as FSDP
from .profile import MemoryProfile
from .tracker import MemoryTracker

LossFn = Callable[[nn.Module, int], torch.Tensor]  # (model, step) -> loss; builds its own batch
OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
Instrument = Callable[[nn.Module, MemoryTracker], object]  # (the FSDP root, the tracker), called after wrapping


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def profile_training(
    model: nn.Module,
    loss_fn: LossFn,
    fsdp_kwargs: dict[str, Any] | None = None,
    optimizer_fn: OptimizerFn = sgd,
    steps: int = 2,
    instrument: Instrument | None = None,
) -> MemoryProfile:
    """Wrap the plain `model` in FullyShardedDataParallel and run `steps` training steps (forward, backward,
    optimizer step, zero_grad) under a MemoryTracker; the peaks cover construction too (phase "other").

    The tracker starts after `model` is built: its parameters count once FSDP flattens them, as with meta-device
    initialisation, where each unit is materialised just before it is sharded.

    `instrument(wrapped, tracker)`, if given, runs once the model is wrapped, with a tracker that keeps a peak per
    segment (`MemoryTracker.mark`), e.g. to mark where each layer's forward and backward begin.
    """
    with MemoryTracker(segments=instrument is not None) as tracker:
        wrapped = FSDP(model, **(fsdp_kwargs or {}))
        del model
        tracker.track(wrapped)
        if instrument is not None:
            instrument(wrapped, tracker)
        optimizer = optimizer_fn(wrapped.parameters())
        for step in range(steps):
            loss_fn(wrapped, step).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return tracker.profile()
