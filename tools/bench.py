"""Benchmark fsdp_legacy ("ours") against torch's FSDP1, FSDP2 and DDP on the same models.

    python tools/bench.py                              # 2 ranks, gloo on CPU (nccl on CUDA)
    python tools/bench.py --nproc 1,2,4                # one run per world size, one table
    python tools/bench.py --steps 3 --warmup 1 --rounds 1 --impls torch_fsdp1,fsdp2,ddp
    python tools/bench.py --out docs/benchmarks.md     # also rewrite the table in that file
    python tools/bench.py --plot docs/benchmarks.png   # also draw a figure (needs matplotlib)
    python tools/bench.py --models gpt-bf16            # one model: GPT in bf16 mixed precision
    python tools/bench.py --nproc 2 --backend gloo     # on one GPU: two ranks share it over gloo

The script spawns its own ranks. Every rank builds each model from the same seed and feeds
every implementation the same per-rank batch. A step is forward + backward + SGD(momentum)
step. Timed steps run interleaved (A B C D A B C D ...) so drift on a shared machine hits all
implementations alike; each step time is the slowest rank's, and the table shows the median.

A ``-compiled`` model (``gpt-compiled``) is the same model and data with the whole wrapped model under
``torch.compile`` (inductor), for the two FSDP1 implementations: its notes give each one's first step (compiling
included, inductor's on-disk cache off so neither reuses the other's kernels). Its memory pass is skipped.

A ``-bf16`` model (``gpt-bf16``) is the same model and data with bf16 mixed precision:
FSDP1 (ours and torch) get ``MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32,
buffer_dtype=bfloat16)``, FSDP2 gets ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``. DDP has no equivalent and is not run on those models.

Peak memory is measured in a separate, untimed pass per implementation (built alone, one
warm-up step, then one measured step) so the measurement costs nothing in the timings:
on CUDA with ``torch.cuda.max_memory_allocated``; on CPU with a ``TorchDispatchMode`` that
tracks the bytes of every live tensor storage (``fsdp_legacy.memory.MemoryTracker``). Both count parameters,
gradients, optimizer state, activations and communication buffers of that implementation.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import pickle
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import fsdp_legacy from the checkout
from fsdp_legacy.memory import MemoryTracker
from gpt import GPT, Block, DeepMLP, GPTConfig, MLPBlock
from process_exit import exit_now

IMPLS = ["ours", "torch_fsdp1", "fsdp2", "ddp"]
MODELS = ["gpt", "gpt-bf16", "gpt-compiled", "mlp"]
BF16_IMPLS = ["ours", "torch_fsdp1", "fsdp2"]  # implementations with a bf16 mixed-precision policy
COMPILED_IMPLS = ["ours", "torch_fsdp1"]  # the compiled rows compare the two FSDP1 implementations
BASELINE = "torch_fsdp1"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


# --------------------------------------------------------------------------------------
# Workloads: model + fixed per-rank batch + loss
# --------------------------------------------------------------------------------------


@dataclass
class Workload:
    build: Callable[[], nn.Module]  # same init on every call (seeded)
    unit: type[nn.Module]  # the class that becomes one FSDP unit
    loss: Callable[[nn.Module], torch.Tensor]  # forward on the fixed batch
    desc: str
    bf16: bool = False  # bf16 mixed precision: bf16 compute, fp32 sharded params and grad reduction
    compiled: bool = False  # the whole wrapped model under torch.compile


def make_workload(name: str, rank: int, device: torch.device, seed: int) -> Workload:
    if name.endswith("-compiled"):  # same model and data, compiled
        wl = make_workload(name.removesuffix("-compiled"), rank, device, seed)
        return replace(wl, compiled=True, desc=wl.desc + ", whole wrapped model under torch.compile (inductor)")
    if name.endswith("-bf16"):  # same model and data, bf16 mixed precision
        wl = make_workload(name.removesuffix("-bf16"), rank, device, seed)
        return replace(wl, bf16=True, desc=wl.desc + ", bf16 mixed precision")
    g = torch.Generator().manual_seed(seed + 1 + rank)  # ranks get different data

    def seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            torch.manual_seed(seed)
            return factory()

        return build

    if name == "gpt":
        cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=8, n_head=4, d_model=256)
        x = torch.randint(cfg.vocab_size, (4, cfg.block_size), generator=g).to(device)
        y = torch.randint(cfg.vocab_size, (4, cfg.block_size), generator=g).to(device)
        return Workload(seeded(lambda: GPT(cfg)), Block, lambda m: m(x, y)[1], "GPT 8 x d256, batch 4 x 128 tokens")
    if name == "mlp":
        x = torch.randn(64, 128, generator=g).to(device)
        y = torch.randn(64, 128, generator=g).to(device)
        return Workload(
            seeded(lambda: DeepMLP(d=128, n_blocks=64)),
            MLPBlock,
            lambda m: F.mse_loss(m(x), y),
            "DeepMLP 64 x d128, batch 64",
        )
    raise ValueError(f"unknown model {name!r}")


def wrap(impl: str, wl: Workload, device: torch.device) -> nn.Module:
    """Shard/replicate a new ``wl`` model with ``impl``, one unit per ``wl.unit`` (FSDP-style)."""
    module, bf16 = wl.build(), torch.bfloat16
    if impl in ("ours", "torch_fsdp1"):
        fsdp = importlib.import_module("fsdp_legacy" if impl == "ours" else "torch.distributed.fsdp")
        policy = importlib.import_module(f"{fsdp.__name__}.wrap").ModuleWrapPolicy({wl.unit})
        mp = None
        if wl.bf16:
            mp = fsdp.MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32, buffer_dtype=bf16)
        # Identical arguments: ours is a drop-in replacement.
        return fsdp.FullyShardedDataParallel(module, auto_wrap_policy=policy, mixed_precision=mp, device_id=device)
    if impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp2 = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        if not wl.bf16:
            mp2 = MixedPrecisionPolicy()  # the default: no mixed precision
        for m in module.modules():
            if isinstance(m, wl.unit):
                fully_shard(m, mesh=mesh, mp_policy=mp2)
        fully_shard(module, mesh=mesh, mp_policy=mp2)
        return module
    if wl.bf16:
        raise ValueError(f"{impl} has no bf16 mixed-precision policy here")
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(module.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    raise ValueError(f"unknown impl {impl!r}")


class Runner:
    """One implementation wrapping one model, plus its optimizer."""

    def __init__(self, impl: str, wl: Workload, device: torch.device) -> None:
        self.wl, self.device = wl, device
        self.model = wrap(impl, wl, device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.forward: nn.Module = self.model
        if wl.compiled:
            torch._dynamo.reset()  # each implementation compiles its own graphs
            self.forward = torch.compile(self.model)  # type: ignore[assignment]

    def step(self) -> None:
        self.wl.loss(self.forward).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def steps(self, n: int) -> bool:
        for _ in range(n):
            self.step()
        return True


# --------------------------------------------------------------------------------------
# Peak memory
# --------------------------------------------------------------------------------------


def warm_up_cuda_libraries(wl: Workload, device: torch.device) -> None:
    """cuBLAS takes its workspaces from the caching allocator at a stream's first matrix products, in fp32 and in bf16,
    and keeps them for the process's life: one plain step in each dtype first, so that the implementation measured
    first does not pay for them alone (tens of MiB on a Hopper GPU)."""
    model = wl.build().to(device)
    for low_precision in (False, True):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=low_precision):
            loss = wl.loss(model)
        loss.float().backward()
    del model, loss
    torch.cuda.synchronize()


def measure_peak_mib(impl: str, wl: Workload, device: torch.device) -> float:
    """Peak bytes (MiB) of one step of ``impl`` built alone: persistent state + transients."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        runner = Runner(impl, wl, device)
        runner.step()  # creates optimizer state: part of the steady state
        torch.cuda.reset_peak_memory_stats()
        runner.step()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with MemoryTracker() as tracker:
            runner = Runner(impl, wl, device)
            runner.step()
            tracker.reset_peak()
            runner.step()
        peak = tracker.peak()
    del runner
    gc.collect()
    return peak / 2**20


# --------------------------------------------------------------------------------------
# The benchmark (runs on every rank)
# --------------------------------------------------------------------------------------


@dataclass
class Row:
    model: str
    impl: str
    ranks: int = 0
    times: list[float] = field(default_factory=list)  # seconds, slowest rank per step
    peak_mib: float | None = None
    first_step_s: float | None = None  # compiled rows: the first step, compiling included
    errors: list[str] = field(default_factory=list)  # "phase: first line of the exception"


def comm_device() -> torch.device:
    """Where small bookkeeping tensors must live for the backend's collectives."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def log(msg: str) -> None:
    """Progress on stderr from rank 0, so stdout stays the report."""
    if dist.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def all_ok(ok: bool) -> bool:
    """True only if ``ok`` on every rank: keeps ranks in lockstep after a failure."""
    flag = torch.tensor([0 if ok else 1], device=comm_device())
    dist.all_reduce(flag)
    return flag.item() == 0


def guarded(row: Row, phase: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn``; on failure (on any rank) record the error in ``row`` and return None."""
    try:
        result, err = fn(), None
    except Exception as e:
        result, err = None, f"{type(e).__name__}: {e}".splitlines()[0]
        if dist.get_rank() == 0:
            traceback.print_exc()
    if not all_ok(err is None):
        row.errors.append(f"{phase}: {err or 'failed on another rank'}")
        return None
    return result


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> list[Row]:
    wl = make_workload(name, dist.get_rank(), device, args.seed)
    impls = [i for i in args.impls if i in BF16_IMPLS] if wl.bf16 else args.impls
    if wl.compiled:
        impls = [i for i in impls if i in COMPILED_IMPLS]
        torch._inductor.config.fx_graph_cache = False  # each implementation pays its own compile
    rows = {impl: Row(name, impl, dist.get_world_size()) for impl in impls}

    if not wl.compiled:
        log(f"[{name}] memory pass: {', '.join(rows)}")
        if device.type == "cuda":
            warm_up_cuda_libraries(wl, device)
        for impl, row in rows.items():
            row.peak_mib = guarded(row, "memory pass", partial(measure_peak_mib, impl, wl, device))

    log(f"[{name}] build + {args.warmup} warm-up steps each")
    runners: dict[str, Runner] = {}
    for impl, row in rows.items():
        runner = guarded(row, "build", partial(Runner, impl, wl, device))
        if runner is None:
            continue
        if wl.compiled:
            first = guarded(row, "first step", partial(timed_steps, runner, 1))
            row.first_step_s = first[0] if first else None
        if guarded(row, "warm-up", partial(runner.steps, args.warmup)):
            runners[impl] = runner

    for rnd in range(args.rounds):
        for impl, runner in list(runners.items()):
            times = guarded(rows[impl], "timed step", partial(timed_steps, runner, args.steps))
            if times is None:
                del runners[impl]
            else:
                rows[impl].times += times
        log(f"[{name}] round {rnd + 1}/{args.rounds} done")
    return list(rows.values())


def timed_steps(runner: Runner, n: int) -> list[float]:
    times = torch.zeros(n, dtype=torch.float64, device=comm_device())
    for i in range(n):
        dist.barrier()  # start together, so a step's time is not another rank's lag
        t0 = time.perf_counter()
        runner.step()
        times[i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return times.tolist()


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def render(rows: list[Row], args: argparse.Namespace, descs: dict[str, str], env: str) -> str:
    if env.startswith("cuda"):
        mem = "torch.cuda.max_memory_allocated"
    else:
        mem = "live tensor storages (TorchDispatchMode)"
    ranks = ", ".join(map(str, args.nproc))
    setup = (
        f"torch {torch.__version__}, {ranks} ranks, {env}; "
        f"{args.rounds} rounds x {args.steps} timed steps after {args.warmup} warm-up; "
        f"step = forward + backward + SGD(momentum); peak memory per rank from {mem}."
    )
    lines = [
        setup,
        "",
        "| model | ranks | impl | median step (ms) | vs torch FSDP1 | peak MiB / rank | notes |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    base = {(r.model, r.ranks): statistics.median(r.times) for r in rows if r.impl == BASELINE and r.times}
    for r in rows:
        med = statistics.median(r.times) if r.times else None
        ms = f"{med * 1e3:.1f}" if med is not None else "n/a"
        key = (r.model, r.ranks)
        ratio = f"{med / base[key]:.2f}x" if med is not None and key in base else "n/a"
        peak = f"{r.peak_mib:.1f}" if r.peak_mib is not None else "n/a"
        first = [f"first step {r.first_step_s:.1f} s (compiling)"] if r.first_step_s is not None else []
        notes = "; ".join(first + [e[:120] for e in r.errors]).replace("|", "\\|")
        lines.append(f"| {r.model} | {r.ranks} | {r.impl} | {ms} | {ratio} | {peak} | {notes} |")
    lines += ["", "Models: " + "; ".join(f"`{m}` = {d}" for m, d in descs.items()) + "."]
    return "\n".join(lines)


def write_report(path: Path, report: str, begin: str = BEGIN, end: str = END) -> None:
    """Put ``report`` in ``path`` between the markers ``begin`` and ``end``, keeping the prose around them.

    Without markers, the file's first markdown table is replaced (or the block appended).
    """
    block = f"{begin}\n{report}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        lines = text.splitlines()
        table = [i for i, line in enumerate(lines) if line.lstrip().startswith("|")]
        if table:
            first = last = table[0]
            while last + 1 in table:
                last += 1
            lines[first : last + 1] = block.splitlines()
            text = "\n".join(lines) + "\n"
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def plot(rows: list[Row], path: Path, title: str, descs: dict[str, str]) -> None:
    """Per model: median step time (labelled with the ratio vs torch FSDP1) and peak MiB per rank, one group of bars
    per world size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or fsdp_legacy[plot])") from e

    models = list(dict.fromkeys(r.model for r in rows))
    world_sizes = sorted({r.ranks for r in rows})
    fig, axes = plt.subplots(2, len(models), figsize=(4.6 * len(models), 6.6), squeeze=False)
    colors = [plt.get_cmap("tab10")(i) for i in range(10)]
    for col, model in enumerate(models):
        mrows = [r for r in rows if r.model == model]
        impls = list(dict.fromkeys(r.impl for r in mrows))
        width = 0.8 / len(impls)
        for row_index, ylabel in enumerate(("median step (ms)", "peak MiB / rank")):
            ax = axes[row_index][col]
            top = 1e-9
            for i, impl in enumerate(impls):
                xs, vals, labels = [], [], []
                for x, ranks in enumerate(world_sizes):
                    found = [r for r in mrows if r.impl == impl and r.ranks == ranks]
                    if not found:
                        continue
                    r = found[0]
                    base = [b for b in mrows if b.impl == BASELINE and b.ranks == ranks and b.times]
                    if row_index == 0:
                        v = statistics.median(r.times) * 1e3 if r.times else 0.0
                        b = statistics.median(base[0].times) * 1e3 if base else 0.0
                        labels.append(f"{v / b:.2f}x" if b and v else "n/a")
                    else:
                        v = r.peak_mib or 0.0
                        labels.append(f"{v:.1f}" if v else "n/a")
                    xs.append(x + (i - (len(impls) - 1) / 2) * width)
                    vals.append(v)
                bars = ax.bar(xs, vals, width, label=impl, color=colors[IMPLS.index(impl) % len(colors)])
                ax.bar_label(bars, labels=labels, fontsize=6, padding=1, rotation=90)
                top = max([top, *vals])
            ax.set_xticks(range(len(world_sizes)), [f"{w} rank{'s' if w > 1 else ''}" for w in world_sizes])
            ax.set_ylabel(ylabel)
            ax.set_ylim(0, top * 1.3)
            ax.grid(axis="y", alpha=0.3)
            if row_index == 0:
                ax.set_title(f"{descs.get(model, model)}\nlabels: ratio vs {BASELINE}", fontsize=9)
        axes[0][col].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------


def worker(rank: int, args: argparse.Namespace, nproc: int, store_path: str, result_path: str) -> None:
    cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if cuda else "gloo")
    if cuda:  # gloo may put several ranks on one GPU; NCCL needs a GPU per rank (parse_args checks)
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // nproc))  # same budget for all
    store = dist.FileStore(store_path, nproc)
    # A finite timeout turns a rank stuck on a peer's failure into an error instead of a hang.
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=nproc,
        timeout=timedelta(minutes=10),
    )

    rows: list[Row] = []
    descs: dict[str, str] = {}
    for name in args.models:
        descs[name] = make_workload(name, rank, device, args.seed).desc
        rows += bench_model(name, args, device)

    if rank == 0:
        if cuda:
            gpus = min(nproc, torch.cuda.device_count())
            env = f"cuda ({torch.cuda.get_device_name()} x {gpus}), {backend}"
        else:
            env = f"CPU, gloo, {len(os.sched_getaffinity(0))} cores split between the ranks"
        with open(result_path, "wb") as f:
            pickle.dump((rows, descs, env), f)
    # Every rank done with every collective before any tears its process group down, then out without the teardown.
    dist.barrier()
    dist.destroy_process_group()
    exit_now()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="timed steps per implementation per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation first")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds over the implementations")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS}")
    p.add_argument("--nproc", default="2", help="ranks to spawn; a comma-separated list runs once per world size")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / nproc)")
    p.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default=None,
        help="process group backend (default: nccl on CUDA, gloo on CPU); gloo on CUDA lets ranks share a GPU",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="markdown file whose benchmark table to rewrite")
    p.add_argument("--plot", default=None, help="PNG file to draw the results in (needs matplotlib)")
    args = p.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    args.impls = [i for i in args.impls.split(",") if i]
    for value, known in ((args.models, MODELS), (args.impls, IMPLS)):
        unknown = set(value) - set(known)
        if unknown:
            p.error(f"unknown {sorted(unknown)}; choose from {known}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # fail before the long run
        p.error("--plot needs matplotlib: pip install matplotlib (or fsdp_legacy[plot])")
    args.nproc = [int(n) for n in args.nproc.split(",") if n]
    if torch.cuda.is_available() and args.backend != "gloo" and max(args.nproc) > torch.cuda.device_count():
        p.error(f"NCCL needs a GPU per rank and there are {torch.cuda.device_count()}: use --backend gloo to share")
    return args


def main() -> None:
    args = parse_args()
    rows: list[Row] = []
    descs: dict[str, str] = {}
    envs = []
    for nproc in args.nproc:
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "result.pkl")
            mp.spawn(worker, args=(args, nproc, os.path.join(tmp, "store"), result), nprocs=nproc, join=True)
            with open(result, "rb") as f:
                more, more_descs, env = pickle.load(f)
        rows += more
        descs.update(more_descs)
        envs.append(env)
    rows.sort(key=lambda r: (args.models.index(r.model), r.ranks))  # stable: impls keep their order
    env = envs[0] if len(set(envs)) == 1 else "; ".join(envs)
    report = render(rows, args, descs, env)
    print(report, flush=True)
    if args.out:
        write_report(Path(args.out), report)
        print(f"wrote {args.out}", flush=True)
    if args.plot:
        title = f"torch {torch.__version__}, {', '.join(map(str, args.nproc))} ranks, {env}"
        plot(rows, Path(args.plot), title, descs)
        print(f"wrote {args.plot}", flush=True)


if __name__ == "__main__":
    main()
