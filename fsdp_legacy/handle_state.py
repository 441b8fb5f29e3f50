"""What a handle is doing now: its training state (torch's `HandleTrainingState` values) and what
summon_full_params shows of it. Apart from handle.py, so that the handle's mixins read them without importing it."""

from dataclasses import dataclass
from enum import auto

import torch

from .api import FSDPEnum


class HandleTrainingState(FSDPEnum):
    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()
    SUMMON_FULL_PARAMS = auto()


@dataclass
class Summoned:
    """What summon_full_params shows of a handle: the whole flat tensor in full precision (None on the ranks a
    rank0_only summon leaves sharded), which the shown parameters view and writeback reads; `_apply` inside the
    summon (`.to`, `.half`) replaces it by its converted copy, as it replaces torch's unsharded flat parameter."""

    full: torch.Tensor | None
    rank0_only: bool
