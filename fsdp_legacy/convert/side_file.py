"""The side file of a DCP directory saved through fsdp_legacy (fsdp_legacy.state.dcp_checkpoint, the converter): what
DCP itself does not keep.

    <directory>/.fsdp_legacy.json   {"format", "version", "save_id", "records": {section: [record JSON]},
                                     "files": {name: CRC-32 of the whole file},
                                     "saved_at": seconds since the epoch (since 0.x; absent before),
                                     "checksum": CRC-32 of the rest (absent in earlier versions)}

* `records`: the layout records of LOCAL state dicts (DCP saves tensors and drops the state dict's `_metadata`,
  where they travel otherwise), by the dotted path of the state dict in the saved tree ("" for a bare one);
* `save_id`: DCP's own save id from `.metadata`, which every data file also ends with (dcp_files.stamp_file): files
  of another save are refused by name;
* `files`: a CRC-32 of every file of the save, `.metadata` included (DCP checks none);
* `checksum`: a CRC-32 of the side file's own content (canonical JSON of every other field), so a flipped digit in
  a recorded CRC-32 or a layout record is seen as damage to the side file rather than to the file it names.

It is written last, atomically (a temporary file renamed), after every data file is complete: a directory with
`.metadata` but without it was written by another saver (plain dcp.save) and has none of these checks.
"""

import json
import os
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .errors import CheckpointError
from .record import FlatParamRecord

SIDE_FILE = ".fsdp_legacy.json"
_FORMAT = "fsdp_legacy.dcp_side"
_VERSION = 1
_BLOCK = 1 << 20
_LATEST_TIME = 2**40  # seconds since the epoch (year 36812): a saved_at past it is damage, not a time


@dataclass(frozen=True)
class SideFile:
    save_id: str | None
    records: Mapping[str, tuple[FlatParamRecord, ...]]  # dotted path of a state dict in the saved tree -> records
    files: Mapping[str, int]  # file name -> CRC-32
    saved_at: float | None = None  # when the save completed (seconds since the epoch): what is newest (latest.py)


def file_crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as file:
        while block := file.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def write_side_file(
    directory: str,
    save_id: str | None,
    records: Mapping[str, Iterable[FlatParamRecord]],
    files: Mapping[str, int],
    saved_at: float | None = None,
) -> None:
    body: dict[str, object] = {
        "format": _FORMAT,
        "version": _VERSION,
        "save_id": save_id,
        "records": {section: [r.to_json() for r in found] for section, found in records.items()},
        "files": dict(sorted(files.items())),
    }
    if saved_at is not None:
        body["saved_at"] = saved_at
    body["checksum"] = _checksum(body)
    temporary = os.path.join(directory, f"{SIDE_FILE}.tmp-{os.getpid()}")
    with open(temporary, "w") as file:
        json.dump(body, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, os.path.join(directory, SIDE_FILE))


def _checksum(body: Mapping[str, object]) -> int:
    content = {k: v for k, v in body.items() if k != "checksum"}
    return zlib.crc32(json.dumps(content, sort_keys=True, separators=(",", ":")).encode())


def valid_time(value: object, what: str) -> float:
    """A recorded save time (seconds since the epoch), or CheckpointError: a value no clock gives (negative, not
    finite, past year 36812) is damage, and would otherwise order the checkpoints wrongly or fail to print."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < _LATEST_TIME:
        raise CheckpointError(f"{what} records the save time {value!r:.40}, which is not a time: it is damaged.")
    return float(value)


def read_side_file(directory: str) -> SideFile | None:
    """The side file of a DCP directory, or None where it has none."""
    path = os.path.join(directory, SIDE_FILE)
    try:
        with open(path, "rb") as file:
            raw = file.read()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read ({error}).") from None
    damaged = f"{path} is damaged"
    fix = "restore the checkpoint directory from a copy, or save it again."
    try:
        body = json.loads(raw.decode("utf-8"))
        if not isinstance(body, dict):
            raise TypeError(f"it holds a JSON {type(body).__name__}")
        if body.get("format") != _FORMAT or body.get("version") != _VERSION:
            raise CheckpointError(
                f"{path}: unknown format {body.get('format')!r:.40} version {body.get('version')!r:.20} (this "
                f"fsdp_legacy reads {_FORMAT!r} version {_VERSION}): upgrade fsdp_legacy, or the file is damaged."
            )
        if "checksum" in body and body["checksum"] != _checksum(body):
            raise CheckpointError(
                f"{damaged}: its content does not match the CRC-32 it records of itself (a byte changed after "
                f"saving): {fix}"
            )
        save_id = body["save_id"]
        files = {str(name): int(crc) for name, crc in body["files"].items()}
        sections = body["records"].items()
        if save_id is not None and not isinstance(save_id, str):
            raise TypeError("save_id is not a string")
        for name in files:
            if not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
                raise TypeError(f"it lists the file {name!r:.60}, which is not inside the checkpoint's directory")
        saved_at = body.get("saved_at")
        if saved_at is not None:
            saved_at = valid_time(saved_at, path)
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as error:
        raise CheckpointError(f"{damaged} ({str(error)[:200]}): {fix}") from None
    try:
        records = {
            str(section): tuple(
                FlatParamRecord.from_json(text, f"{path} ({section or 'the state dict'})") for text in found
            )
            for section, found in sections
        }
    except TypeError as error:  # (a section that is not a list of records)
        raise CheckpointError(f"{damaged} ({error}): {fix}") from None
    return SideFile(save_id, records, files, saved_at)


def check_files(directory: str, side: SideFile, names: Iterable[str] | None = None) -> None:
    """Refuse a file of the save (or of `names`) that is missing or whose CRC-32 differs from the side file's."""
    for name in sorted(side.files if names is None else names):
        path = os.path.join(directory, name)
        try:
            crc = file_crc(path)
        except FileNotFoundError:
            raise CheckpointError(
                f"{path} is missing: the checkpoint is incomplete (copy every file of the directory)."
            ) from None
        if crc != side.files[name]:
            raise CheckpointError(
                f"{path} is corrupted or from another save: its CRC-32 {crc:08x} differs from the "
                f"{side.files[name]:08x} recorded when it was saved ({SIDE_FILE}). Restore the whole directory from a "
                "copy of one save, or save it again."
            )
