"""Saves during training: how long a save holds training up, synchronous against in the background.

    python3 tools/bench_async_save.py [--layers 8 --width 2048 --rows 64] [--out docs/benchmarks.md] [--json F]
    (also: python3 tools/bench_checkpoint.py --during-training ...)

Spawns 2 gloo ranks on the CPU per implementation (one thread each), trains `layers` blocks of Linear(width, width)
(one FSDP unit per block) with Adam on `rows` x width inputs, and on the same run:

* ours, full weights: save_full_model (safetensors, streamed to rank 0) against save_full_model_async;
* ours, DCP: dcp_checkpoint.save of the SHARDED, then the LOCAL, model and optimizer state against
  dcp_checkpoint.async_save of the state dict built in the call, and (SHARDED) against
  dcp_checkpoint.async_save_sharded(model, optim), which builds it in the background;
* torch's FSDP1, DCP: dcp.save of its SHARDED, then LOCAL, state against dcp.async_save on a gloo group of its own
  (what torch recommends for async saves).

A SHARDED state dict is made by all-gathering each unit and cutting every parameter (and its optimizer state) into
dim-0 chunks (and FSDP1's optimizer state dicts do so under LOCAL too), in the call, unless async_save_sharded
copies the shards and builds it in the background.

Per save, after one unmeasured asynchronous save (ours makes its save group then): the synchronous save's
time (state dict included), the asynchronous call's stall (state dict included: what
training waits for), its time to complete, the median training step while it runs (steps go on until every
rank's save is complete) against the median step without a save, and the bytes of the copy ours holds meanwhile
(AsyncSave.host_bytes; DCP's staging copy for DCP). The targets (issue 32): step during a save <= 1.2x,
stall <= 0.1x the synchronous save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp_legacy from the checkout
from checkpoint_bench_model import Block, build, free_port
from process_exit import exit_now

MARK_BEGIN, MARK_END = "<!-- bench_async_save:begin -->", "<!-- bench_async_save:end -->"
FORMATS = {"ours": ("full", "sharded", "sharded_model", "local"), "torch": ("sharded", "local")}
NAMES = {
    "full": "full safetensors",
    "sharded": "DCP SHARDED, state dict built in the call",
    "sharded_model": "DCP SHARDED, async_save_sharded",
    "local": "DCP LOCAL",
}


class _Pending:
    """A torch Future with the AsyncSave interface the loop uses."""

    def __init__(self, future: Any) -> None:
        self.future = getattr(future, "upload_completion", future)

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> Any:
        return self.future.result()


def worker(rank: int, impl: str, port: int, workdir: str, args: dict, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    warnings.simplefilter("ignore")
    import torch.distributed.checkpoint as dcp
    import torch.distributed.fsdp as tfsdp

    import fsdp_legacy
    from fsdp_legacy import dcp_checkpoint
    from fsdp_legacy.checkpoint import save_full_model, save_full_model_async

    lib: Any = tfsdp if impl == "torch" else fsdp_legacy
    extra = {"device_id": torch.device("cpu")} if impl == "torch" else {}
    torch.manual_seed(0)
    model = lib.FullyShardedDataParallel(
        build(args["layers"], args["width"]), auto_wrap_policy=lib.wrap.ModuleWrapPolicy({Block}), **extra
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    torch.manual_seed(rank)
    x = torch.randn(args["rows"], args["width"])
    side = dist.new_group(backend="gloo") if impl == "torch" else None

    def step() -> float:
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    def state(fmt: str) -> dict:
        fsdp, kind = lib.FullyShardedDataParallel, lib.StateDictType[f"{fmt.split('_')[0].upper()}_STATE_DICT"]
        with fsdp.state_dict_type(model, kind):
            return {"model": model.state_dict(), "optim": fsdp.optim_state_dict(model, opt)}

    def save(fmt: str, path: str) -> None:
        if fmt == "full":
            save_full_model(model, path)
        elif impl == "ours":
            dcp_checkpoint.save(state(fmt), path)
        else:
            dcp.save(state(fmt), storage_writer=dcp.FileSystemWriter(path))

    def save_async(fmt: str, path: str) -> Any:
        if fmt == "full":
            return save_full_model_async(model, path)
        if fmt == "sharded_model":
            return dcp_checkpoint.async_save_sharded(model, opt, path)
        if impl == "ours":
            return dcp_checkpoint.async_save(state(fmt), path)
        return _Pending(dcp.async_save(state(fmt), storage_writer=dcp.FileSystemWriter(path), process_group=side))

    for _ in range(2):
        step()
    base = [step() for _ in range(args["steps"])]
    results: dict[str, Any] = {"step": statistics.median(base)}
    for fmt in FORMATS[impl]:
        dist.barrier()
        start = time.perf_counter()
        save(fmt, os.path.join(workdir, f"{impl}_{fmt}_sync"))
        dist.barrier()
        sync_s = time.perf_counter() - start
        save_async(fmt, os.path.join(workdir, f"{impl}_{fmt}_warmup")).wait()  # (makes ours' save group once)
        step()
        dist.barrier()
        start = time.perf_counter()
        pending = save_async(fmt, os.path.join(workdir, f"{impl}_{fmt}_async"))
        stall = time.perf_counter() - start
        during: list[float] = []
        while len(during) < 200:  # steps until every rank's save is complete
            during.append(step())
            running = torch.tensor([0 if pending.done() else 1])
            dist.all_reduce(running, op=dist.ReduceOp.MAX)
            if not running.item():
                break
        pending.wait()
        results[fmt] = {
            "sync_s": sync_s,
            "stall_s": stall,
            "async_s": time.perf_counter() - start,
            "steps_during": len(during),
            "step_during": statistics.median(during),
            "host_bytes": getattr(pending, "host_bytes", 0),
        }
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        queue.put(gathered)
        queue.close()
        queue.join_thread()  # (delivered before the exit below, which skips the queue's own flush)
    dist.barrier()
    dist.destroy_process_group()
    exit_now()


def run(impl: str, workdir: str, args: dict) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, impl, port, workdir, args, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=1800)
    for proc in procs:
        proc.join(60)
        if proc.exitcode not in (0, None):
            raise SystemExit(f"{impl}: a rank exited with {proc.exitcode}")
    return result


def summary(results: dict[str, list[dict]]) -> list[dict]:
    """One row per implementation and format, the slowest rank's figures."""
    rows = []
    for impl, ranks in results.items():
        step = max(r["step"] for r in ranks)
        for fmt in FORMATS[impl]:
            worst = {key: max(r[fmt][key] for r in ranks) for key in ranks[0][fmt]}
            rows.append(
                {
                    "save": f"{'ours' if impl == 'ours' else 'torch FSDP1'}, {NAMES[fmt]}",
                    "step_s": step,
                    **worst,
                    "step_ratio": worst["step_during"] / step,
                    "stall_ratio": worst["stall_s"] / worst["sync_s"],
                }
            )
    return rows


def table(rows: list[dict], args: dict) -> str:
    params = args["layers"] * (args["width"] ** 2 + args["width"])
    lines = [
        f"{args['layers']} x Linear({args['width']}, {args['width']}) ({params / 1e6:.1f} M parameters, Adam), 2 gloo "
        f"ranks, 1 thread each, batch {args['rows']} rows; the slowest rank's figures.",
        "",
        "| save | synchronous save | async call's stall | stall / sync | async to complete | step without | "
        "step during (median, n) | during / without | copy held |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        held = f"{r['host_bytes'] / 2**20:.0f} MiB" if r["host_bytes"] else "n/a"
        lines.append(
            f"| {r['save']} | {r['sync_s']:.3f} s | {r['stall_s']:.3f} s | {r['stall_ratio']:.3f}x | "
            f"{r['async_s']:.3f} s | {r['step_s']:.3f} s | {r['step_during']:.3f} s ({r['steps_during']}) | "
            f"{r['step_ratio']:.2f}x | {held} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed steps without a save")
    parser.add_argument("--impl", choices=["both", "ours", "torch"], default="both")
    parser.add_argument("--out", help="markdown file whose bench_async_save markers get the table")
    parser.add_argument("--json", help="write the raw results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    settings = {k: getattr(args, k) for k in ("layers", "width", "rows", "steps")}
    workdir = tempfile.mkdtemp(prefix="bench_async_save_")
    impls = ("torch", "ours") if args.impl == "both" else (args.impl,)
    try:
        results = {impl: run(impl, workdir, settings) for impl in impls}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = summary(results)
    text = table(rows, settings)
    print(text)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"settings": settings, "rows": rows, "ranks": results}, file, indent=1)
    if args.out:
        with open(args.out) as file:
            doc = file.read()
        start, end = doc.index(MARK_BEGIN) + len(MARK_BEGIN), doc.index(MARK_END)
        with open(args.out, "w") as file:
            file.write(doc[:start] + "\n" + text + "\n" + doc[end:])


if __name__ == "__main__":
    main()
