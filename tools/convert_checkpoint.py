"""Convert a checkpoint offline (CPU, one process, no process group, no model code), model and optimizer:

    python tools/convert_checkpoint.py ckpt/local ckpt/fsdp2 --to dcp                   # LOCAL (flat) -> FSDP2's DCP
    python tools/convert_checkpoint.py ckpt/fsdp2 ckpt/model.pt --to full               # -> one torch.save file
    python tools/convert_checkpoint.py ckpt/model.pt ckpt/local8 --to local --world-size 8   # -> LOCAL for 8 ranks

Formats (the source's is detected):
  local  a DCP directory of {"model": LOCAL_STATE_DICT, "optim": FSDP.optim_state_dict(...)} saved by fsdp_legacy
         (its flat parameters carry layout records), at any world size; or (as a source) one torch.save file of the
         LOCAL model state dict per rank, by torch's FSDP1 or fsdp_legacy: their directory or a quoted glob pattern
  dcp    a DCP directory with every parameter under its FQN, as FSDP2 (fully_shard) saves and loads it
  full   one torch.save file {"model": {fqn: tensor}, "optim": {"state": ..., "param_groups": ...}}

Tensors are converted one at a time, the destination is replaced atomically, and what was written is read back and
compared with the source bit for bit. Every file is loaded with weights_only=True, but per-rank LOCAL files, whose
ShardedTensors are unpickled with an allowlist of torch's tensor classes (no code from the file runs).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import fsdp_legacy from the checkout
from fsdp_legacy.convert import FORMATS, CheckpointError, convert_checkpoint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "source",
        help="checkpoint to convert: a DCP directory, a torch.save file, or per-rank "
        "LOCAL torch.save files (their directory or a glob pattern)",
    )
    p.add_argument("destination", help="where to write the converted checkpoint")
    p.add_argument("--to", required=True, choices=FORMATS, help="target format")
    p.add_argument(
        "--world-size",
        type=int,
        help="--to local: the world size to lay flat parameters out for (default: the one of the layout)",
    )
    p.add_argument(
        "--layout-from",
        help="a checkpoint carrying the flat-parameter layout (one saved by fsdp_legacy "
        "under LOCAL_STATE_DICT, or converted from one): needed for --to local from "
        "a checkpoint without it, and to read torch FSDP1's LOCAL checkpoints",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    p.add_argument("--no-verify", action="store_true", help="skip reading the output back")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p.parse_args(argv)


class Progress:
    """A tqdm bar per phase when tqdm is installed (the `tools` extra), else a line every 10%."""

    def __init__(self, quiet: bool) -> None:
        self.quiet, self.bar, self.shown = quiet, None, -1
        self.phase: str | None = None
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.tqdm = tqdm

    def __call__(self, phase: str, done: int, total: int, name: str) -> None:
        if self.quiet:
            return
        if phase != self.phase:
            self.close()
            self.phase, self.shown = phase, -1
            if self.tqdm is not None:
                self.bar = self.tqdm(total=total, desc=phase, unit="B", unit_scale=True, unit_divisor=1024)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix_str(name[-40:], refresh=False)
        elif total and done * 10 // total > self.shown:
            self.shown = done * 10 // total
            print(f"{phase}: {100 * done // total}% ({name})", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.path.exists(args.destination) and not args.overwrite:
        print(
            f"error: {args.destination} exists; pass --overwrite to replace it (atomically: the old checkpoint "
            "stays intact until the new one is complete).",
            file=sys.stderr,
        )
        return 2
    progress = Progress(args.quiet)
    try:
        report = convert_checkpoint(
            args.source,
            args.destination,
            to=args.to,
            world_size=args.world_size,
            layout_from=args.layout_from,
            verify=not args.no_verify,
            progress=progress,
        )
    except CheckpointError as error:
        progress.close()
        print(f"error: {error}", file=sys.stderr)
        return 1
    progress.close()
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
