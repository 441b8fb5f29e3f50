"""Predict per-rank peak memory of FSDP training before launching it: the wrap plan and the estimator's peaks per phase.

    python tools/mem_report.py --model gpt-7b --world-sizes 8,64 --mixed-precision bf16
    python tools/mem_report.py --model gpt-small --world-sizes 1,2,4 --sharding-strategy SHARD_GRAD_OP
    python tools/mem_report.py --module mypkg.models:build --batch 4x2048 --world-sizes 64 --plot mem.png

Nothing is allocated and no ranks are started: the model is built on fake tensors and trained for `--steps` steps
on a fake process group of each world size (fsdp_legacy.memory.estimate_memory). `--module pkg.mod:factory` names a
function returning the plain model; its forward takes a (batch, seq) tensor of token ids (`--vocab-size` values)
and returns logits, or a tuple whose first element is the loss (as tools/gpt.py's GPT with targets). Units are the
module classes named by `--wrap` (default: the model's block class, GPT's `Block`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp_legacy from the checkout
from fsdp_legacy import CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_legacy.memory import MemoryProfile, Phase, estimate_memory
from fsdp_legacy.memory.table import markdown, unit_for
from fsdp_legacy.wrap import ModuleWrapPolicy
from gpt import GPT, Block, GPTConfig

GPT_CONFIGS = {  # name -> (config, default batch x sequence)
    "gpt-small": (GPTConfig(vocab_size=256, block_size=128, n_layer=8, n_head=4, d_model=256), (4, 128)),
    "gpt-1b": (GPTConfig(vocab_size=32000, block_size=2048, n_layer=24, n_head=16, d_model=2048), (1, 2048)),
    "gpt-7b": (GPTConfig(vocab_size=32000, block_size=2048, n_layer=32, n_head=32, d_model=4096), (1, 2048)),
}
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
}
PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.OTHER)


@dataclass(frozen=True)
class Workload:
    build: Callable[[], nn.Module]
    unit: type[nn.Module]
    vocab_size: int
    batch: tuple[int, int]


def workload(args: argparse.Namespace) -> Workload:
    if args.module:
        path, _, factory = args.module.partition(":")
        build = getattr(importlib.import_module(path), factory or "build")
        unit = _class(args.wrap) if args.wrap else Block
        return Workload(build, unit, args.vocab_size, args.batch or (1, 2048))
    config, batch = GPT_CONFIGS[args.model]
    return Workload(
        lambda: GPT(config), _class(args.wrap) if args.wrap else Block, config.vocab_size, args.batch or batch
    )


def _class(dotted: str) -> type[nn.Module]:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def loss_fn(work: Workload) -> Callable[[nn.Module, int], torch.Tensor]:
    def loss(model: nn.Module, step: int) -> torch.Tensor:
        tokens = torch.randint(0, work.vocab_size, work.batch)
        out = model(tokens, tokens) if isinstance(model.module, GPT) else model(tokens)
        if isinstance(out, tuple):
            return out[1] if isinstance(model.module, GPT) else out[0]
        return F.cross_entropy(out.float().flatten(0, -2), tokens.flatten())

    return loss


def fsdp_kwargs(args: argparse.Namespace, work: Workload) -> dict:
    kwargs: dict = dict(auto_wrap_policy=ModuleWrapPolicy({work.unit}), sharding_strategy=args.sharding_strategy)
    if PRECISIONS[args.mixed_precision] is not None:
        low = PRECISIONS[args.mixed_precision]
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=low, reduce_dtype=torch.float32, buffer_dtype=low)
    if args.offload:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    return kwargs


def wrap_plan(work: Workload) -> str:
    """Units and their parameter counts, from a meta-device model (no memory)."""
    with torch.device("meta"):
        model = work.build()
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, work.unit)]
    inside = {id(p) for _, m in units for p in m.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in inside)
    sizes = [(name, sum(p.numel() for p in m.parameters())) for name, m in units]
    total = root + sum(n for _, n in sizes)
    largest = max(sizes, key=lambda s: s[1], default=("(root)", root))
    lines = [
        f"Wrap plan: {len(units)} {work.unit.__name__} units + the root; {total:,} parameters",
        f"  root (outside units): {root:,}",
        f"  largest unit: {largest[0]} with {largest[1]:,}",
    ]
    if sizes:
        lines.append(
            f"  per unit: {sizes[0][1]:,}"
            if len({n for _, n in sizes}) == 1
            else "  units: " + ", ".join(f"{n}={c:,}" for n, c in sizes)
        )
    return "\n".join(lines)


def report(profiles: dict[int, MemoryProfile], seconds: dict[int, float]) -> str:
    unit, div = unit_for(max(p.peak() for p in profiles.values()))
    rows = [
        [ws, *(f"{p.peak(ph) / div:,.2f}" for ph in PHASES), f"{p.peak() / div:,.2f}", f"{seconds[ws]:.1f}"]
        for ws, p in profiles.items()
    ]
    headers = ["world size", *(ph.value for ph in PHASES), "peak", "estimate (s)"]
    return f"Predicted peak per rank ({unit}; 'other' includes construction)\n\n" + markdown(headers, rows)


def plot(profiles: dict[int, MemoryProfile], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or fsdp_legacy[plot])") from e
    unit, div = unit_for(max(p.peak() for p in profiles.values()))
    sizes = list(profiles)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for phase in PHASES[:3]:
        ax.plot(sizes, [profiles[ws].peak(phase) / div for ws in sizes], marker="o", label=phase.value)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(ws) for ws in sizes])
    ax.set_xlabel("world size")
    ax.set_ylabel(f"predicted peak per rank ({unit})")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default="gpt-small", choices=list(GPT_CONFIGS), help="a built-in GPT")
    source.add_argument("--module", help="pkg.mod:factory returning your plain model")
    p.add_argument("--wrap", help="dotted class of the FSDP unit (default: gpt.Block)")
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids for --module models")
    p.add_argument("--batch", type=lambda s: tuple(map(int, s.split("x"))), help="BATCHxSEQ, e.g. 4x2048")
    p.add_argument("--world-sizes", default="1,2,8,64", help="comma-separated")
    p.add_argument("--sharding-strategy", default="FULL_SHARD", choices=[s.name for s in ShardingStrategy])
    p.add_argument("--mixed-precision", default="fp32", choices=list(PRECISIONS))
    p.add_argument("--offload", action="store_true", help="CPUOffload(offload_params=True)")
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=2, help="training steps per estimate (2: with optimizer state)")
    p.add_argument("--details", action="store_true", help="also print each estimate's per-category tables")
    p.add_argument("--plot", help="PNG file for the peaks per world size (needs matplotlib)")
    args = p.parse_args(argv)
    args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    args.sharding_strategy = ShardingStrategy[args.sharding_strategy]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = workload(args)
    print(wrap_plan(work), end="\n\n")
    setup = (
        f"{args.sharding_strategy.name}, {args.mixed_precision}{', CPU offload' if args.offload else ''}, "
        f"{args.optimizer}, batch {work.batch[0]}x{work.batch[1]}"
    )
    print(setup, end="\n\n")
    profiles, seconds = {}, {}
    for ws in args.world_sizes:
        start = time.perf_counter()
        with warnings.catch_warnings():  # e.g. FSDP's "switching to NO_SHARD" at world size 1
            warnings.simplefilter("ignore")
            profiles[ws] = estimate_memory(
                work.build, loss_fn(work), ws, fsdp_kwargs(args, work), OPTIMIZERS[args.optimizer], args.steps
            )
        seconds[ws] = time.perf_counter() - start
        if args.details:
            print(f"world size {ws}\n\n{profiles[ws].table()}\n")
    print(report(profiles, seconds))
    if args.plot:
        name = args.module or args.model
        plot(profiles, Path(args.plot), f"{name}: {setup}")
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
