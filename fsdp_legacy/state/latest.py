"""`fsdp_legacy.checkpoint.latest(root)`: the newest checkpoint under a folder that is complete and intact, the same
on every rank, for a job that restarts after a preemption (torchrun --max-restarts) and must resume by itself.

    found = latest("ckpt")            # every rank, or one process with no process group
    if found is not None:
        dcp_checkpoint.load(state, found.path)

Each directory under `root` is a candidate: a DCP directory, per-rank LOCAL files, a full save (convert/verify.py).
They are ordered by when they were saved, as the save recorded it (our DCP side file, our safetensors metadata), else
by their files' modification time (said in the result), and checked newest first with what their savers wrote (save
identities, CRC-32s, headers, every rank's file present). A damaged, partial or mixed one is skipped with the reason,
as is the hidden temporary of a save that never finished (convert/atomic.py).

With a process group, rank 0 lists the candidates and sends the list to every rank, so all consider the same ones in
the same order; each rank checks a candidate (structure in full, CRC-32s of its share of the files) and the ranks
exchange their verdicts: the first candidate no rank found fault with is everyone's answer. No two ranks resume from
different checkpoints, and a candidate one rank cannot see (a node-local disk) is skipped for all.
"""

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..convert.verify import Candidate, Verified, candidate, classify, verify

_logger = logging.getLogger("fsdp_legacy.checkpoint")
_TEMPORARY = re.compile(r"\.(.+)\.(tmp|old)-[0-9a-f]{8}-\d+-\d+-.+")  # convert/atomic.py's _sibling names


@dataclass(frozen=True)
class SkippedCheckpoint:
    path: str
    reason: str


@dataclass(frozen=True)
class LatestCheckpoint:
    """The newest complete and intact checkpoint under a folder, and the newer ones that were not."""

    path: str
    format: str  # "dcp", "local" (per-rank torch.save files) or "safetensors" (a full save)
    saved_at: float  # seconds since the epoch
    ordered_by: str  # "the save's record", or "file modification time" where the save recorded no time
    save_id: str | None  # the save's identity, where it has one
    step: int | None  # the last number in the directory's name, if any (not used for ordering)
    checked: str  # what was verified, in words
    skipped: tuple[SkippedCheckpoint, ...]  # newer candidates and unfinished saves, with the reason for each


@dataclass(frozen=True)
class _Listing:
    candidates: list[Candidate]
    skipped: list[SkippedCheckpoint]
    error: tuple[str, str] | None = None  # (exception type, message) where `root` cannot be listed


def latest(root: str, *, process_group: dist.ProcessGroup | None = None) -> LatestCheckpoint | None:
    """The newest checkpoint directly under `root` that is complete and intact (None if there is none), agreed by
    every rank of `process_group` (default: the world, when a process group is initialised; else this process
    alone). Skipped candidates are listed in the result with the reason, and logged (warning, rank 0). Every rank
    must call it."""
    return search(root, process_group=process_group)[0]


def search(
    root: str, *, process_group: dist.ProcessGroup | None = None
) -> tuple[LatestCheckpoint | None, tuple[SkippedCheckpoint, ...]]:
    """`latest`, and the candidates skipped (all of them where none is usable)."""
    rank, size = _rank(process_group)
    listing = _list(root) if rank == 0 else None
    if size > 1:
        holder = [listing]
        dist.broadcast_object_list(holder, group=process_group, group_src=0)
        listing = holder[0]
    assert listing is not None, "rank 0 lists the candidates"
    if listing.error is not None:
        kind, message = listing.error
        raise (FileNotFoundError if kind == "FileNotFoundError" else NotADirectoryError)(message)
    skipped = list(listing.skipped)
    ordered = sorted(listing.candidates, key=lambda c: (c.saved_at, c.path), reverse=True)
    for index, found in enumerate(ordered):
        verified = _checked(found, rank, size, process_group, skipped)
        if verified is None:
            continue
        if not verified.sealed and found.step is not None:  # a sealed save of the same step is preferred
            for other in ordered[index + 1 :]:
                if other.step != found.step:
                    continue
                sealed = _checked(other, rank, size, process_group, skipped)
                if sealed is not None and sealed.sealed:
                    skipped.append(
                        SkippedCheckpoint(
                            found.path,
                            f"it carries no seal of its saver ({verified.checked}): {other.path}, of the same step "
                            f"{found.step} and sealed, is preferred",
                        )
                    )
                    found, verified = other, sealed
                    break
        _log(rank, skipped)
        chosen = LatestCheckpoint(
            found.path,
            found.format,
            found.saved_at,
            found.ordered_by,
            verified.save_id,
            found.step,
            verified.checked,
            tuple(skipped),
        )
        return chosen, chosen.skipped
    _log(rank, skipped)
    return None, tuple(skipped)


def _checked(
    found: Candidate, rank: int, size: int, process_group: dist.ProcessGroup | None, skipped: list[SkippedCheckpoint]
) -> Verified | None:
    """`found` verified by every rank (each its share), or None with the first fault appended to `skipped`."""
    try:
        verdict: Any = (None, verify(found.path, found.format, (rank, size)))
    except Exception as error:  # any failure is this candidate's fault; every rank must still answer
        verdict = (f"{str(error) or type(error).__name__}", None)
    verdicts = _gather(verdict, process_group, size)
    faults = [(r, reason) for r, (reason, _) in enumerate(verdicts) if reason is not None]
    if faults:
        where, reason = faults[0]
        reason = reason.removeprefix(f"{found.path}: ")  # (the path is the skipped entry's own)
        skipped.append(SkippedCheckpoint(found.path, reason if where == 0 else f"{reason} (on rank {where})"))
        return None
    return verdicts[0][1]


def _log(rank: int, skipped: list[SkippedCheckpoint]) -> None:
    for item in skipped if rank == 0 else ():
        _logger.warning("fsdp_legacy.checkpoint.latest skipped %s: %s", item.path, item.reason)


def _list(root: str) -> _Listing:
    if not os.path.isdir(root):
        kind = "NotADirectoryError" if os.path.exists(root) else "FileNotFoundError"
        what = "is not a directory" if os.path.exists(root) else "does not exist"
        return _Listing([], [], (kind, f"{root} {what}: pass the folder that holds the checkpoints."))
    candidates, skipped = [], []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        temporary = _TEMPORARY.fullmatch(name)
        if temporary is not None:
            destination = os.path.join(root, temporary.group(1))
            skipped.append(SkippedCheckpoint(path, _temporary_reason(destination, temporary.group(2))))
            continue
        if name.startswith("."):
            continue
        fmt = classify(path)
        if fmt is not None:
            candidates.append(candidate(path, fmt))
    return _Listing(candidates, skipped)


def _temporary_reason(destination: str, kind: str) -> str:
    if kind == "tmp":
        return (
            f"the temporary of a save to {destination} that has not finished: a save is renamed into place only once "
            "complete, so this one was interrupted (or is still running). The next save there, or "
            "fsdp_legacy.convert.atomic.remove_stale_temporaries, removes it once its writer is gone."
        )
    return (
        f"the previous checkpoint of {destination}, set aside by a save killed between its two renames: "
        f"fsdp_legacy.convert.atomic.remove_stale_temporaries({destination!r}) puts it back in place."
    )


def _rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _gather(value: Any, group: dist.ProcessGroup | None, size: int) -> list[Any]:
    if size == 1:
        return [value]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, value, group=group)
    return out
