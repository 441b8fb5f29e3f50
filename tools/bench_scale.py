"""FSDP at the sizes it exists for: one rank of a world of W ranks, ours vs torch's FSDP1 vs FSDP2, real model shapes.

    python3 tools/bench_scale.py --preset llama-1b --layers 4 --batch 1x256 --world-size 8 --device cpu
    python3 tools/bench_scale.py --preset llama-1b --layers 4 --world-size 64 --bf16 --activation-checkpointing
    python3 tools/bench_scale.py --preset llama-8b --batch 1x4096 --world-size 8 --bf16 \\
        --activation-checkpointing --device cuda --json scale.json --out docs/scale.md --plot docs/scale.png

Each implementation runs in its own process (tools/scale_rig.py) as rank --rank of --world-size ranks on torch's
fake process group: real tensors on --device, the rank's own share of the parameters, gradients and optimizer state,
its own compute, and collectives that move no data (they fill their outputs locally, a copy per collective: the
step times below count compute and bookkeeping, no communication). The model is a Llama-style decoder with the
published shapes of --preset (hidden size, intermediate size, layers, heads, kv heads, vocabulary), built on the meta
device and materialised unit by unit as users do at these sizes, one FSDP unit per decoder layer, AdamW. `--lora R`
fine-tunes it as LoRA recipes do: every parameter frozen, rank-R adapters on each decoder linear layer in the same
unit (fsdp_legacy/cli/lora.py), AdamW over the adapters.

Per implementation: the peak of live tensor memory (CUDA: max_memory_allocated, also max_memory_reserved and the
allocator's retries; CPU: every live tensor storage counted by fsdp_legacy.memory.MemoryTracker, and the process's
peak resident set as "reserved"), the median warm step time, tokens/s and, on CUDA, the model-FLOPs utilisation; for
ours also the estimator's prediction of the same configuration (fsdp-legacy mem-report's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import fsdp_legacy from the checkout
from fsdp_legacy.cli.llama import PRESETS
from scale_rig import IMPLS, RigConfig

RIG = Path(__file__).with_name("scale_rig.py")
# Dense bf16 peak of the GPUs the benchmark has run on, for the model-FLOPs utilisation.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-1b", choices=list(PRESETS))
    p.add_argument("--layers", type=int, help="run the first N decoder layers only (default: all)")
    p.add_argument("--batch", default="1x256", help="BATCHxSEQ per rank (default 1x256)")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=0, help="which rank this process plays (default 0)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS)}")
    p.add_argument("--sharding-strategy", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"])
    p.add_argument("--shard-group-size", type=int, default=8, help="HYBRID_SHARD: ranks per shard group (default 8)")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (parameters, reduction, buffers)")
    p.add_argument("--activation-checkpointing", action="store_true", help="over each decoder layer")
    p.add_argument("--cpu-offload", action="store_true", help="parameters and gradients kept on the CPU")
    p.add_argument("--use-orig-params", action="store_true")
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="LoRA fine-tuning: the model frozen, adapters of this rank on every decoder linear layer (implies "
        "--use-orig-params: FSDP1 holds frozen and trainable parameters in one flat parameter only with it)",
    )
    p.add_argument(
        "--checkpoint",
        choices=["full", "sharded"],
        help="after training, take the model's and the optimizer's state dicts as frameworks do (full: rank 0 keeps "
        "them, offloaded to the CPU from a GPU; sharded: every rank its shards) and report that moment's peak",
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps after two untimed ones (default 3)")
    p.add_argument("--no-estimate", action="store_true", help="skip the estimator's prediction")
    p.add_argument("--json", type=Path, help="write the rows as JSON")
    p.add_argument("--out", type=Path, help="append the table to this markdown file")
    p.add_argument("--plot", type=Path, help="draw peak memory and step time per implementation (needs matplotlib)")
    args = p.parse_args(argv)
    try:
        b, s = (int(part) for part in args.batch.lower().split("x"))
    except ValueError:
        p.error(f"--batch {args.batch!r} is not BATCHxSEQ, e.g. 1x256")
    args.batch = (b, s)
    args.impls = [impl.strip() for impl in args.impls.split(",") if impl.strip()]
    unknown = set(args.impls) - set(IMPLS)
    if unknown:
        p.error(f"--impls: unknown {sorted(unknown)}; choose from {', '.join(IMPLS)}")
    try:
        PRESETS[args.preset].with_layers(args.layers)
    except ValueError as error:
        p.error(str(error))
    if args.lora < 0:
        p.error(f"--lora {args.lora}: expected a rank of 1 or more (0: no LoRA)")
    args.use_orig_params = args.use_orig_params or args.lora > 0
    torch_offloaders = [impl for impl in args.impls if impl in ("torch_fsdp1", "fsdp2")]
    if args.cpu_offload and args.device == "cpu" and torch_offloaders:
        p.error(
            f"--cpu-offload on --device cpu: {' and '.join(torch_offloaders)} cannot offload parameters when computing "
            "on the CPU (torch raises 'Cannot access accelerator device when none is available'); use --impls ours "
            "or --device cuda"
        )
    if args.checkpoint and (args.use_orig_params or args.rank != 0):
        p.error(
            f"--checkpoint with {'use_orig_params' if args.use_orig_params else f'--rank {args.rank}'}: the fake "
            "process group's object collectives carry only this rank's objects, so a rank would miss the states of "
            "parameters it holds no element of (use_orig_params), and only rank 0 sends what rank0_only saves; "
            "run --checkpoint on rank 0 with flat parameters"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return args


def config(args: argparse.Namespace, impl: str) -> RigConfig:
    return RigConfig(
        impl=impl,
        preset=args.preset,
        layers=args.layers,
        world_size=args.world_size,
        rank=args.rank,
        device=args.device,
        batch=args.batch,
        sharding=args.sharding_strategy,
        shard_group_size=args.shard_group_size,
        bf16=args.bf16,
        activation_checkpointing=args.activation_checkpointing,
        cpu_offload=args.cpu_offload,
        use_orig_params=args.use_orig_params,
        steps=args.steps,
        lora_rank=args.lora,
        checkpoint=args.checkpoint or "",
    )


def run_rig(cfg: RigConfig) -> dict[str, Any]:
    """One implementation in a new process: nothing of one run (allocator caches, compiled kernels) helps another."""
    with tempfile.TemporaryDirectory() as tmp:
        config_path, result_path = Path(tmp, "config.json"), Path(tmp, "result.json")
        config_path.write_text(json.dumps(asdict(cfg)))
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        done = subprocess.run([sys.executable, str(RIG), str(config_path), str(result_path)], env=env)
        if done.returncode != 0 or not result_path.exists():
            raise SystemExit(f"bench_scale: {cfg.impl} failed (exit code {done.returncode}); its output is above")
        return json.loads(result_path.read_text())


def model_flops_per_token(args: argparse.Namespace) -> float:
    """Training FLOPs per token: 6 per parameter met by a token (LoRA: 4, forward and the input's gradient, as the
    frozen weights get none; the adapters are a rounding error), plus attention's scores and weighted sum."""
    cfg = PRESETS[args.preset].with_layers(args.layers)
    seq = args.batch[1]
    embedding = cfg.vocab_size * cfg.hidden_size  # a lookup, not a matmul
    matmul_params = cfg.num_parameters() - embedding * (0 if cfg.tie_embeddings else 1)
    attention = 6 * cfg.num_layers * cfg.hidden_size * seq  # 12 * layers * hidden * seq / 2 (causal)
    return (4.0 if args.lora else 6.0) * matmul_params + attention


def peak_tflops() -> float | None:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((tflops for key, tflops in PEAK_TFLOPS.items() if key in name), None)


def rows_for(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = PRESETS[args.preset]
    layers = args.layers or cfg.num_layers
    tokens = args.batch[0] * args.batch[1]
    estimate = None
    if "ours" in args.impls and not args.no_estimate:
        estimate = run_rig(config(args, "estimate"))["estimate_bytes"]
    rows = []
    for impl in args.impls:
        result = run_rig(config(args, impl))
        step_s = result["step_s"]
        row: dict[str, Any] = {
            "impl": impl,
            "preset": args.preset,
            "layers": layers,
            "of_layers": cfg.num_layers,
            "world_size": args.world_size,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "batch": list(args.batch),
            "lora_rank": args.lora,
            "options": options_text(args),
            "peak_allocated_bytes": result["peak_allocated_bytes"],
            "peak_reserved_bytes": result["peak_reserved_bytes"],
            "alloc_retries": result["alloc_retries"],
            "estimate_bytes": estimate if impl == "ours" else None,
            "step_s": step_s,
            "tokens_per_s": tokens / step_s if step_s else None,
            "loss": result["loss"],
        }
        if args.checkpoint:
            row.update(
                checkpoint=args.checkpoint,
                save_peak_bytes=result["save_peak_bytes"],
                save_held_bytes=result["save_held_bytes"],
            )
        tflops = peak_tflops() if args.device == "cuda" else None
        if tflops and step_s:
            row["mfu"] = model_flops_per_token(args) * tokens / step_s / (tflops * 1e12)
        rows.append(row)
    return rows


def options_text(args: argparse.Namespace) -> str:
    parts = [args.sharding_strategy]
    if args.sharding_strategy == "HYBRID_SHARD":
        parts.append(f"shard groups of {min(args.shard_group_size, args.world_size)}")
    parts += [
        name
        for name, on in (
            ("bf16", args.bf16),
            ("activation checkpointing", args.activation_checkpointing),
            ("CPU offload", args.cpu_offload),
            ("use_orig_params", args.use_orig_params),
            (f"LoRA rank {args.lora} (the model frozen)", args.lora),
        )
        if on
    ]
    return ", ".join(parts + ["AdamW"])


def gib(nbytes: float | None) -> str:
    return "" if nbytes is None else f"{nbytes / 2**30:.3f}"


def table(rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    scope = (
        f"{first['preset']}, {first['layers']} of {first['of_layers']} decoder layers"
        if first["layers"] != first["of_layers"]
        else f"{first['preset']}, all {first['layers']} decoder layers"
    )
    torch1 = next((r for r in rows if r["impl"] == "torch_fsdp1"), None)
    lines = [
        f"**{scope}**, rank 0 of {first['world_size']}, batch {first['batch'][0]}x{first['batch'][1]}, "
        f"{first['options']}, {first['device']}, torch {torch.__version__}",
        "",
        "| impl | peak allocated GiB | vs torch FSDP1 | peak reserved GiB | retries | estimate GiB | estimate error "
        "| step s | vs torch FSDP1 | tokens/s | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem_ratio = f"{r['peak_allocated_bytes'] / torch1['peak_allocated_bytes']:.3f}x" if torch1 else ""
        step_ratio = f"{r['step_s'] / torch1['step_s']:.2f}x" if torch1 and torch1["step_s"] else ""
        error = ""
        if r["estimate_bytes"]:
            error = f"{(r['estimate_bytes'] - r['peak_allocated_bytes']) / r['peak_allocated_bytes']:+.1%}"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else ""
        lines.append(
            f"| {r['impl']} | {gib(r['peak_allocated_bytes'])} | {mem_ratio} | {gib(r['peak_reserved_bytes'])} "
            f"| {r['alloc_retries']} | {gib(r['estimate_bytes'])} | {error} | {r['step_s']:.3f} | {step_ratio} "
            f"| {r['tokens_per_s'] or 0:.0f} | {mfu} |"
        )
    if "checkpoint" in first:
        lines += [
            "",
            f"Taking a {first['checkpoint'].upper()} checkpoint after training (the model's and the optimizer's state "
            "dicts):",
            "",
            "| impl | peak while saving GiB | vs torch FSDP1 | the state dicts GiB |",
            "|---|---|---|---|",
        ]
        for r in rows:
            ratio = f"{r['save_peak_bytes'] / torch1['save_peak_bytes']:.3f}x" if torch1 else ""
            lines.append(f"| {r['impl']} | {gib(r['save_peak_bytes'])} | {ratio} | {gib(r['save_held_bytes'])} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, time_ax) = plt.subplots(1, 2, figsize=(9, 3.2))
    names = [r["impl"] for r in rows]
    mem.bar(names, [r["peak_allocated_bytes"] / 2**30 for r in rows], color="tab:blue", label="measured")
    estimate = next((r["estimate_bytes"] for r in rows if r["estimate_bytes"]), None)
    if estimate:
        mem.axhline(estimate / 2**30, color="tab:red", linestyle="--", label="ours, estimated")
    mem.set_ylabel("peak allocated (GiB)")
    mem.legend(loc="lower right")
    time_ax.bar(names, [r["step_s"] for r in rows], color="tab:green")
    time_ax.set_ylabel("median step (s)")
    first = rows[0]
    fig.suptitle(f"{first['preset']} ({first['layers']} layers), rank 0 of {first['world_size']}: {first['options']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = PRESETS[args.preset]
    if args.layers and args.layers < cfg.num_layers:
        print(
            f"bench_scale: the first {args.layers} of {args.preset}'s {cfg.num_layers} decoder layers (--layers); "
            "figures are for that model, not scaled to the whole one"
        )
    rows = rows_for(args)
    text = table(rows)
    print(text)
    print("(step times: compute and bookkeeping only; the fake process group's collectives move no data)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    if args.out:
        with args.out.open("a") as out:
            out.write("\n" + text + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
