"""Markdown tables of peak memory: per phase by category, and per module (or FSDP unit) at the overall peak."""

from collections import defaultdict
from collections.abc import Iterable, Sequence

from .categories import Category, Phase

Breakdown = dict[tuple[str, Category], int]  # bytes by (module FQN, category)


def markdown(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(headers) - 1)) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def unit_for(nbytes: int) -> tuple[str, int]:
    """GiB for large numbers, MiB otherwise."""
    return ("GiB", 2**30) if nbytes >= 10 * 2**30 else ("MiB", 2**20)


def fmt(nbytes: int, divisor: int) -> str:
    return f"{nbytes / divisor:,.2f}"


def by_category(breakdown: Breakdown) -> dict[Category, int]:
    out = dict.fromkeys(Category, 0)
    for (_, category), n in breakdown.items():
        out[category] += n
    return out


def fold(module: str, units: Iterable[str]) -> str:
    """The innermost of `units` that contains `module` (FQN prefixes; "" contains all), else `module` itself."""
    containing = [u for u in units if u == "" or module == u or module.startswith(u + ".")]
    return max(containing, key=len, default=module)


def phase_table(peaks: dict[Phase, Breakdown]) -> str:
    """One row per phase: its peak and how that peak splits into categories (empty categories left out)."""
    unit, div = unit_for(max((sum(b.values()) for b in peaks.values()), default=0))
    split = {phase: by_category(b) for phase, b in peaks.items()}
    categories = [c for c in Category if any(s[c] for s in split.values())]
    rows = [[p.value, fmt(sum(s.values()), div), *(fmt(s[c], div) for c in categories)] for p, s in split.items()]
    title = f"Peak live tensor memory ({unit}), split by category at each phase's peak"
    return title + "\n\n" + markdown(["phase", "peak", *(c.value for c in categories)], rows)


def module_table(breakdown: Breakdown, top: int, units: Sequence[str] = ()) -> str:
    """The `top` modules holding most of `breakdown`, by category. With `units`, modules count as the FSDP unit that
    contains them; "(root)" is the root unit, which also holds what was allocated outside any module."""
    unit, div = unit_for(sum(breakdown.values()))
    cells: dict[str, dict[Category, int]] = defaultdict(lambda: dict.fromkeys(Category, 0))
    for (module, category), n in breakdown.items():
        cells[fold(module, units)][category] += n
    totals = {module: sum(split.values()) for module, split in cells.items()}
    categories = [c for c in Category if any(split[c] for split in cells.values())]
    rows = [
        [module or "(root)", fmt(totals[module], div), *(fmt(cells[module][c], div) for c in categories)]
        for module in sorted(totals, key=lambda m: totals[m], reverse=True)[:top]
    ]
    title = f"By {'FSDP unit' if units else 'module'} at the overall peak ({unit}, top {top})"
    return title + "\n\n" + markdown(["module", "total", *(c.value for c in categories)], rows)
