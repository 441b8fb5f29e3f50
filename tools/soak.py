"""Soak test of checkpoint and resume: train under torchrun --max-restarts, SIGKILL a random rank at random moments,
resume each time from `fsdp_legacy.checkpoint.latest()`, and compare with an uninterrupted run bit for bit.

    python3 tools/soak.py --nproc 2 --kills 5                      # 4 ranks, then resumed at 2 through DCP halfway
    python3 tools/soak.py --nproc 2 --first-nproc 0 --kills 20     # 2 ranks throughout

The worker (tools/soak_worker.py) trains a small GPT with fsdp_legacy (AdamW, bf16 mixed precision, the data of a
step a function of the step and rank) and checkpoints every `--every` steps, in turn as SHARDED DCP, LOCAL DCP and
per-rank LOCAL torch.save files (each with the optimizer state), plus a full-model safetensors export replaced in
place (save_full_model: two renames). Kills land mid-step (after backward, before optimizer.step), mid-collective
(a unit's forward, the other ranks waiting in its all-gather), mid-save (after a rank's DCP data, or after dcp.save
before the side file, or with a rank file half written), mid-rename (between the export's two renames), mid-backward
(the later units' reduce-scatters issued, the others waiting in them) and mid-resume (inside latest()'s agreement, or
on entering the checkpoint's load).

This runs the same schedule twice, without kills (the reference) and with them, and holds when:
- the final parameters and optimizer state (FULL state dicts) are bit-identical to the reference's;
- every resume loaded exactly the reference's state at its step (a digest of every rank's flat shards and optimizer
  state, taken by the reference when it saved), so no restart loaded a damaged or mixed checkpoint;
- the final export equals the reference's and no temporary of a killed save is left beside it;
- no torchrun outlives its timeout (every collective of the worker has a bounded timeout too).
With --first-nproc (4 unless told), both runs change world size at the same step (a SHARDED DCP checkpoint written
by N ranks, loaded by --nproc ranks), so bit-identity still holds. The last line is
`soak: K kills, R restarts, S checkpoints skipped, final state identical: yes` (or `no`); the exit code is 0 only when
every check holds.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import fsdp_legacy from the checkout
from soak_worker import FINAL, FORMATS, Phase, read_events

WORKER = str(Path(__file__).resolve().parent / "soak_worker.py")


@dataclass(frozen=True)
class Launch:
    seconds: float
    returncode: int | None  # None: killed at the timeout
    log: str


@dataclass
class Outcome:
    """What one run (all its phases) did, from its events."""

    folder: str
    seconds: float = 0.0
    failed: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks (of the last phase, with --first-nproc)")
    p.add_argument(
        "--first-nproc",
        type=int,
        default=4,
        help="ranks of the first half, resumed at --nproc through SHARDED DCP halfway (0 or --nproc: one world size)",
    )
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a torchrun may take before it is killed")
    p.add_argument("--workdir", help="where the runs go (default: a temporary folder, removed when all holds)")
    p.add_argument("--keep", action="store_true", help="keep the run folders")
    args = p.parse_args(argv)
    if args.steps < 2 * args.every or args.every < 1:
        p.error("--steps must cover at least two checkpoints (--every)")
    return args


def phases(args: argparse.Namespace, kills: int) -> list[Phase]:
    """One phase, or two when the world size changes halfway (on a checkpoint step); kills split by steps."""
    if not args.first_nproc or args.first_nproc == args.nproc:
        return [Phase(0, args.nproc, 0, args.steps, kills, True)]
    middle = max(args.every, args.steps // 2 // args.every * args.every)
    first = kills * middle // args.steps
    return [
        Phase(0, args.first_nproc, 0, middle, first, False),
        Phase(1, args.nproc, middle, args.steps, kills - first, True),
    ]


def launch(folder: str, phase: Phase, args: argparse.Namespace) -> Launch:
    """torchrun with a restart for every kill (and one spare, so an unplanned failure shows as an extra restart
    rather than as a failed run), in its own process group, killed whole at the timeout."""
    log = os.path.join(folder, f"torchrun-{phase.index}.log")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={phase.world}"]
    command += [f"--max-restarts={phase.kills + 1}", WORKER, "--folder", folder, "--seed", str(args.seed)]
    command += ["--every", str(args.every), "--phase", str(phase.index), "--from-step", str(phase.start)]
    command += ["--to-step", str(phase.end), "--kills", str(phase.kills)] + (["--last"] if phase.last else [])
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # torchrun's c10d rendezvous shares one TCPStore across restarts without a per-attempt prefix: a restarted rank
    # can read the previous attempt's gloo addresses ("Gloo connectFullMesh failed ... Connection refused"), which
    # fails the attempt and spends a restart (pytorch/pytorch#135712). Rank 0 then hosts a new store each attempt.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    start = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code: int | None = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers: the session it leads
            process.wait()
            code = None
    return Launch(time.monotonic() - start, code, log)


def run(folder: str, schedule: list[Phase], args: argparse.Namespace) -> Outcome:
    os.makedirs(os.path.join(folder, "ckpt"))
    os.makedirs(os.path.join(folder, "exports"))
    outcome = Outcome(folder)
    for phase in schedule:
        done = launch(folder, phase, args)
        outcome.seconds += done.seconds
        if done.returncode != 0:
            with open(done.log) as file:
                tail = "".join(file.readlines()[-40:])
            how = f"timed out after {args.timeout:.0f} s" if done.returncode is None else f"exit {done.returncode}"
            outcome.failed = f"phase {phase.index} ({phase.world} ranks) {how}; the end of {done.log}:\n{tail}"
            break
    outcome.events = read_events(folder)
    return outcome


# --------------------------------------------------------------------------------------------------------------------
# Checks


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two nested states differ: tensors by dtype, shape and bits, everything else by ==."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for key in a for d in differences(a[key], b[key], f"{path}.{key}" if path else str(key))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if type(a) is type(b) and a == b else [path]


def final_differences(reference: Outcome, soaked: Outcome) -> list[str]:
    paths = [os.path.join(o.folder, FINAL) for o in (reference, soaked)]
    if not all(os.path.exists(p) for p in paths):
        return [f"missing {p}" for p in paths if not os.path.exists(p)]
    a, b = (torch.load(p, weights_only=True) for p in paths)
    return differences(a, b)


def export_report(reference: Outcome, soaked: Outcome) -> tuple[bool, list[str]]:
    """Whether the final exports hold the same tensors, and what is left beside the soaked one."""
    from safetensors.torch import load_file

    def tensors(outcome: Outcome) -> dict[str, torch.Tensor]:
        files = sorted(glob.glob(os.path.join(outcome.folder, "exports", "model", "*.safetensors")))
        return {k: v for f in files for k, v in load_file(f).items()}

    a, b = tensors(reference), tensors(soaked)
    left = sorted(set(os.listdir(os.path.join(soaked.folder, "exports"))) - {"model"})
    return bool(a) and not differences(a, b), left


def digests_by_state(reference: Outcome) -> dict[tuple[int, int], list[str]]:
    """The reference's digests of every rank's state, by (world size, steps done): as saved, and as loaded where it
    changed world size."""
    found = {(e["world"], e["step"]): e["digests"] for e in reference.of("saved")}
    found.update({(e["world"], e["step"]): e["digests"] for e in reference.of("start")})
    return found


def bad_resumes(reference: Outcome, soaked: Outcome) -> list[str]:
    expected = digests_by_state(reference)
    bad = []
    for start in soaked.of("start"):
        key = (start["world"], start["step"])
        if expected.get(key) != start["digests"]:
            bad.append(f"phase {start['phase']} attempt {start['attempt']}: {start['found']} (step {start['step']})")
    return bad


def steps_repeated(events: list[dict[str, Any]]) -> int:
    """Steps done before each kill that the next resume ran again."""
    repeated, killed_at = 0, None
    for event in events:
        if event["event"] == "kill":
            killed_at = event["done"] if event["done"] >= 0 else None  # (killed while resuming: no step lost)
        elif event["event"] == "start" and killed_at is not None:
            repeated += max(0, killed_at - event["step"])
            killed_at = None
    return repeated


def skipped_checkpoints(events: list[dict[str, Any]]) -> dict[str, str]:
    """Every checkpoint some resume skipped, with the reason the first time."""
    skipped: dict[str, str] = {}
    for start in (e for e in events if e["event"] == "start"):
        for item in start["skipped"]:
            skipped.setdefault(os.path.basename(item["path"]), item["reason"])
    return skipped


# What latest() says, in a few words (the full reasons are printed above).
KINDS = (
    ("no .metadata", "DCP data without .metadata"),
    ("has none: the save did not finish", "DCP without its side file"),
    ("mixes", "files of two saves"),
    ("is missing", "a rank's file missing"),
    ("temporary", "an unfinished save's temporary"),
    ("set aside", "a previous directory set aside"),
    ("", "damaged files"),
)


def kind_of(reason: str) -> str:
    return next(kind for text, kind in KINDS if text in reason)


def describe(schedule: list[Phase], args: argparse.Namespace) -> str:
    worlds = " -> ".join(f"{p.world} ranks (steps {p.start}-{p.end})" for p in schedule)
    return (
        f"{worlds}; checkpoint every {args.every} steps in turn as {', '.join(FORMATS)}, plus a full-model "
        "safetensors export replaced at each checkpoint"
    )


def report(args: argparse.Namespace, schedule: list[Phase], reference: Outcome, soaked: Outcome) -> tuple[bool, str]:
    """Print what happened and each check; whether all held, and the last line."""
    print(f"soak: {describe(schedule, args)}")
    print(f"reference (no kills): {len(reference.of('start'))} start(s), {reference.seconds:.1f} s")
    print(f"soaked: {len(soaked.of('start'))} start(s), {soaked.seconds:.1f} s")
    kills = soaked.of("kill")
    for kill in kills:
        print(
            f"  kill: phase {kill['phase']}, rank {kill['rank']}, mid-{kill['moment']}"
            + (f" ({kill['detail']})" if kill["detail"] else "")
            + (f", at step {kill['done']}" if kill["done"] >= 0 else "")
        )
    # every attempt after the first of its phase, whether it logged a start or died resuming
    restarts = len({(e["phase"], e["attempt"]) for e in (*soaked.of("start"), *kills) if e["attempt"] > 0})
    resumes = [e for e in soaked.of("start") if e["attempt"] > 0]
    for start in resumes:
        where = os.path.basename(start["found"]) if start["found"] else "nothing (a fresh start)"
        print(f"  restart: phase {start['phase']} attempt {start['attempt']} resumed from {where}")
    skipped = skipped_checkpoints(soaked.events)
    for name, reason in sorted(skipped.items()):
        print(f"  skipped {name}: {reason}")
    why = Counter(kind_of(reason) for reason in skipped.values())
    print(f"checkpoints skipped, by reason: {', '.join(f'{n} {k}' for k, n in sorted(why.items())) or 'none'}")
    print(f"steps repeated: {steps_repeated(soaked.events)}")
    ok = reference.failed is None and soaked.failed is None
    for name, outcome in (("reference", reference), ("soaked", soaked)):
        if outcome.failed:
            print(f"{name} run failed: {outcome.failed}")
    bad = bad_resumes(reference, soaked) if ok else ["(a run failed)"]
    print(
        f"starts: {len(soaked.of('start'))}, every one loaded the uninterrupted run's state at its step "
        f"(digests of every rank's shards and optimizer state): {'no' if bad else 'yes'}"
    )
    for line in bad:
        print(f"  not the reference's state: {line}")
    exported, left = export_report(reference, soaked) if ok else (False, [])
    print(f"final export identical: {'yes' if exported else 'no'}; left beside it: {', '.join(left) or 'nothing'}")
    different = final_differences(reference, soaked) if ok else ["(a run failed)"]
    for path in different[:10]:
        print(f"  differs: {path}")
    identical = not different
    all_kills = len(kills) == args.kills and restarts == len(kills)
    if not all_kills:
        print(f"expected {args.kills} kills, each followed by one restart")
    last = (
        f"soak: {len(kills)} kills, {restarts} restarts, {len(skipped)} checkpoints skipped, "
        f"final state identical: {'yes' if identical else 'no'}"
    )
    return ok and identical and not bad and exported and not left and all_kills, last


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="soak-")
    os.makedirs(workdir, exist_ok=True)
    reference = run(os.path.join(workdir, "reference"), phases(args, 0), args)
    soaked = run(os.path.join(workdir, "soaked"), phases(args, args.kills), args)
    held, last = report(args, phases(args, args.kills), reference, soaked)
    if held and not args.keep and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"runs kept in {workdir}")
    print(last)
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
