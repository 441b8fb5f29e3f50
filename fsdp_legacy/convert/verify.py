"""Whether one checkpoint directory is complete and intact, checked by one process with no process group, with what
its saver wrote: the save identities and CRC-32s of a DCP directory saved through fsdp_legacy, the CRC-32s torch.save
writes in each per-rank LOCAL file and their identities, the headers and identities of a streamed full save. Also when
each was saved, to tell the newest (fsdp_legacy.state.latest).

Formats:
    "dcp"          a DCP directory (`.metadata`, `*.distcp`; our side file `.fsdp_legacy.json` where we saved it)
    "local"        per-rank torch.save files of a LOCAL (or SHARDED) state dict, one per rank
    "safetensors"  a full save (save_full_model, save_pretrained): safetensors or pytorch_model.bin files

`verify` raises CheckpointError saying what is wrong; the CRC-32 reading, which is most of the work, can be shared
between ranks (`share`: this rank's index and the number of ranks), each checking every other thing itself.
"""

import contextlib
import json
import os
import re
import zipfile
from dataclasses import dataclass

from ..safetensors_format import (
    BIN_INDEX,
    BIN_WEIGHTS,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    SAVED_AT,
    WeightsDirectory,
    read_safetensors_header,
)
from .dcp_files import METADATA_FILE, DcpCheckpoint, data_files, read_metadata, refuse_unfinished
from .errors import CheckpointError
from .integrity import check_archive
from .rank_files import RankFiles, rank_files_in
from .side_file import SIDE_FILE, check_files, read_side_file, valid_time

_RANK_NAME = re.compile(r"rank_?\d+")
RECORDED = "the save's record"
MODIFIED = "file modification time"


@dataclass(frozen=True)
class Candidate:
    """A directory that holds (or held, or was to hold) a checkpoint, and when it was saved."""

    path: str
    format: str
    saved_at: float  # seconds since the epoch
    ordered_by: str  # RECORDED, or MODIFIED where the save records no time (torch's savers, earlier versions)
    step: int | None  # the last number in the directory's name ("step_300", "checkpoint-300"), if any


@dataclass(frozen=True)
class Verified:
    checked: str  # what was checked, in words
    save_id: str | None
    sealed: bool  # whether its saver sealed it (identities and CRC-32s of ours), not only torch's own CRC-32s


def classify(path: str) -> str | None:
    """The format of the checkpoint directory `path`, or None where it holds none."""
    try:
        names = os.listdir(path)
    except OSError:
        return None
    if METADATA_FILE in names or any(n.endswith(".distcp") for n in names):
        return "dcp"
    if any(n in names for n in (SAFE_INDEX, SAFE_WEIGHTS, BIN_INDEX, BIN_WEIGHTS)) or any(
        n.endswith(".safetensors") for n in names
    ):
        return "safetensors"
    if rank_files_in(path):
        return "local"
    return None


def candidate(path: str, fmt: str) -> Candidate:
    """When the checkpoint at `path` was saved: its own record where it has one, else its files' newest modification
    time. Reads only small descriptions; a damaged one falls back to the modification time (verify says why)."""
    recorded = None
    with contextlib.suppress(CheckpointError, OSError, ValueError, TypeError, KeyError):
        recorded = _recorded_time(path, fmt)
    found = re.findall(r"\d+", os.path.basename(os.path.normpath(path)))
    step = int(found[-1]) if found else None
    if recorded is not None:
        return Candidate(path, fmt, recorded, RECORDED, step)
    return Candidate(path, fmt, _newest_mtime(path), MODIFIED, step)


def _recorded_time(path: str, fmt: str) -> float | None:
    if fmt == "dcp":
        side = read_side_file(path)
        return side.saved_at if side is not None else None
    if fmt == "safetensors":
        if os.path.isfile(os.path.join(path, SAFE_INDEX)) or os.path.isfile(os.path.join(path, BIN_INDEX)):
            name = SAFE_INDEX if os.path.isfile(os.path.join(path, SAFE_INDEX)) else BIN_INDEX
            with open(os.path.join(path, name)) as file:
                value = (json.load(file).get("metadata") or {}).get(SAVED_AT)
        else:
            value = read_safetensors_header(os.path.join(path, SAFE_WEIGHTS)).metadata.get(SAVED_AT)
        return valid_time(_number(value), f"{path} ({SAVED_AT})") if value is not None else None
    return None


def _number(value: object) -> object:
    """A time recorded as a string (safetensors metadata holds strings), as a number where it reads as one."""
    try:
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


def _newest_mtime(path: str) -> float:
    times = [os.path.getmtime(path)]
    for name in os.listdir(path):
        with contextlib.suppress(OSError):
            times.append(os.path.getmtime(os.path.join(path, name)))
    return max(times)


def verify(path: str, fmt: str, share: tuple[int, int] = (0, 1)) -> Verified:
    """Raise CheckpointError unless the checkpoint at `path` is complete and intact; this process reads the CRC-32s
    of its `share` of the files only (index, count)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not there (any more): its directory is missing.")
    if fmt == "dcp":
        return _verify_dcp(path, share)
    if fmt == "local":
        files = rank_files_in(path)
        for name in sorted(os.listdir(path)):  # a rank's file so corrupted it no longer reads as one: damaged
            file = os.path.join(path, name)
            if file not in files and _RANK_NAME.search(name) and zipfile.is_zipfile(file):
                with open(file, "rb") as handle:
                    check_archive(handle, file)
        checkpoint = RankFiles(files, path, crc_checked=set(files[share[0] :: share[1]]))
        save_id = next((r.save_id for r in checkpoint.side_records.values() if r.save_id), None)
        return Verified(
            f"every rank's file of {checkpoint.world_size} present, CRC-32s of the archives"
            + (", save identities" if checkpoint.identified else " (no save identities)"),
            save_id,
            checkpoint.identified,
        )
    return _verify_full(path, share)


def _verify_dcp(path: str, share: tuple[int, int]) -> Verified:
    if not os.path.isfile(os.path.join(path, METADATA_FILE)):
        raise CheckpointError(
            f"{path} holds DCP data files but no {METADATA_FILE}, which dcp.save writes last: the save did not finish."
        )
    side = read_side_file(path)
    # metadata checked value by value, one save (stamps), every tensor tiled by its chunks, every item in its file
    checkpoint = DcpCheckpoint(path)
    metadata = read_metadata(os.path.join(path, METADATA_FILE))
    names = data_files(metadata)
    if side is None:
        refuse_unfinished(path, names)
        # what the converter checks of a plain dcp.save: each item's archive, dtype and shape
        checkpoint.check_items(checkpoint.data_file_names()[share[0] :: share[1]])
        return Verified(
            "every item's CRC-32s, dtype and shape against .metadata (saved by dcp.save itself: no save identity "
            "or CRC-32 of whole files)",
            getattr(metadata.storage_meta, "save_id", None),
            False,
        )
    missing = sorted(set(names) - set(side.files))
    if missing:
        raise CheckpointError(
            f"{path}: {', '.join(missing)} is not among the files {SIDE_FILE} lists for this save: the directory "
            "mixes saves."
        )
    check_files(path, side, sorted(side.files)[share[0] :: share[1]])
    return Verified("one save (identities), CRC-32 of every file", side.save_id, True)


def _verify_full(path: str, share: tuple[int, int]) -> Verified:
    try:
        with contextlib.ExitStack() as stack:
            weights = WeightsDirectory(path, stack)  # headers against files, index against headers, one save
            files = sorted({file for file, _, _ in weights.meta.values()})
    except (RuntimeError, FileNotFoundError) as error:
        raise CheckpointError(str(error)) from None
    if not weights.safe:
        for name in files[share[0] :: share[1]]:
            with open(os.path.join(path, name), "rb") as file:
                check_archive(file, os.path.join(path, name))
        return Verified("every file present, CRC-32s of the torch.save archives, one save", None, False)
    headers = {name: read_safetensors_header(os.path.join(path, name)) for name in files}
    for name, header in headers.items():
        if SAVED_AT in header.metadata:
            valid_time(_number(header.metadata[SAVED_AT]), f"{os.path.join(path, name)} ({SAVED_AT})")
    problem = weights.data_crc_problem(share)
    if problem is not None:
        raise CheckpointError(problem)
    save_ids = {header.save_id for header in headers.values()}
    sealed = all(header.data_sealed for header in headers.values())
    header_sealed = all(header.header_sealed for header in headers.values())
    return Verified(
        "every file present, headers against sizes, one save, "
        + (
            "CRC-32s of the tensor data"
            if sealed
            else "no CRC-32 recorded (saved by save_pretrained, or by an earlier fsdp_legacy)"
        )
        + (", the headers' seals" if header_sealed else " (header-unsealed)"),
        next(iter(save_ids)) if len(save_ids) == 1 else None,
        sealed and header_sealed,
    )
