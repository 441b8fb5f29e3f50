"""Fuzz the runtime against torch's FSDP1: seeded cases run side by side on 2 (or 4) gloo CPU ranks.

    python tools/fuzz_runtime.py --seeds 200 [--start 0] [--world-size 4]   # a line per seed, then every difference
    python tools/fuzz_runtime.py --seed 17 --show              # rerun one seed and print its case

Each seed draws a small model, an FSDP configuration and a program (test/runtime_fuzz_cases.py); the program runs
with torch's FSDP1 and with ours under the switch, and every loss, gradient, clip norm, eval output, summoned
parameter and state dict is compared bit for bit (test/runtime_fuzz.py). Exit code 1 when any seed differed."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

TEST_DIR = Path(__file__).resolve().parent.parent / "test"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=50, help="how many seeds")
    parser.add_argument("--start", type=int, default=0, help="the first seed")
    parser.add_argument("--seed", type=int, help="run this one seed only")
    parser.add_argument("--show", action="store_true", help="print each case as drawn")
    parser.add_argument("--world-size", type=int, choices=(2, 4), default=2, help="ranks per case")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(TEST_DIR))
    importlib.import_module("repo_paths").put_on_sys_path()
    fuzz = importlib.import_module("runtime_fuzz")
    harness = importlib.import_module("harness")
    seeds = [args.seed] if args.seed is not None else list(range(args.start, args.start + args.seeds))
    started, different, without_oracle = time.monotonic(), [], 0
    try:
        for seed in seeds:
            began = time.monotonic()
            outcome = fuzz.run_seed(seed, world_size=args.world_size)
            if args.show:
                print(outcome.case.describe())
            print(f"{time.monotonic() - began:5.1f} s  {outcome.line()[:3000]}", flush=True)
            if outcome.difference is not None:
                different.append(outcome)
            without_oracle += outcome.torch_failed is not None
    finally:
        harness.shutdown()
    print(f"\n{len(seeds)} seeds in {time.monotonic() - started:.0f} s, {len(different)} different")
    print(f"{without_oracle} without an oracle (torch's FSDP1 hung or hit a known bug)")
    for outcome in different:
        print(outcome.case.describe())
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
