"""`fsdp-legacy mem-report`: each rank's predicted peak memory (fsdp_legacy.memory.estimate_memory), per phase and
world size, before a run is launched."""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..api import CPUOffload, MixedPrecision, ShardingStrategy
from ..memory import Category, MemoryProfile, Phase, estimate_memory
from ..memory.repeated import SAMPLES, estimate_memory_repeated
from ..memory.table import markdown, unit_for
from ..wrap import ModuleWrapPolicy
from .common import EXIT_CODES, EXIT_OK, UsageError, import_name, module_class, progress
from .gpt import CONFIGS, GPT, Block
from .llama import PRESETS, DecoderLayer, Llama
from .lora import to_lora
from .qlora import to_qlora

HELP = "predict each rank's peak memory for a model, world sizes and FSDP settings, allocating nothing"

DESCRIPTION = """Predict per-rank peak memory of FSDP training before launching it: the wrap plan, then the peaks of
forward, backward, the optimizer step and the rest (construction included) at each world size.

Nothing is allocated and no ranks are started: the model is built on fake tensors and trained for --steps steps on a
fake process group of each world size (fsdp_legacy.memory.estimate_memory), with the same code as a real run. A 6.6 B
GPT on 64 ranks takes seconds; estimates are within 10% of measured peaks (docs/memory.md). A built-in model of more
than 12 identical layers is traced at 3, 4 and 5 layers and extrapolated, checked to be exact, to the same figures
as the full trace (--full-trace traces every layer; fsdp_legacy/memory/repeated.py).

--model picks a built-in GPT; --module pkg.mod:factory names a function returning your plain model (the current
directory is importable), whose forward takes a (batch, seq) tensor of token ids (--vocab-size values) and returns
logits, or a tuple whose first element is the loss or the logits. --wrap names the module class each FSDP unit wraps
(default: the built-in GPT's Block; required with --module)."""

EXAMPLES = f"""examples:
  fsdp-legacy mem-report --model gpt-7b --world-sizes 8,64 --mixed-precision bf16
  fsdp-legacy mem-report --model gpt-small --world-sizes 1,2,4 --sharding-strategy SHARD_GRAD_OP --details
  fsdp-legacy mem-report --module mypkg.models:build --wrap mypkg.models.Layer --batch 4x2048 --world-sizes 64
  fsdp-legacy mem-report --model gpt-1b --world-sizes 8 --offload --json      # bytes, for scripts
  fsdp-legacy mem-report --model llama-70b --qlora --activation-checkpointing --mixed-precision bf16 \
      --world-sizes 2 --offload                                            # QLoRA on two GPUs
  fsdp-legacy mem-report --model llama-8b --lora --lora-rank 16 --mixed-precision bf16 --world-sizes 8

{EXIT_CODES}"""

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
}
PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.OTHER)


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "mem-report",
        help=HELP,
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        default="gpt-small",
        choices=[*CONFIGS, *PRESETS],
        help="a built-in GPT, or a Llama with a real model's shapes (default gpt-small)",
    )
    source.add_argument("--module", help="pkg.mod:factory, a function returning your plain model")
    p.add_argument("--wrap", help="dotted class of the FSDP unit, e.g. mypkg.models.Layer (default: the GPT's Block)")
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids for --module models (default 32000)")
    p.add_argument("--batch", type=_batch, help="BATCHxSEQ, e.g. 4x2048 (default: the model's, 1x2048 for --module)")
    p.add_argument("--world-sizes", type=_world_sizes, default=[1, 2, 8, 64], help="comma-separated (default 1,2,8,64)")
    p.add_argument("--sharding-strategy", default="FULL_SHARD", choices=[s.name for s in ShardingStrategy])
    p.add_argument(
        "--shard-group-size",
        type=int,
        default=8,
        help="HYBRID_SHARD: ranks per shard group, a node (default 8; all ranks for a smaller world)",
    )
    p.add_argument("--mixed-precision", default="fp32", choices=list(PRECISIONS))
    p.add_argument("--offload", action="store_true", help="CPUOffload(offload_params=True)")
    p.add_argument("--use-orig-params", action="store_true", help="use_orig_params=True (implied by --lora, --qlora)")
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="checkpoint each unit's activations (non-reentrant)"
    )
    p.add_argument(
        "--qlora",
        action="store_true",
        help="frozen 4-bit base weights and trainable LoRA adapters on every linear layer but the output head",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="the model frozen as it is, trainable LoRA adapters on every linear layer but the output head",
    )
    p.add_argument("--lora-rank", type=int, default=64, help="--lora, --qlora: the adapters' rank (default 64)")
    p.add_argument("--layers", type=int, help="a Llama preset's first N decoder layers only (default: all)")
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=2, help="training steps per estimate (2: with optimizer state)")
    p.add_argument("--details", action="store_true", help="also print each estimate's per-category tables")
    p.add_argument(
        "--full-trace",
        action="store_true",
        help="trace every layer, not 3, 4 and 5 of them extrapolated exactly (the same figures; slower)",
    )
    p.add_argument("--plot", help="PNG file for the peaks per world size (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the wrap plan and peaks (bytes) as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _batch(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not BATCHxSEQ, e.g. 4x2048")
    return int(parts[0]), int(parts[1])


def hybrid_shape(args: argparse.Namespace, world_size: int) -> tuple[int, int] | None:
    """(replicas, shard group size) of a hybrid strategy's mesh at this world size, as init_device_mesh takes it."""
    if args.sharding_strategy not in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        return None
    shard = min(args.shard_group_size, world_size)
    if shard < 1 or world_size % shard:
        raise UsageError(
            f"--shard-group-size {args.shard_group_size} does not divide world size {world_size}: hybrid sharding "
            "replicates whole shard groups (choose a size that divides every --world-sizes value)."
        )
    return world_size // shard, shard


def _world_sizes(text: str) -> list[int]:
    sizes = [part.strip() for part in text.split(",") if part.strip()]
    if not sizes or not all(size.isdigit() and int(size) > 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of world sizes, e.g. 1,8,64")
    return [int(size) for size in sizes]


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], nn.Module]
    unit: type[nn.Module]
    vocab_size: int
    batch: tuple[int, int]
    layers: Callable[[int], nn.Module] | None = None  # the model with its first n layers, for a built-in model
    num_layers: int = 0


def workload(args: argparse.Namespace) -> Workload:
    if args.module:
        if not args.wrap:
            raise UsageError(
                f"--module {args.module} needs --wrap: the dotted class of the module each FSDP unit wraps (your "
                "transformer layer, e.g. mypkg.models.Layer)."
            )
        path, _, factory = args.module.partition(":")
        build = import_name(path, factory or "build", f"--module {args.module}")
        if not callable(build):
            raise UsageError(f"--module {args.module}: {factory or 'build'} is not a function returning a model.")
        return Workload(args.module, build, module_class(args.wrap), args.vocab_size, args.batch or (1, 2048))
    if args.layers is not None and (args.module or args.model not in PRESETS):
        raise UsageError(f"--layers {args.layers}: only for the Llama presets ({', '.join(PRESETS)}).")
    if args.model in PRESETS:
        try:
            llama = PRESETS[args.model].with_layers(args.layers)
        except ValueError as error:
            raise UsageError(str(error)) from None
        unit = module_class(args.wrap) if args.wrap else DecoderLayer
        batch = args.batch or (1, 2048)

        def llama_layers(n: int) -> nn.Module:
            return Llama(llama.with_layers(n))

        return Workload(args.model, lambda: Llama(llama), unit, llama.vocab_size, batch, llama_layers, llama.num_layers)
    config, batch = CONFIGS[args.model]
    batch = args.batch or batch
    if batch[1] > config.block_size:
        raise UsageError(f"--batch {batch[0]}x{batch[1]}: {args.model} takes sequences of at most {config.block_size}.")
    unit = module_class(args.wrap) if args.wrap else Block

    def gpt_layers(n: int) -> nn.Module:
        return GPT(replace(config, n_layer=n))

    return Workload(args.model, lambda: GPT(config), unit, config.vocab_size, batch, gpt_layers, config.n_layer)


def with_training_setup(args: argparse.Namespace, work: Workload) -> Workload:
    """`work` with LoRA or QLoRA and activation checkpointing applied to its model as it is built."""
    if not (args.lora or args.qlora or args.activation_checkpointing):
        return work

    def set_up(model: nn.Module) -> nn.Module:
        if args.qlora:
            to_qlora(model, rank=args.lora_rank)
        elif args.lora:
            to_lora(model, rank=args.lora_rank)
        if args.activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

            apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, work.unit))
        return model

    plain, plain_layers = work.build, work.layers
    layers = None if plain_layers is None else lambda n: set_up(plain_layers(n))
    return replace(work, build=lambda: set_up(plain()), layers=layers)


def loss_fn(work: Workload) -> Callable[[nn.Module, int], torch.Tensor]:
    def loss(model: nn.Module, step: int) -> torch.Tensor:
        tokens = torch.randint(0, work.vocab_size, work.batch)
        if isinstance(model.module, GPT):
            return model(tokens, tokens)[1]
        out = model(tokens)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if out.dim() == 0:  # the model's own loss
            return out
        return F.cross_entropy(out.float().flatten(0, -2), tokens.flatten())

    return loss


def fsdp_kwargs(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        auto_wrap_policy=ModuleWrapPolicy({work.unit}), sharding_strategy=ShardingStrategy[args.sharding_strategy]
    )
    low = PRECISIONS[args.mixed_precision]
    if low is not None:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=low, reduce_dtype=torch.float32, buffer_dtype=low)
    if args.offload:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    if uses_orig_params(args):
        kwargs["use_orig_params"] = True
    return kwargs


def uses_orig_params(args: argparse.Namespace) -> bool:
    """Asked for, or implied: (Q)LoRA puts frozen and trainable parameters of one dtype in one unit."""
    return bool(args.use_orig_params or args.qlora or args.lora)


def meta_model(work: Workload) -> nn.Module:
    """The model on the meta device (no memory): for the wrap plan, and to compare its layers."""
    with torch.device("meta"):
        return work.build()


def wrap_plan(work: Workload, model: nn.Module | None = None) -> dict[str, Any]:
    """Units and their parameter counts, from a meta-device model (no memory)."""
    model = model if model is not None else meta_model(work)
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, work.unit)]
    inside = {id(p) for _, m in units for p in m.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in inside)
    sizes = [(name, sum(p.numel() for p in m.parameters())) for name, m in units]
    largest = max(sizes, key=lambda s: s[1], default=("(root)", root))
    return {
        "unit_class": work.unit.__name__,
        "units": dict(sizes),
        "root_parameters": root,
        "parameters": root + sum(count for _, count in sizes),
        "largest_unit": {"name": largest[0], "parameters": largest[1]},
    }


def plan_text(plan: dict[str, Any]) -> str:
    sizes = plan["units"]
    lines = [
        f"Wrap plan: {len(sizes)} {plan['unit_class']} units + the root; {plan['parameters']:,} parameters",
        f"  root (outside units): {plan['root_parameters']:,}",
        f"  largest unit: {plan['largest_unit']['name']} with {plan['largest_unit']['parameters']:,}",
    ]
    if sizes:
        counts = list(sizes.values())
        lines.append(
            f"  per unit: {counts[0]:,}"
            if len(set(counts)) == 1
            else "  units: " + ", ".join(f"{n}={c:,}" for n, c in sizes.items())
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


# What CPUOffload(offload_params=True) keeps in CPU memory: the parameter shards, their gradients, the optimizer state.
OFFLOADED = (Category.SHARDED_PARAM, Category.SHARDED_GRAD, Category.OPTIMIZER_STATE)


def offload_split(profile: MemoryProfile) -> tuple[int, int]:
    """(device peak, CPU bytes) with the parameters offloaded: at each phase's peak, the offloaded categories are on
    the CPU and the rest on the device (the estimate runs on one device; a CPU-side shard's transient copy to the
    device before its all-gather is not counted)."""
    device, host = 0, 0
    for phase in profile.peaks:
        split = profile.split(phase)
        offloaded = sum(split.get(category, 0) for category in OFFLOADED)
        device, host = max(device, profile.peak(phase) - offloaded), max(host, offloaded)
    return device, host


def offload_report(profiles: dict[int, MemoryProfile]) -> str:
    unit, div = unit_for(max(p.peak() for p in profiles.values()))
    rows = []
    for ws, profile in profiles.items():
        device, host = offload_split(profile)
        rows.append([ws, f"{device / div:,.2f}", f"{host / div:,.2f}"])
    headers = ["world size", "device peak", "CPU memory (offloaded shards, gradients, optimizer state)"]
    return f"With CPU offload, per rank ({unit})\n\n" + markdown(headers, rows)


def plot(profiles: dict[int, MemoryProfile], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def run(args: argparse.Namespace) -> int:
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before minutes of estimating, not after)
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install matplotlib (or 'fsdp_legacy[plot]').") from None
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: estimate at least one step (2 include the optimizer state).")
    if args.lora_rank < 1:
        raise UsageError(f"--lora-rank {args.lora_rank}: the adapters need a rank of at least 1.")
    if args.lora and args.qlora:
        raise UsageError("--lora and --qlora: choose one (--qlora is LoRA on 4-bit base weights).")
    work = with_training_setup(args, workload(args))
    meta = meta_model(work)
    plan = wrap_plan(work, meta)
    extras = [
        name
        for name, on in (
            ("CPU offload", args.offload),
            (f"QLoRA (rank {args.lora_rank})", args.qlora),
            (f"LoRA (rank {args.lora_rank}, the model frozen)", args.lora),
            ("activation checkpointing", args.activation_checkpointing),
            ("use_orig_params", uses_orig_params(args)),
        )
        if on
    ]
    hybrid = args.sharding_strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
    setup = ", ".join(
        [
            args.sharding_strategy + (f" (shard groups of {args.shard_group_size})" if hybrid else ""),
            args.mixed_precision,
            *extras,
            args.optimizer,
            f"batch {work.batch[0]}x{work.batch[1]}",
        ]
    )
    profiles: dict[int, MemoryProfile] = {}
    seconds: dict[int, float] = {}
    for ws in progress(args.world_sizes, len(args.world_sizes), "estimating", args.quiet):
        start = time.perf_counter()
        with warnings.catch_warnings():  # e.g. FSDP's "switching to NO_SHARD" at world size 1
            warnings.simplefilter("ignore")
            profiles[ws] = estimate(args, work, ws, meta)
        seconds[ws] = time.perf_counter() - start
    if args.json:
        print(json.dumps(_as_json(args, work, plan, profiles, seconds), indent=2))
        return EXIT_OK
    print(plan_text(plan), end="\n\n")
    print(setup, end="\n\n")
    if args.details:
        for ws, profile in profiles.items():
            print(f"world size {ws}\n\n{profile.table()}\n")
    print(report(profiles, seconds))
    if any(p.method != "traced" for p in profiles.values()):
        print("\nHow: " + "; ".join(f"world size {ws}: {p.method}" for ws, p in profiles.items()))
    if args.offload:
        print("\n" + offload_report(profiles))
    if args.plot:
        plot(profiles, Path(args.plot), f"{work.name}: {setup}")
        print(f"\nwrote {args.plot}")
    return EXIT_OK


def estimate(args: argparse.Namespace, work: Workload, world_size: int, meta: nn.Module | None = None) -> MemoryProfile:
    """The estimate at `world_size`: a built-in model with more layers than the samples together is traced at 3, 4
    and 5 layers and extrapolated, exactly (fsdp_legacy/memory/repeated.py), unless --full-trace. `meta`: the
    model on the meta device, if at hand."""
    common: dict[str, Any] = dict(
        loss_fn=loss_fn(work),
        world_size=world_size,
        fsdp_kwargs=fsdp_kwargs(args, work),
        optimizer_fn=OPTIMIZERS[args.optimizer],
        steps=args.steps,
        hybrid_shape=hybrid_shape(args, world_size),
    )
    if work.layers is not None and not args.full_trace and work.num_layers > sum(SAMPLES):
        return estimate_memory_repeated(work.layers, work.num_layers, work.unit, **common, full_model=meta)
    return estimate_memory(work.build, **common)


def _as_json(
    args: argparse.Namespace,
    work: Workload,
    plan: dict[str, Any],
    profiles: dict[int, MemoryProfile],
    seconds: dict[int, float],
) -> dict[str, Any]:
    return {
        "model": work.name,
        "setup": {
            "qlora": args.qlora,
            "lora": args.lora,
            "lora_rank": args.lora_rank if args.qlora or args.lora else None,
            "activation_checkpointing": args.activation_checkpointing,
            "use_orig_params": uses_orig_params(args),
            "sharding_strategy": args.sharding_strategy,
            "mixed_precision": args.mixed_precision,
            "offload": args.offload,
            "optimizer": args.optimizer,
            "batch": list(work.batch),
            "steps": args.steps,
        },
        "wrap_plan": plan,
        "estimates": [
            {
                "world_size": ws,
                "peak_bytes": {**{ph.value: profile.peak(ph) for ph in PHASES}, "peak": profile.peak()},
                **(
                    dict(zip(("offload_device_peak_bytes", "offload_cpu_bytes"), offload_split(profile), strict=True))
                    if args.offload
                    else {}
                ),
                "seconds": round(seconds[ws], 3),
                "method": profile.method,
            }
            for ws, profile in profiles.items()
        ],
    }
