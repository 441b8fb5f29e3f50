"""Hugging Face's safetensors layout as a conversion target (and source): a directory of `model.safetensors`, or of
`model-0000i-of-0000N.safetensors` files and `model.safetensors.index.json`, holding the model's tensors under their
FQNs, as save_pretrained writes them. Model weights only: it has no place for an optimizer state.

Writing streams: each file's header is written first, then every tensor is read from the source, cast (floating
tensors only, with `dtype`) and written at its offset, one tensor at a time; the directory appears atomically, and
each file and the index carry the save's identity. Reading takes every file's header, checked against the file (as
the safetensors package checks it: no tensor past the end or over another's bytes), the index, checked against the
headers, and the files' save identities (one save), and reads a tensor's bytes on demand.
"""

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from ..safetensors_format import (
    DTYPES,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    SAVE_ID,
    TENSOR_CRC32,
    SafetensorsHeader,
    SafetensorsWriter,
    mixed_saves,
    new_save_id,
    parse_size,
    plan_shards,
    read_safetensors_header,
    shard_names,
    write_index,
)
from .atomic import atomic_directory
from .checkpoint import Checkpoint, Path, TensorMeta, dotted
from .errors import CheckpointError
from .seals import Seals


def is_safetensors_directory(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, n)) for n in (SAFE_WEIGHTS, SAFE_INDEX))


class ModelWeights(Checkpoint):
    """The tensors of a checkpoint's model section, floating ones cast to `dtype` (None: as they are): what a
    safetensors directory holds of it."""

    def __init__(self, source: Checkpoint, dtype: torch.dtype | None = None) -> None:
        self.location, self._source, self._dtype = source.location, source, dtype
        self.leaves = {}
        for path, leaf in source.leaves.items():
            if path[0] != "model":
                continue
            if len(path) != 2 or not isinstance(leaf, TensorMeta):
                raise CheckpointError(
                    f"{dotted(path)} in {source.location} is a {type(leaf).__name__}, not a tensor: a safetensors file "
                    "holds tensors only. Convert to --to full or dcp instead."
                )
            self.leaves[path] = TensorMeta(leaf.shape, self._cast(leaf.dtype))
        if not self.leaves:
            raise CheckpointError(
                f"{source.location} has no model tensors to write (only an optimizer state, or nothing): safetensors "
                "holds model weights."
            )

    def _cast(self, dtype: torch.dtype) -> torch.dtype:
        return self._dtype if self._dtype is not None and dtype.is_floating_point else dtype

    def read(self, path: Path) -> torch.Tensor:
        tensor = self._source.read(path)
        return tensor.to(self.leaves[path].dtype)

    def close(self) -> None:
        self._source.close()


def write_safetensors(
    source: Checkpoint,
    destination: str,
    max_shard_size: int | str,
    on_tensor: Callable[[Path, int], None],
    before_commit: Callable[[str], None] | None = None,
) -> None:
    """Write the model section of `source` (tensors by FQN, as ModelWeights gives it) in Hugging Face's layout at
    `destination`, atomically, holding one tensor in memory at a time; `before_commit(temporary directory)` runs once
    it is complete, before it replaces `destination`."""
    try:
        max_size = parse_size(max_shard_size)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    tensors = [(path, leaf) for path, leaf in source.tensors()]
    for path, leaf in tensors:
        if leaf.dtype not in DTYPES:
            raise CheckpointError(
                f"{dotted(path)} in {source.location} is {leaf.dtype}, which safetensors cannot store: pass "
                "--dtype, or convert to --to full or dcp."
            )
    groups = plan_shards([leaf.nbytes for _, leaf in tensors], max_size)
    names = shard_names(len(groups), SAFE_WEIGHTS)
    save_id = new_save_id()  # in every file and the index: a directory mixed from two saves is refused on reading
    with atomic_directory(destination) as temporary:
        for group, name in zip(groups, names, strict=True):
            chosen = [tensors[i] for i in group]
            writer = SafetensorsWriter(
                os.path.join(temporary, name),
                [(str(path[1]), leaf.shape, leaf.dtype) for path, leaf in chosen],
                {SAVE_ID: save_id},
                checksum=True,
            )
            try:
                for path, leaf in chosen:
                    writer.write(str(path[1]), 0, source.read(path))
                    on_tensor(path, leaf.nbytes)
                writer.seal()
            finally:
                writer.close()
        if len(groups) > 1:
            weight_map = {str(tensors[i][0][1]): name for group, name in zip(groups, names, strict=True) for i in group}
            total = sum(leaf.nbytes for _, leaf in tensors)
            write_index(os.path.join(temporary, SAFE_INDEX), weight_map, {"total_size": total, SAVE_ID: save_id})
        if before_commit is not None:
            before_commit(temporary)


class SafetensorsDirectory(Checkpoint):
    def __init__(self, directory: str) -> None:
        self.location = directory
        if not is_safetensors_directory(directory):
            raise CheckpointError(f"{directory} holds neither {SAFE_WEIGHTS} nor {SAFE_INDEX}.")
        index_path = os.path.join(directory, SAFE_INDEX)
        weight_map: dict[str, str] | None = None
        index_save_id: str | None = None
        if os.path.isfile(index_path):
            weight_map, index_save_id = _read_index(index_path)
            files = sorted(set(weight_map.values()))
        else:
            files = [SAFE_WEIGHTS]
        self.leaves: dict[Path, Any] = {}
        self._where: dict[Path, tuple[str, int, int]] = {}  # file, first byte, byte count
        self._headers: dict[str, SafetensorsHeader] = {}
        save_ids = {name: self._add_file(name) for name in files}
        if weight_map is not None:
            save_ids[SAFE_INDEX] = index_save_id
        mixed = mixed_saves(save_ids, directory)
        if mixed is not None:
            raise CheckpointError(mixed)
        if weight_map is not None and weight_map != {str(p[1]): self._where[p][0] for p in self._where}:
            raise CheckpointError(
                f"{index_path} does not list the tensors its files hold (or names other files for them): the "
                "directory is incomplete or was edited. Restore it from a copy."
            )

    def _add_file(self, name: str) -> str | None:
        """Add the tensors of one file; returns its save identity."""
        path = os.path.join(self.location, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}, named in the index, is missing: copy every file of the directory.")
        try:
            header = read_safetensors_header(path)  # (its header seal checked, where it has one)
        except ValueError as error:
            raise CheckpointError(f"{error}. Restore it from a copy.") from None
        self._headers[name] = header
        for key, stored in header.tensors.items():
            if ("model", key) in self.leaves:
                raise CheckpointError(f"{key} is in two files of {self.location}: the directory mixes saves.")
            self.leaves[("model", key)] = TensorMeta(stored.shape, stored.dtype)
            self._where[("model", key)] = (name, stored.start, stored.nbytes)
        return header.save_id

    def verify_seals(self) -> Seals:
        """Every file's data against the CRC-32s in its header (each tensor's, where recorded)."""
        for name, header in self._headers.items():
            problem = header.data_crc_problem(os.path.join(self.location, name))
            if problem is not None:
                raise CheckpointError(f"{problem}. Restore it from a copy.")
        headers = self._headers.values()
        verified, unverified = [], []
        if all(h.data_sealed for h in headers):
            per_tensor = all(TENSOR_CRC32 in h.metadata for h in headers)
            verified.append(f"CRC-32 of {'every tensor' if per_tensor else 'every file'}'s data (in its header)")
        else:
            unverified.append(
                "the tensor data carries no checksum (written by save_pretrained, another tool or an earlier "
                "fsdp_legacy): a flipped bit there is not seen"
            )
        if all(h.header_sealed for h in headers):
            verified.append("CRC-32 of every header (names, dtypes, shapes, offsets)")
        else:
            unverified.append(
                "header-unsealed: tensor names, dtypes and shapes are checked against the file sizes only"
            )
        if all(h.save_id for h in headers):
            verified.append("one save (save identities)")
        return Seals(tuple(verified), tuple(unverified))

    def read(self, path: Path) -> torch.Tensor:
        name, start, count = self._where[path]
        meta = self.leaves[path]
        buffer = bytearray(count)
        with open(os.path.join(self.location, name), "rb") as file:
            file.seek(start)
            if file.readinto(buffer) != count:
                raise CheckpointError(f"{name} in {self.location} ends inside {dotted(path)}: it is truncated.")
        if not count:
            return torch.empty(meta.shape, dtype=meta.dtype)
        return torch.frombuffer(buffer, dtype=meta.dtype).view(meta.shape)


def _read_index(path: str) -> tuple[dict[str, str], str | None]:
    """The index's weight map and save identity."""
    try:
        with open(path) as file:
            index = json.load(file)
        weight_map, metadata = index["weight_map"], index.get("metadata") or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{path} is not a safetensors index ({error}): restore it from a copy.") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path}: its weight_map is not a map of tensor names to file names.")
    return weight_map, metadata.get(SAVE_ID) if isinstance(metadata, dict) else None
