"""Per-rank torch.save files of a LOCAL state dict as one "local" checkpoint, read with no process group:

    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        torch.save(model.state_dict(), f"ckpt/rank{rank}.pt")   # torch's FSDP1 or fsdp_legacy's

Each flat parameter is a ShardedTensor, loaded as its local pieces by loading.load_rank_file (a restricted
unpickler: no ShardedTensor.__setstate__, no process group, no code from the file). A file's rank and world size
come from the ShardedTensors' pickled process-group state, never from its name; every rank 0..W-1 must be there
once. The flat parameters are assembled from every rank's pieces (stored as chunks, as DCP stores them); every other
leaf (buffers, layout records, use_orig_params' per-rank views) is rank 0's.

The same reads per-rank files of a SHARDED_STATE_DICT (a ShardedTensor per parameter) and of a fully_shard model's
state dict (a DTensor per parameter, whose rank and mesh are pickled with it), as verl and Accelerate save them.
"""

import glob
import os
import re
import zipfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..safetensors_format import mixed_saves
from .checkpoint import Checkpoint, Chunk, Path, TensorMeta, dotted, flatten
from .errors import CheckpointError
from .integrity import ZIP_ERRORS, check_archive
from .loading import LocalShards, load_rank_file
from .record import FlatParamRecord, records_in_metadata
from .seals import Seals


def is_rank_file(path: str) -> bool:
    """Whether `path` is a torch.save archive whose pickle names ShardedTensor or DTensor (read as bytes, nothing
    unpickled)."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("/data.pkl") or name == "data.pkl"]
            if len(pickles) != 1:
                return False
            data = archive.read(pickles[0])
            return b"ShardedTensor" in data or b"DTensor" in data
    except ZIP_ERRORS:  # (damaged: integrity.py)
        return False


_RANK_NAME = re.compile(r"rank_?\d+")


def is_damaged_archive(path: str) -> bool:
    """Whether `path` is a zip archive (torch.save's, by its first record or its end) that cannot be read as one or
    whose records do not match their CRC-32s: cut short or corrupted in place. A flipped bit in a rank file's pickle
    can hide what is_rank_file looks for; the file is then still one of the ranks', damaged, not a missing rank."""
    try:
        with open(path, "rb") as file:
            starts_as_zip = file.read(4) == b"PK\x03\x04"
        if not (starts_as_zip or zipfile.is_zipfile(path)):
            return False
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is not None
    except ZIP_ERRORS:  # (damaged: integrity.py)
        return True


def rank_files_in(source: str | Sequence[str]) -> list[str]:
    """The per-rank files a source names: a list of files, a glob pattern, a directory (its rank files, and beside
    them the damaged archives and the files named as a rank's, so that a rank file damaged in place is reported as
    damaged rather than as missing), or one file. Empty when it names none."""
    if not isinstance(source, str):
        return list(source)
    if os.path.isdir(source):
        names = sorted(os.path.join(source, n) for n in os.listdir(source) if not n.startswith("."))
        files = [n for n in names if os.path.isfile(n)]
        rank_files = {n for n in files if is_rank_file(n)}
        named = {n for n in files if rank_files and _RANK_NAME.search(os.path.basename(n))}  # beside rank files
        return [n for n in files if n in rank_files or n in named or is_damaged_archive(n)]
    if os.path.isfile(source):
        return [source] if is_rank_file(source) else []
    if glob.has_magic(source):
        return sorted(n for n in glob.glob(source) if os.path.isfile(n))
    return []


class RankFiles(Checkpoint):
    def __init__(self, files: Sequence[str], location: str, crc_checked: Collection[str] | None = None) -> None:
        """`crc_checked`: the files whose CRC-32s to check (default all; ranks checking one save share the work)."""
        self.location = location
        self._crc_checked = crc_checked
        if not files:
            raise CheckpointError(f"{location} names no per-rank files of a LOCAL state dict.")
        by_rank: dict[int, tuple[str, dict[Path, Any]]] = {}
        world_sizes: dict[int, str] = {}
        records: dict[str, list[FlatParamRecord]] = {}
        for file in files:
            leaves, rank, world_size, records[file] = self._open(file)
            if rank in by_rank:
                raise CheckpointError(
                    f"{file} and {by_rank[rank][0]} are both rank {rank}'s LOCAL state dict (by the ShardedTensors "
                    "they hold, whatever their names): the set of files mixes saves or holds a copy. Pass exactly one "
                    "file per rank of one save."
                )
            by_rank[rank] = (file, leaves)
            world_sizes.setdefault(world_size, file)
        check_one_save(records, location)
        if len(world_sizes) > 1:
            described = ", ".join(f"{w} ({f})" for w, f in sorted(world_sizes.items()))
            raise CheckpointError(
                f"{location}: the per-rank files were saved at different world sizes: {described}. "
                "Pass the files of one save."
            )
        world_size = next(iter(world_sizes))
        missing = sorted(set(range(world_size)) - set(by_rank))
        if missing:
            raise CheckpointError(
                f"{location}: the LOCAL state dict was saved by {world_size} ranks, but the file of rank(s) "
                f"{missing} is missing (found ranks {sorted(by_rank)}: "
                f"{', '.join(os.path.basename(by_rank[r][0]) for r in sorted(by_rank))}). Copy every rank's file, and "
                "pass their directory, a glob pattern or the list of them."
            )
        first_file, first = by_rank[0]
        for rank, (file, leaves) in sorted(by_rank.items()):
            sharded = {p for p, v in leaves.items() if isinstance(v, LocalShards)}
            if sharded != {p for p, v in first.items() if isinstance(v, LocalShards)} or leaves.keys() != first.keys():
                different = sorted(dotted(p) for p in leaves.keys() ^ first.keys()) or sorted(
                    dotted(p) for p in sharded ^ {q for q, v in first.items() if isinstance(v, LocalShards)}
                )
                raise CheckpointError(
                    f"{file} (rank {rank}) and {first_file} (rank 0) do not hold the same keys "
                    f"({different}): they are not from one save. Pass the files of one save."
                )
        self.world_size = world_size
        self.side_records = {r.flat_key: r for r in records[first_file]}
        self.leaves, self._plain, self._pieces = {}, {}, {}
        # The sharded tensors in the order saved, each once: a tied parameter, saved under two keys, has the same
        # local pieces (the same storage) under both, on every rank.
        distinct: dict[Any, Path] = {}
        for path, leaf in first.items():
            if isinstance(leaf, LocalShards):
                distinct.setdefault(_identity(path, [by_rank[r][1][path] for r in by_rank]), path)
                self._pieces[path] = assemble(path, [(by_rank[r][0], by_rank[r][1][path]) for r in by_rank], location)
                self.leaves[path] = TensorMeta(leaf.shape, leaf.dtype)
            elif isinstance(leaf, torch.Tensor):
                self._plain[path] = leaf
                self.leaves[path] = TensorMeta.of(leaf)
            else:
                self.leaves[path] = leaf
        self.sharded: list[Path] = list(distinct.values())

    def _open(self, file: str) -> tuple[dict[Path, Any], int, int, list[FlatParamRecord]]:
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} does not exist: pass the per-rank files of a LOCAL state dict.")
        with open(file, "rb") as handle:
            try:
                if self._crc_checked is None or file in self._crc_checked:
                    check_archive(handle, file)
            except CheckpointError as error:  # named as damaged, not missing: the file is there
                raise CheckpointError(f"One of the per-rank files is there but damaged: {error}") from None
        tree = load_rank_file(file)
        if not isinstance(tree, Mapping):
            raise CheckpointError(f"{file} holds a {type(tree).__name__}, not a LOCAL state dict.")
        if "model" not in tree:
            tree = {"model": tree}  # torch.save(model.state_dict())
        records = records_in_metadata(getattr(tree["model"], "_metadata", None), file)
        leaves = flatten(tree, file)
        for path, value in leaves.items():
            if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter):
                raise CheckpointError(
                    f"{file}: {dotted(path)} is a {type(value).__name__}; a LOCAL state dict holds "
                    "plain tensors and ShardedTensors."
                )
        groups = {(v.rank, v.world_size) for v in leaves.values() if isinstance(v, LocalShards)}
        if not groups:
            raise CheckpointError(
                f"{file} holds no ShardedTensor, so it is not one rank's LOCAL state dict; pass "
                "the per-rank files saved under LOCAL_STATE_DICT (a full file converts by itself)."
            )
        if len(groups) > 1:
            raise CheckpointError(
                f"{file} holds ShardedTensors saved by different ranks or world sizes "
                f"{sorted(groups)}: it was edited or assembled from several saves."
            )
        rank, world_size = groups.pop()
        if not 0 <= rank < world_size:
            raise CheckpointError(f"{file} says it was saved by rank {rank} of {world_size}: the file is damaged.")
        return leaves, rank, world_size, records

    @property
    def identified(self) -> bool:
        """Whether every layout record carries its save's identity (our LOCAL saves; not torch's FSDP1's)."""
        return bool(self.side_records) and all(r.save_id for r in self.side_records.values())

    def verify_seals(self) -> Seals:
        """The archives' CRC-32s and the save identities were checked on opening (unless a share was given)."""
        return rank_file_seals(self.identified, self._crc_checked is None)

    def read(self, path: Path) -> torch.Tensor:
        if path in self._plain:
            return self._plain[path]
        meta = self.leaves[path]
        out = torch.empty(meta.shape, dtype=meta.dtype)
        for (offsets, sizes), tensor in self._pieces[path]:
            out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].copy_(tensor)
        return out

    def read_flat(self, path: Path, start: int, stop: int) -> torch.Tensor:
        if path not in self._pieces or len(self.leaves[path].shape) != 1:
            return super().read_flat(path, start, stop)
        out = torch.empty(stop - start, dtype=self.leaves[path].dtype)
        for ((offset,), (size,)), tensor in self._pieces[path]:
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                out[lo - start : hi - start].copy_(tensor[lo - offset : hi - offset])
        return out

    def chunks(self, path: Path) -> list[Chunk] | None:
        return [chunk for chunk, _ in self._pieces[path]] if path in self._pieces else None


def rank_file_seals(identified: bool, crc_checked: bool = True) -> Seals:
    """What the readers of per-rank files check: every archive's CRC-32s, and the save identities where the layout
    records carry them."""
    checked = ("CRC-32s of every rank's torch.save archive",) if crc_checked else ()
    if identified:
        return Seals((*checked, "one save (the save identities in the layout records)"))
    return Seals(
        checked,
        (
            "no save identity (files of torch's FSDP1, of an earlier fsdp_legacy, or of a SHARDED state dict): files "
            "of two saves with the same layout are not told apart",
        ),
    )


def assemble(path: Path, saved: list[tuple[str, LocalShards]], location: str) -> list[tuple[Chunk, torch.Tensor]]:
    """Every rank's pieces of a ShardedTensor or DTensor: the same global shape and dtype everywhere, together
    covering it once (a piece saved by several ranks, as replicas do, counts once)."""
    _, first = saved[0]
    pieces: dict[Chunk, torch.Tensor] = {}
    for file, shards in saved:
        if (shards.shape, shards.dtype) != (first.shape, first.dtype):
            raise CheckpointError(
                f"{dotted(path)} in {file} is a {tuple(shards.shape)} {shards.dtype} tensor but "
                f"{tuple(first.shape)} {first.dtype} in {saved[0][0]}: the files are not from one save."
            )
        for offsets, tensor in shards.pieces:
            if tensor.numel() == 0:
                continue  # a rank with nothing of it (torch saves none; DCP records none)
            if len(offsets) != len(first.shape) or any(
                o < 0 or o + s > n for o, s, n in zip(offsets, tensor.shape, first.shape, strict=False)
            ):
                raise CheckpointError(
                    f"{dotted(path)} in {file}: a piece at {offsets} of shape "
                    f"{tuple(tensor.shape)} lies outside its {tuple(first.shape)} tensor: the "
                    "file is damaged."
                )
            pieces.setdefault((offsets, tuple(tensor.shape)), tensor)
    covered = sum(torch.Size(sizes).numel() for _, sizes in pieces)
    if covered != first.shape.numel():
        raise CheckpointError(
            f"{dotted(path)} in {location}: the ranks' pieces cover {covered} of its "
            f"{first.shape.numel()} elements: the files are not from one save, or damaged."
        )
    return sorted(pieces.items())


def check_one_save(records: Mapping[str, list[FlatParamRecord]], location: str) -> None:
    """Refuse per-rank files whose layout records (in their state dicts' _metadata) are of different saves or
    layouts, naming each file and its save. Each unit's records carry that unit's identity (save_identity.py), so the
    files are compared unit by unit. Files without records (torch's FSDP1, earlier versions) pass."""
    units = sorted({r.flat_key for found in records.values() for r in found})
    for flat_key in units:
        by_file = {
            file: next((r.save_id for r in found if r.flat_key == flat_key), None) for file, found in records.items()
        }
        if not any(by_file.values()):
            continue
        mixed = mixed_saves(by_file, location)
        if mixed:
            raise CheckpointError(
                mixed.replace("Restore the whole directory from one save.", "Pass every rank's file of one save.")
            )
    without_ids = {
        file: sorted((replace(r, save_id=None) for r in found), key=lambda r: r.flat_key)
        for file, found in records.items()
    }
    layouts = without_ids
    first = next(iter(layouts))
    for file, layout in layouts.items():
        if layout != layouts[first]:
            raise CheckpointError(
                f"{file} and {first} describe different flat-parameter layouts in their records: they are not from "
                "one save. Pass every rank's file of one save."
            )


def _identity(path: Path, saved: list[LocalShards]) -> Any:
    """What tells a tensor saved under several keys apart from another: its pieces' storages and places."""
    places = tuple(
        (offsets, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        for shards in saved
        for offsets, t in shards.pieces
        if t.numel()
    )
    return places or path
