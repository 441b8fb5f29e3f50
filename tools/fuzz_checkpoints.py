"""Fuzz the checkpoint readers with mutated copies of checkpoints the project writes (issue 43).

    python tools/fuzz_checkpoints.py --cases 300 [--seed 43]     # the table, then every defect with its mutation
    python tools/fuzz_checkpoints.py --case 43:17                 # rerun one case, every reader's verdict

The checkpoints are saved once per run by 2 gloo CPU ranks (tools/checkpoint_fuzz/sources.py). Every reader
(`fsdp-legacy inspect`, `inspect --json`, `convert --to full`, `convert --to safetensors`, `checkpoint.latest()`,
`inspect --latest`) runs on every mutated copy in a forked child with a timeout, an address-space and a file-size
limit; tools/checkpoint_fuzz/campaign.py says how the outcomes are classified. Exit code 1 when any defect was found:
a traceback, crash, hang or code run in any format, or a silent wrong result in a format we seal."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_fuzz.campaign import Campaign, CaseResult, table
from checkpoint_fuzz.readers import Limits
from checkpoint_fuzz.sources import write_sources


def _print_case(result: CaseResult, every: bool) -> None:
    print(f"case {result.id} ({result.format}, {result.kind}): {result.mutation}")
    for verdict in result.verdicts if every else result.defects():
        detail = f": {verdict.detail}" if verdict.detail else ""
        print(f"  {verdict.reader}: {verdict.outcome} ({verdict.seconds:.2f} s){detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100, help="how many cases (mutated copies) to run")
    parser.add_argument("--seed", type=int, default=43)
    parser.add_argument("--case", help="rerun one case, SEED:INDEX, and print every reader's verdict")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a reader may run on one copy")
    parser.add_argument(
        "--unsealed", action="store_true", help="also print the silent wrong results of unsealed formats"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the readers are forked: no thread pool to inherit half-started
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fuzz-checkpoints-") as scratch:
        write_sources(Path(scratch) / "sources")
        campaign = Campaign(Path(scratch) / "sources", Path(scratch) / "work", Limits(timeout_s=args.timeout))
        if args.case:
            seed, index = (int(part) for part in args.case.split(":"))
            result = campaign.run_case(seed, index)
            _print_case(result, every=True)
            return 1 if result.defects() else 0
        results = [campaign.run_case(args.seed, index) for index in range(args.cases)]
    print(f"{args.cases} cases, seed {args.seed}, {time.monotonic() - started:.0f} s\n")
    print(table(results))
    defects = [r for r in results if r.defects()]
    print(f"\n{sum(len(r.defects()) for r in defects)} defects in {len(defects)} cases")
    for result in defects:
        _print_case(result, every=False)
    if args.unsealed:
        for result in results:
            if not result.defects() and any(v.outcome == "silent wrong" for v in result.verdicts):
                _print_case(result, every=True)
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
