"""Full checkpoint save and load: torch FSDP1's way against fsdp_legacy's streamed save_full_model / load_full_model.

    python3 tools/bench_checkpoint.py [--layers 16 --width 4096] [--out docs/benchmarks.md] [--plot PNG]
    python3 tools/bench_checkpoint.py --during-training [bench_async_save.py's options]

`--during-training` times saves while training runs instead, synchronous against in the background
(tools/bench_async_save.py, whose options follow it).

Spawns 2 gloo ranks on the CPU per implementation (torch first, then ours, each in fresh processes). The model is
`layers` blocks of Linear(width, width) (16 x 4096: 268 M parameters, 1.07 GB of fp32), one FSDP unit per block.

* save, torch: FULL_STATE_DICT with FullStateDictConfig(offload_to_cpu=False, rank0_only=True) (offload_to_cpu on a
  CPU compute device frees storage still in use, a torch bug; without it nothing moves on CPU anyway), then
  torch.save on rank 0. ours: save_full_model(model, directory) (one model.safetensors).
* load (timed from a wrapped model, built on meta and materialised by FSDP, to the weights loaded): torch: rank 0
  torch.load, broadcast tensor by tensor to the other ranks (as torch's broadcast_from_rank0 helpers do:
  FULL_STATE_DICT needs the full tensors on every rank), load_state_dict under FULL_STATE_DICT. (FSDP1's other rank-0
  route, sync_module_states=True, refuses CPU modules.) ours: load_full_model(model, directory).

Per rank and phase: wall time (slowest rank), the RSS high-water mark above the RSS at the start of the phase (VmHWM,
reset through /proc/self/clear_refs; includes file pages mapped in), the anonymous RSS peak above its start (RssAnon
sampled every 2 ms in a thread), and the peak of live tensor storages during the phase as fsdp_legacy's MemoryTracker
counts them, less the model's own local shards (which the tracker counts once an op touches them); storages that
torch.load or a reader creates outside torch's dispatcher are not seen. The files are read back warm (page cache).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoint_bench_model import Block, build, free_port
from process_exit import exit_now

MARK_BEGIN, MARK_END = "<!-- bench_checkpoint:begin -->", "<!-- bench_checkpoint:end -->"


def _status(field: str) -> int:
    with open("/proc/self/status") as file:
        match = re.search(rf"^{field}:\s+(\d+) kB", file.read(), re.M)
    return int(match.group(1)) * 1024 if match else 0


class Probe:
    """RSS high-water (VmHWM, reset at start) and sampled RssAnon peak over a phase, plus tracked tensor bytes."""

    def __enter__(self) -> Probe:
        from fsdp_legacy.memory import MemoryTracker

        gc.collect()
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")  # resets VmHWM to the current RSS
        self.rss0, self.anon0 = _status("VmRSS"), _status("RssAnon")
        self.anon_peak, self._stop = self.anon0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.tracker = MemoryTracker()
        self.tracker.__enter__()
        self.t0 = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.anon_peak = max(self.anon_peak, _status("RssAnon"))

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.tracker.__exit__(*exc)
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, _status("RssAnon"))
        self.result = {
            "seconds": self.seconds,
            "rss_hwm": _status("VmHWM") - self.rss0,
            "anon_peak": self.anon_peak - self.anon0,
            "tracked": self.tracker.peak(),
        }


def worker(rank: int, impl: str, port: int, workdir: str, layers: int, width: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import warnings

    warnings.simplefilter("ignore")
    import torch.distributed.fsdp as tfsdp

    import fsdp_legacy
    from fsdp_legacy.checkpoint import load_full_model, save_full_model

    lib: Any = tfsdp if impl == "torch" else fsdp_legacy
    extra = {"device_id": torch.device("cpu")} if impl == "torch" else {}
    policy = lib.wrap.ModuleWrapPolicy({Block})
    torch.manual_seed(0)
    model = lib.FullyShardedDataParallel(build(layers, width), auto_wrap_policy=policy, **extra)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    path = os.path.join(workdir, "torch_full.pt" if impl == "torch" else "ours_hf")
    results: dict[str, Any] = {}

    dist.barrier()
    with Probe() as probe:
        if impl == "torch":
            config = tfsdp.FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
            with tfsdp.FullyShardedDataParallel.state_dict_type(model, tfsdp.StateDictType.FULL_STATE_DICT, config):
                state = model.state_dict()
            if rank == 0:
                torch.save(state, path)
            del state
        else:
            save_full_model(model, path)
        dist.barrier()
    results["save"] = probe.result
    del model
    gc.collect()

    with torch.device("meta"):
        plain = build(layers, width)
    model = lib.FullyShardedDataParallel(plain, auto_wrap_policy=policy, **extra)  # to_empty + reset_parameters
    dist.barrier()
    with Probe() as probe:
        if impl == "torch":
            state = _broadcast_from_rank0(torch.load(path, map_location="cpu", weights_only=True) if rank == 0 else {})
            with tfsdp.FullyShardedDataParallel.state_dict_type(model, tfsdp.StateDictType.FULL_STATE_DICT):
                model.load_state_dict(state)
            del state
        else:
            load_full_model(model, path)
        dist.barrier()
    results["load"] = probe.result
    loaded = sum(float(p.detach().double().sum()) for p in model.parameters())
    results["load"]["correct"] = loaded == checksum
    results["shard_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        queue.put(gathered)
        queue.close()
        queue.join_thread()  # (delivered before the exit below, which skips the queue's own flush)
    dist.barrier()
    dist.destroy_process_group()
    exit_now()


def _broadcast_from_rank0(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank 0's state dict on every rank, one tensor at a time (what torch's broadcast_from_rank0 helpers do)."""
    meta = [[(k, v.shape, v.dtype) for k, v in state.items()]]
    dist.broadcast_object_list(meta, src=0)
    out = {}
    for key, shape, dtype in meta[0]:
        tensor = state[key] if dist.get_rank() == 0 else torch.empty(shape, dtype=dtype)
        dist.broadcast(tensor, src=0)
        out[key] = tensor
    return out


def run(impl: str, workdir: str, layers: int, width: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, impl, port, workdir, layers, width, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=900)
    for proc in procs:
        proc.join(60)
        if proc.exitcode not in (0, None):
            raise SystemExit(f"{impl}: a rank exited with {proc.exitcode}")
    return result


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f}"


def table(results: dict[str, list[dict]], layers: int, width: int) -> str:
    numel = layers * (width * width + width)
    lines = [
        f"torch {torch.__version__}, 2 ranks, CPU, gloo, 2 cores; model: {layers} x Linear({width}, {width}), "
        f"{numel / 1e6:.0f} M parameters, {numel * 4 / 1e9:.2f} GB fp32, one FSDP unit per block. Memory in MiB "
        "above the start of the phase. torch save: FULL_STATE_DICT with FullStateDictConfig(offload_to_cpu=False, "
        "rank0_only=True) (no CPU patch) + torch.save on rank 0; torch load: model wrapped from meta, rank 0 "
        "torch.load, broadcast tensor by tensor, load_state_dict under FULL_STATE_DICT. Ours: save_full_model / "
        "load_full_model (one model.safetensors). Tracked: MemoryTracker's peak less the model's own shards.",
        "",
        "| phase | impl | wall s | rank 0 RSS HWM | rank 0 anon peak | rank 0 tracked | rank 1 RSS HWM | "
        "rank 1 anon peak | rank 1 tracked | loaded correctly |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for phase in ("save", "load"):
        for impl in ("torch", "ours"):
            ranks = [r[phase] for r in results[impl]]
            seconds = max(r["seconds"] for r in ranks)
            cells = [f"{phase}", impl, f"{seconds:.2f}"]
            for r, shard in zip(ranks, [r["shard_bytes"] for r in results[impl]], strict=True):
                cells += [_mb(r["rss_hwm"]), _mb(r["anon_peak"]), _mb(max(0, r["tracked"] - shard))]
            cells.append(str(all(r.get("correct", True) for r in ranks)) if phase == "load" else "")
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| phase | ours / torch: wall time | rank 0 RSS HWM | rank 0 anon peak | rank 0 tracked |"]
    lines.append("| --- | ---: | ---: | ---: | ---: |")
    for phase in ("save", "load"):
        theirs, ours = results["torch"][0][phase], results["ours"][0][phase]
        t_theirs = max(r[phase]["seconds"] for r in results["torch"])
        t_ours = max(r[phase]["seconds"] for r in results["ours"])
        shard_ours, shard_theirs = results["ours"][0]["shard_bytes"], results["torch"][0]["shard_bytes"]
        extra_ours, extra_theirs = max(0, ours["tracked"] - shard_ours), max(1, theirs["tracked"] - shard_theirs)
        ratios = [t_ours / t_theirs] + [ours[k] / max(theirs[k], 1) for k in ("rss_hwm", "anon_peak")]
        ratios.append(extra_ours / extra_theirs)
        lines.append(f"| {phase} | " + " | ".join(f"{x:.2f}x" for x in ratios) + " |")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    phases, impls = ("save", "load"), ("torch", "ours")
    for axis, (label, key, scale) in zip(
        axes,
        [("wall time (s)", "seconds", 1.0), ("rank 0 RSS high-water above start (MiB)", "rss_hwm", 2**20)],
        strict=True,
    ):
        for i, impl in enumerate(impls):
            values = [
                max(r[p][key] for r in results[impl]) / scale if key == "seconds" else results[impl][0][p][key] / scale
                for p in phases
            ]
            axis.bar([j + 0.38 * i for j in range(len(phases))], values, width=0.38, label=impl)
        axis.set_xticks([j + 0.19 for j in range(len(phases))], phases)
        axis.set_title(label)
        axis.legend()
    fig.suptitle("Full checkpoint, 2 CPU ranks, 1.07 GB fp32: torch FSDP1 vs fsdp_legacy (streamed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if "--during-training" in sys.argv[1:]:
        import bench_async_save

        bench_async_save.main([a for a in sys.argv[1:] if a != "--during-training"])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--out", help="markdown file whose bench_checkpoint markers get the table")
    parser.add_argument("--plot", help="PNG to draw (needs matplotlib)")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench_checkpoint_")
    try:
        results = {impl: run(impl, workdir, args.layers, args.width) for impl in ("torch", "ours")}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = table(results, args.layers, args.width)
    print(text)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)
    if args.out:
        with open(args.out) as file:
            doc = file.read()
        start, end = doc.index(MARK_BEGIN) + len(MARK_BEGIN), doc.index(MARK_END)
        with open(args.out, "w") as file:
            file.write(doc[:start] + "\n" + text + "\n" + doc[end:])
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
