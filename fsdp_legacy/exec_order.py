"""torch FSDP1's execution-order checks, on at the DETAIL debug level only (`dist.set_debug_level` or
TORCH_DISTRIBUTED_DEBUG=DETAIL), as in torch.

Units all-gather in their forward order, so ranks that run them in different orders pair up unrelated collectives and
load garbage or hang. In the first iteration every training forward of a unit all-gathers its index so that all ranks
see a difference and raise together; later iterations compare each rank with its own first iteration (no
communication) and warn once. Eval-mode forwards are not checked, so switching between train and eval is no
difference.
"""

import itertools
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import collectives as comm
from .naming import clean_fqn
from .unit import FSDPUnit


class ExecOrderCheck:
    def __init__(self, root: FSDPUnit, units: Sequence[FSDPUnit]) -> None:
        self.group = root.process_group
        self.rank, self.world_size = self.group.rank(), self.group.size()
        self.device = root.compute_device
        self.units = [unit for unit in units if unit._handles]  # units that all-gather
        self.names = _unit_fqns(root, self.units)
        self.first_iteration = True
        self.first_order: list[FSDPUnit] = []  # the first iteration's order of units, eval forwards included
        self.position = 0  # index into first_order of this iteration's next training forward
        self.warned = False

    def pre_forward(self, unit: FSDPUnit, training: bool) -> None:
        if training:
            if self.first_iteration:
                self._compare_across_ranks(unit)
            else:
                self._compare_with_first(unit)
        if self.first_iteration and unit not in self.first_order:
            self.first_order.append(unit)

    def next_iteration(self) -> None:
        """At the end of backward: later iterations are checked against the first."""
        self.first_iteration = False
        self.position = 0

    def _compare_across_ranks(self, unit: FSDPUnit) -> None:
        mine = torch.tensor([self.units.index(unit)], dtype=torch.int32, device=self.device)
        everyone = torch.empty(self.world_size, dtype=torch.int32, device=self.device)
        comm.all_gather(everyone, mine, self.group).wait()
        indices = everyone.tolist()
        for (r1, i1), (r2, i2) in itertools.combinations(enumerate(indices), 2):
            if i1 != i2:  # every rank sees the same indices, so every rank raises here (torch's message)
                raise RuntimeError(
                    f"Forward order differs across ranks: rank {r1} is all-gathering parameters for "
                    f"{[self.names[self.units[i1]]]} while rank {r2} is all-gathering parameters for "
                    f"{[self.names[self.units[i2]]]}"
                )

    def _compare_with_first(self, unit: FSDPUnit) -> None:
        if self.warned:
            return
        if self.position >= len(self.first_order):
            reason = (
                "Expected to not all-gather any more parameters in the forward but trying to all-gather parameters for "
            )
        elif self.first_order[self.position] is not unit:
            expected = [self.names[self.first_order[self.position]]]
            reason = f"Expected to all-gather for {expected} but trying to all-gather parameters for "
        else:
            reason = ""
        if reason:
            warnings.warn(  # torch's message; once, then collectives go unchecked
                f"Forward order differs from that of the first iteration on rank {self.rank}. Collectives are "
                f"unchecked and may give incorrect results or hang.\n{reason}{[self.names[unit]]}",
                stacklevel=2,
            )
            self.warned = True
        self.position += 1


def _unit_fqns(root: nn.Module, units: Sequence[FSDPUnit]) -> dict[FSDPUnit, list[str]]:
    """Each unit's flattened parameters by clean FQN from the root, as torch names a flat parameter."""
    names: dict[FSDPUnit, list[str]] = {}
    for name, module in root.named_modules():
        if isinstance(module, FSDPUnit) and module in units:
            prefix = clean_fqn(name) + "." if clean_fqn(name) else ""
            names[module] = [prefix + info.fqn for handle in module._handles for info in handle.layout.params]
    return names


def enabled() -> bool:
    return dist.is_available() and dist.get_debug_level() == dist.DebugLevel.DETAIL
