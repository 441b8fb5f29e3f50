"""DCP save and load through fsdp_legacy: `dcp.save` / `dcp.load` plus what DCP does not keep or check.

    from fsdp_legacy import dcp_checkpoint
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
    dcp_checkpoint.save(state, "ckpt/step100")      # every rank, as dcp.save
    dcp_checkpoint.load(state, "ckpt/step100")      # every rank, as dcp.load

The files are DCP's own (dcp.load and the converter read them). Beyond dcp.save, the directory gets a side file
(convert/side_file.py) with the layout records of LOCAL state dicts (DCP drops the state dict's `_metadata`, where they
travel otherwise, so a plain dcp.save of a LOCAL state dict cannot be converted without --layout-from), DCP's save id,
which every data file also ends with, and a CRC-32 of every file. `load` checks them all before dcp.load touches the
state: a file of another save or a flipped bit is refused, naming the file, with the same error on every rank.
"""

import contextlib
import os
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from ..convert.dcp_files import (
    METADATA_FILE,
    check_side_file,
    check_stamps,
    data_files,
    read_metadata,
    save_id_of,
    stamp_file,
    written_metadata,
)
from ..convert.errors import CheckpointError
from ..convert.record import FlatParamRecord, records_in_metadata
from ..convert.side_file import SIDE_FILE, check_files, file_crc, read_side_file, write_side_file
from .fresh_optim import fill_from_checkpoint, mark_checked
from .partial_load import check_complete_load


def save(state: dict[str, Any], checkpoint_id: str, *, process_group: dist.ProcessGroup | None = None) -> Metadata:
    """dcp.save(state, checkpoint_id=...) on every rank of `process_group`, then the side file (records, save
    identity, CRC-32s). Returns DCP's metadata. (async_save.py runs the same in the background.)"""
    records = records_of_tree(state)
    forget_side_file(checkpoint_id, process_group)
    saved = dcp.save(state, storage_writer=FileSystemWriter(checkpoint_id), process_group=process_group)
    return finish_save(saved, checkpoint_id, records, process_group)


def forget_side_file(checkpoint_id: str, process_group: dist.ProcessGroup | None) -> None:
    """A side file left by an earlier save in this directory is not this save's: it goes before any data is written,
    so that the directory counts as unfinished until this save's own side file is in place."""
    if _rank(process_group)[0] == 0:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(checkpoint_id, SIDE_FILE))


def finish_save(
    saved: Metadata | None,
    checkpoint_id: str,
    records: dict[str, list[FlatParamRecord]],
    process_group: dist.ProcessGroup | None,
) -> Metadata:
    """After dcp.save: every data file stamped with the save id and summed (a share per rank), then rank 0 writes the
    side file, which marks the save complete. The same outcome on every rank of `process_group`."""
    rank, world_size = _rank(process_group)
    metadata = written_metadata(saved, checkpoint_id)
    save_id = save_id_of(metadata)
    names = data_files(metadata)
    crcs: dict[str, int] = {}
    error = None
    try:
        for name in names[rank::world_size]:  # each rank stamps and sums a share of the files
            path = os.path.join(checkpoint_id, name)
            if save_id:
                stamp_file(path, save_id)
            crcs[name] = file_crc(path)
    except OSError as failure:
        error = f"Could not complete the save {checkpoint_id}: {failure}"
    shares = _gather((crcs, error), process_group, world_size)
    _raise_first([e for _, e in shares])
    if rank == 0:
        try:
            everything = {name: crc for share, _ in shares for name, crc in share.items()}
            everything[METADATA_FILE] = file_crc(os.path.join(checkpoint_id, METADATA_FILE))
            write_side_file(checkpoint_id, save_id, records, everything, saved_at=time.time())
            error = None
        except OSError as failure:
            error = f"Could not write {os.path.join(checkpoint_id, SIDE_FILE)}: {failure}"
    _raise_first(_gather(error if rank == 0 else None, process_group, world_size))
    return metadata


def load(
    state: dict[str, Any],
    checkpoint_id: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
) -> None:
    """Check the directory (one save, every file's CRC-32, the layout of LOCAL state dicts), the same outcome on every
    rank, then dcp.load(state, checkpoint_id=...). With `strict`, a section of `state` (a top-level key, such as
    "optim") that would receive fewer tensors than the checkpoint holds under it is an error (partial_load.py);
    sections `state` leaves out are not loaded. A fresh optimizer's FSDP.optim_state_dict in `state` first takes the
    state entries the checkpoint holds (fresh_optim.py), so the load restores them."""
    rank, world_size = _rank(process_group)
    try:
        _check(state, checkpoint_id, rank, world_size)
        error = None
    except CheckpointError as failure:
        error = str(failure)
    _raise_first(_gather(error, process_group, world_size))
    metadata = read_metadata(os.path.join(checkpoint_id, METADATA_FILE))  # readable: checked on every rank
    fill_from_checkpoint(state, metadata)  # a fresh optimizer's target takes the state the checkpoint holds
    if strict:
        try:
            check_complete_load(state, metadata, checkpoint_id)
        except CheckpointError as failure:
            error = str(failure)
        _raise_first(_gather(error, process_group, world_size))
    dcp.load(state, checkpoint_id=checkpoint_id, process_group=process_group)
    mark_checked(state)  # checked above (or strict=False: the caller accepts a partial load): no refusal later


def _check(state: dict[str, Any], directory: str, rank: int, world_size: int) -> None:
    metadata_file = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(metadata_file):
        raise CheckpointError(f"{directory} is not a DCP checkpoint directory (it has no {METADATA_FILE} file).")
    metadata = read_metadata(metadata_file)
    if rank == 0:
        check_stamps(directory, metadata, metadata.storage_data)
    side = read_side_file(directory)
    if side is None:
        return  # saved by plain dcp.save: nothing more to check
    check_side_file(directory, side, metadata)
    names = sorted(side.files)
    check_files(directory, side, names[rank::world_size])
    missing = sorted(set(data_files(metadata)) - set(side.files))
    if missing:
        raise CheckpointError(
            f"{directory}: {', '.join(missing)} is not among the files {SIDE_FILE} lists for this save: the "
            "directory mixes saves. Restore it from one save."
        )
    for path, mine in records_of_tree(state).items():
        saved = side.records.get(path)
        if saved is not None and _layout(saved) != _layout(mine):
            raise CheckpointError(
                f"{directory}: the LOCAL state dict {path or '(the whole state)'} was saved with another "
                "flat-parameter layout than this model's (another model, wrapping, use_orig_params setting or world "
                "size). A LOCAL_STATE_DICT loads only into the model it was saved from; convert it offline: python "
                f"tools/convert_checkpoint.py {directory} NEW --to local --layout-from "
                "A_LOCAL_CHECKPOINT_OF_THIS_MODEL."
            )


def records_of_tree(state: Mapping[str, Any], path: str = "") -> dict[str, list[FlatParamRecord]]:
    """The layout records of every state dict in `state` (their _metadata), by the state dict's dotted path."""
    found: dict[str, list[FlatParamRecord]] = {}
    own = records_in_metadata(getattr(state, "_metadata", None), path or "the state dict")
    if own:
        found[path] = own
    for key, value in state.items():
        if isinstance(value, Mapping):
            found.update(records_of_tree(value, f"{path}.{key}" if path else str(key)))
    return found


def _layout(records: Any) -> list[FlatParamRecord]:
    return sorted(records, key=lambda r: r.flat_key)


def _rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _gather(value: Any, group: dist.ProcessGroup | None, world_size: int) -> list[Any]:
    if world_size == 1:
        return [value]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, value, group=group)
    return out


def _raise_first(errors: list[str | None]) -> None:
    for error in errors:
        if error is not None:
            raise CheckpointError(error)
