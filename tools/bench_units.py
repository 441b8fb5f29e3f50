"""What a step costs per unit and per parameter, as the number of units grows: ours, torch's FSDP1, FSDP2 and DDP.

    python tools/bench_units.py                                  # 2 ranks, units 16..512 of d=64, about 10 minutes
    python tools/bench_units.py --units 16,64 --rounds 1         # a quick look
    python tools/bench_units.py --out docs/benchmarks.md --plot docs/bench_units.png

The model is tools/gpt.py's DeepMLP: `units` residual blocks of two d x d linears, each block one FSDP unit (one
`fully_shard` for FSDP2), the head in the root. Every unit has the same size, so the step time's growth with the
number of units is the cost of one more unit (its parameters' compute and communication included). A second sweep
holds the units at 64 and grows d, so that the step time's growth with the parameters is the cost of one more
parameter. Steps run interleaved across the implementations as in tools/bench.py (its runners, timing and
processes), each step's time the slowest rank's, the median reported.

The report gives, per implementation and number of units, the median step, the step per unit and per parameter, and
least-squares slopes: microseconds per unit (d fixed) and nanoseconds per parameter (units fixed); the per-unit
overhead is the per-unit slope less what the unit's parameters cost at the per-parameter slope.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import BASELINE, IMPLS, Row, Runner, Workload, guarded, log, timed_steps, write_report
from gpt import DeepMLP, MLPBlock
from process_exit import exit_now

BEGIN, END = "<!-- bench_units:begin -->", "<!-- bench_units:end -->"


@dataclass(frozen=True)
class Shape:
    units: int
    d: int

    @property
    def unit_params(self) -> int:
        """Parameters of one unit: two d x d linears with biases."""
        return 2 * (self.d * self.d + self.d)

    @property
    def params(self) -> int:
        """Parameters of the whole model: the units and the head (one more linear)."""
        return self.units * self.unit_params + self.unit_params // 2

    @property
    def label(self) -> str:
        return f"{self.units}x{self.d}"


@dataclass
class Result:
    shape: Shape
    rows: dict[str, Row] = field(default_factory=dict)

    def median(self, impl: str) -> float | None:
        row = self.rows.get(impl)
        return statistics.median(row.times) if row is not None and row.times else None


def workload(shape: Shape, rank: int, seed: int) -> Workload:
    g = torch.Generator().manual_seed(seed + 1 + rank)
    x, y = torch.randn(64, shape.d, generator=g), torch.randn(64, shape.d, generator=g)

    def build() -> DeepMLP:
        torch.manual_seed(seed)
        return DeepMLP(d=shape.d, n_blocks=shape.units)

    return Workload(build, MLPBlock, lambda m: F.mse_loss(m(x), y), f"DeepMLP {shape.label}")


def bench_shape(shape: Shape, args: argparse.Namespace) -> Result:
    wl = workload(shape, dist.get_rank(), args.seed)
    result = Result(shape, {impl: Row(shape.label, impl, dist.get_world_size()) for impl in args.impls})
    runners: dict[str, Runner] = {}
    for impl, row in result.rows.items():
        runner = guarded(row, "build", partial(Runner, impl, wl, torch.device("cpu")))
        if runner is not None and guarded(row, "warm-up", partial(runner.steps, args.warmup)):
            runners[impl] = runner
    for _ in range(args.rounds):
        for impl, runner in list(runners.items()):
            times = guarded(result.rows[impl], "timed step", partial(timed_steps, runner, args.steps))
            if times is None:
                del runners[impl]
            else:
                result.rows[impl].times += times
    log(f"[{shape.label}] done")
    return result


def worker(rank: int, args: argparse.Namespace, store_path: str, result_path: str) -> None:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.nproc))
    store = dist.FileStore(store_path, args.nproc)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.nproc, timeout=timedelta(minutes=10))
    results = [bench_shape(shape, args) for shape in args.shapes]
    if rank == 0:
        with open(result_path, "wb") as f:
            pickle.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    exit_now()


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x."""
    if len(points) < 2:
        return None
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else None


@dataclass(frozen=True)
class Costs:
    per_unit_us: float | None  # step time growth per unit, d fixed
    per_param_ns: float | None  # step time growth per parameter, units fixed
    overhead_per_unit_us: float | None  # per unit, less its parameters' cost


def costs(impl: str, unit_sweep: list[Result], param_sweep: list[Result]) -> Costs:
    per_unit = slope([(r.shape.units, t) for r in unit_sweep if (t := r.median(impl)) is not None])
    per_param = slope([(r.shape.params, t) for r in param_sweep if (t := r.median(impl)) is not None])
    overhead = None
    if per_unit is not None and per_param is not None and unit_sweep:
        overhead = per_unit - per_param * unit_sweep[0].shape.unit_params
    return Costs(_scaled(per_unit, 1e6), _scaled(per_param, 1e9), _scaled(overhead, 1e6))


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def render(args: argparse.Namespace, unit_sweep: list[Result], param_sweep: list[Result]) -> str:
    def ms(v: float | None) -> str:
        return f"{v * 1e3:.1f}" if v is not None else "n/a"

    def num(v: float | None, digits: int = 1) -> str:
        return f"{v:.{digits}f}" if v is not None else "n/a"

    lines = [
        f"torch {torch.__version__}, {args.nproc} ranks, CPU, gloo; {args.rounds} rounds x {args.steps} timed steps "
        f"after {args.warmup} warm-up; step = forward + backward + SGD(momentum); median of the slowest rank's steps.",
        "",
        "| units x d | parameters | impl | median step (ms) | vs torch FSDP1 | ms per unit | ns per parameter |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    seen: set[Shape] = set()
    for result in [*unit_sweep, *param_sweep]:
        if result.shape in seen:
            continue
        seen.add(result.shape)
        base = result.median(BASELINE)
        for impl in args.impls:
            t = result.median(impl)
            ratio = f"{t / base:.2f}x" if t is not None and base else "n/a"
            per_unit = num(t * 1e3 / result.shape.units, 3) if t is not None else "n/a"
            per_param = num(t * 1e9 / result.shape.params, 1) if t is not None else "n/a"
            errors = "; ".join(result.rows[impl].errors)[:80]
            lines.append(
                f"| {result.shape.label} | {result.shape.params:,} | {impl} | {ms(t)}{' ' + errors if errors else ''}"
                f" | {ratio} | {per_unit} | {per_param} |"
            )
    lines += [
        "",
        "| impl | us per unit (d fixed) | ns per parameter (units fixed) | us per unit, less its parameters |",
        "| --- | ---: | ---: | ---: |",
    ]
    for impl in args.impls:
        c = costs(impl, unit_sweep, param_sweep)
        figures = (num(c.per_unit_us, 0), num(c.per_param_ns, 2), num(c.overhead_per_unit_us, 0))
        lines.append(f"| {impl} | {' | '.join(figures)} |")
    return "\n".join(lines)


def plot(path: Path, args: argparse.Namespace, unit_sweep: list[Result]) -> None:
    """Step time per unit and per parameter against the number of units, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for impl in args.impls:
        points = [(r.shape, t) for r in unit_sweep if (t := r.median(impl)) is not None]
        units = [shape.units for shape, _ in points]
        axes[0].plot(units, [t * 1e3 / shape.units for shape, t in points], marker="o", label=impl)
        axes[1].plot(units, [t * 1e9 / shape.params for shape, t in points], marker="o", label=impl)
    for ax, ylabel in zip(axes, ("step time per unit (ms)", "step time per parameter (ns)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"units (DeepMLP blocks of d={unit_sweep[0].shape.d})")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"torch {torch.__version__}, {args.nproc} ranks, CPU, gloo", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--units", default="16,32,64,128,256,512", help="numbers of units, at d fixed")
    p.add_argument("--d", type=int, default=64, help="the units' width in the units sweep")
    p.add_argument("--widths", default="32,64,128,256", help="widths d at 64 units (the per-parameter sweep)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS}")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="markdown file whose bench_units block to rewrite")
    p.add_argument("--plot", default=None, help="PNG file to draw the per-unit and per-parameter costs in")
    args = p.parse_args()
    args.impls = [i for i in args.impls.split(",") if i]
    if unknown := set(args.impls) - set(IMPLS):
        p.error(f"unknown {sorted(unknown)}; choose from {IMPLS}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # fail before the long run
        p.error("--plot needs matplotlib: pip install matplotlib (or fsdp_legacy[plot])")
    args.unit_sweep = [Shape(int(n), args.d) for n in args.units.split(",") if n]
    args.param_sweep = [Shape(64, int(d)) for d in args.widths.split(",") if d]
    args.shapes = list(dict.fromkeys([*args.unit_sweep, *args.param_sweep]))
    return args


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.pkl")
        mp.spawn(worker, args=(args, os.path.join(tmp, "store"), result_path), nprocs=args.nproc, join=True)
        with open(result_path, "rb") as f:
            results: dict[Shape, Result] = {r.shape: r for r in pickle.load(f)}
    unit_sweep = [results[s] for s in args.unit_sweep]
    param_sweep = [results[s] for s in args.param_sweep]
    report = render(args, unit_sweep, param_sweep)
    print(report, flush=True)
    if args.out:
        write_report(Path(args.out), report, BEGIN, END)
        print(f"wrote {args.out}", flush=True)
    if args.plot:
        plot(Path(args.plot), args, unit_sweep)
        print(f"wrote {args.plot}", flush=True)


if __name__ == "__main__":
    main()
