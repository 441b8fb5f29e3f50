"""One torch.save file as a checkpoint: {"model": {fqn: tensor}, "optim": {"state": ..., "param_groups": ...}, ...}
(a bare model state dict is read as its "model" section).

Reading memory-maps the file, so a tensor costs memory only while it is copied. Writing streams too: torch.save lays
the archive out with every tensor's space reserved but not written (`skip_data`, with fake tensors that allocate
nothing), the archive is memory-mapped shared and each tensor is copied in from the source in turn, then the CRC-32s
torch.save wrote for the empty space are recomputed.
"""

import mmap
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .atomic import atomic_file
from .checkpoint import Checkpoint, Path, TensorMeta, flatten, unflatten
from .errors import CheckpointError
from .integrity import check_archive, rewrite_crcs
from .loading import safe_load
from .seals import ARCHIVE, Seals


def load_tree(path: str) -> Mapping:
    """A full torch.save file's dict, weights_only and memory-mapped (no tensor data read yet); a bare model state
    dict comes as {"model": ...}."""
    tree = safe_load(path, path, mmap=True)
    if not isinstance(tree, Mapping):
        raise CheckpointError(
            f"{path} holds a {type(tree).__name__}, not a state dict: expected a dict such as "
            '{"model": model_state_dict, "optim": optim_state_dict} or a model state dict.'
        )
    if "model" not in tree and tree and all(isinstance(v, torch.Tensor) for v in tree.values()):
        tree = {"model": tree}  # torch.save(model.state_dict())
    return tree


class TorchFile(Checkpoint):
    def __init__(self, path: str) -> None:
        self.location = path
        with open(path, "rb") as file:
            check_archive(file, path)
        self._values = flatten(load_tree(path), path)
        for key, value in self._values.items():
            if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter):
                raise CheckpointError(
                    f"{path}: {'.'.join(map(str, key))} is a {type(value).__name__}; a full "
                    "checkpoint holds plain tensors (save a FULL_STATE_DICT)."
                )
        self.leaves = {k: TensorMeta.of(v) if isinstance(v, torch.Tensor) else v for k, v in self._values.items()}

    def verify_seals(self) -> Seals:
        return Seals((ARCHIVE,))  # (checked on opening)

    def read(self, path: Path) -> torch.Tensor:
        return self._values[path]


def write_torch_file(
    source: Checkpoint,
    destination: str,
    on_tensor: Callable[[Path, int], None],
    before_commit: Callable[[str], None] | None = None,
) -> None:
    """Write `source` as one torch.save file, atomically, holding one source tensor in memory at a time;
    `before_commit(temporary path)` runs once the file is complete, before it replaces `destination`. A write that
    fails (a full disk) raises OSError."""
    with atomic_file(destination) as temporary:
        with FakeTensorMode():
            placeholders = {
                path: torch.empty(leaf.shape, dtype=leaf.dtype) if isinstance(leaf, TensorMeta) else leaf
                for path, leaf in source.leaves.items()
            }
        try:
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                torch.save(unflatten(placeholders), temporary)
        except RuntimeError as error:  # torch's archive writer reports a short write this way ("unexpected pos")
            raise OSError(f"torch.save could not write the archive ({error})") from error
        del placeholders
        _reserve(temporary)
        targets = flatten(_map_shared(temporary), temporary)
        for path, leaf in source.tensors():
            targets[path].copy_(source.read(path))
            on_tensor(path, leaf.nbytes)
        del targets  # unmaps: the data is in the page cache, flushed by the fsync of atomic_file
        rewrite_crcs(temporary)
        if before_commit is not None:
            before_commit(temporary)


def _reserve(path: str) -> None:
    """Allocate the space skip_data left as a hole: a write through the memory map into a hole the disk has no room
    for kills the process (SIGBUS); allocating first makes a full disk an ENOSPC error here instead."""
    if hasattr(os, "posix_fallocate"):
        descriptor = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(descriptor, 0, os.fstat(descriptor).st_size)
        finally:
            os.close(descriptor)


def _map_shared(path: str) -> Any:
    """torch.load with a shared memory map: writes to the tensors go to the file. (The mmap option is process-wide,
    hence restored at once.)"""
    previous = torch.serialization.get_default_mmap_options()
    torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)
    try:
        return safe_load(path, path, mmap=True)
    finally:
        torch.serialization.set_default_mmap_options(previous if previous is not None else mmap.MAP_PRIVATE)
