"""MemoryProfile: one rank's peaks per phase as plain data (picklable, so ranks can send it)."""

from collections.abc import Hashable
from dataclasses import dataclass, field

from .categories import Category, Phase
from .table import Breakdown, by_category, module_table, phase_table


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes by (module FQN, category) at each phase's peak on one device; picklable."""

    peaks: dict[Phase, Breakdown]
    units: tuple[str, ...] = ()  # FQNs of the FSDP units, for the per-unit table
    device: str = "cpu"
    # With MemoryTracker(segments=True): the peak of each segment, (phase entry number, phase, label) -> bytes by
    # (module FQN, category), in the order the segments began (memory/repeated.py extrapolates them).
    segments: dict[tuple[int, Phase, Hashable], Breakdown] = field(default_factory=dict)
    method: str = "traced"  # how the peaks were found: "traced", or "extrapolated from ..." (memory/repeated.py)

    def peak(self, phase: Phase | None = None) -> int:
        """The peak of `phase`, or of all phases."""
        phases = [phase] if phase is not None else list(self.peaks)
        return max((sum(self.peaks[p].values()) for p in phases if p in self.peaks), default=0)

    def split(self, phase: Phase) -> dict[Category, int]:
        """How the peak of `phase` splits into categories."""
        return by_category(self.peaks.get(phase, {}))

    def table(self, top_modules: int = 12) -> str:
        overall = max(self.peaks.values(), key=lambda b: sum(b.values()), default={})
        return phase_table(self.peaks) + "\n\n" + module_table(overall, top_modules, self.units)
