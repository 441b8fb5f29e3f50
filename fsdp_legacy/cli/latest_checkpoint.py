"""`fsdp-legacy inspect --latest ROOT`: which checkpoint under ROOT a restarted job resumes from (the newest complete
and intact one, fsdp_legacy.checkpoint.latest), and why each newer one was skipped."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging

from ..state.latest import LatestCheckpoint, search
from .common import EXIT_FAILED, EXIT_OK, UsageError


def _when(seconds: float) -> str:
    try:
        return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):  # (latest() refuses such times; a clock can still be wrong)
        return f"{seconds!r} seconds since the epoch, not a date"


def as_text(root: str, found: LatestCheckpoint | None) -> str:
    if found is None:
        return f"{root}: no complete and intact checkpoint"
    step = f", step {found.step} (by its name)" if found.step is not None else ""
    lines = [
        f"{root}: the newest complete checkpoint is {found.path}",
        f"  format:      {found.format}",
        f"  saved:       {_when(found.saved_at)} (by {found.ordered_by}){step}",
        f"  save id:     {found.save_id or 'none recorded'}",
        f"  checked:     {found.checked}",
    ]
    return "\n".join(lines)


def run_latest(root: str, as_json: bool) -> int:
    """Print the choice and the skipped candidates; exit code 1 when nothing under `root` is usable."""
    logging.getLogger("fsdp_legacy.checkpoint").setLevel(logging.ERROR)  # the skipped ones are printed below
    try:
        found, skipped = search(root)
    except (FileNotFoundError, NotADirectoryError) as error:
        raise UsageError(str(error)) from None
    if as_json:
        body = dataclasses.asdict(found) if found is not None else {"path": None, "skipped": []}
        body["skipped"] = [dataclasses.asdict(s) for s in skipped]
        print(json.dumps({"root": root, **body}, indent=2))
    else:
        print(as_text(root, found))
        for item in skipped:
            print(f"  skipped:     {item.path}: {' '.join(item.reason.split())}")
    return EXIT_OK if found is not None else EXIT_FAILED
