"""A checkpoint as leaves by path: what the readers produce, the flat-parameter views transform and the writers consume.

Paths and traversal are DCP's (dicts are walked with str keys, lists by index when they hold tensors or dicts, any
other value is one leaf), so `".".join(path)` is the key DCP stores. Tensor leaves are described by a `TensorMeta`
and read one at a time, which is what bounds a conversion's memory by the largest tensor.
"""

import abc
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CheckpointError
from .seals import Seals

Path = tuple[str | int, ...]
Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of one stored piece of a tensor


@dataclass(frozen=True)
class TensorMeta:
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return cls(tensor.shape, tensor.dtype)


class Checkpoint(abc.ABC):
    """An opened checkpoint: every leaf at once (`TensorMeta` for a tensor, the value itself otherwise), tensors
    on demand."""

    location: str  # named in every error
    leaves: dict[Path, Any]
    # Layout records of the model section's flat parameters kept outside the leaves (a state dict's _metadata, a DCP
    # side file), by flat key: FlatParamRecord (not typed here: record.py imports this module's neighbours).
    side_records: Mapping[str, Any] = {}

    @abc.abstractmethod
    def read(self, path: Path) -> torch.Tensor:
        """The tensor at `path` (a view of a memory map, or a new tensor: never modify it)."""

    def read_flat(self, path: Path, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor at `path`; readers override it to read less."""
        return self.read(path).reshape(-1)[start:stop]

    def chunks(self, path: Path) -> list[Chunk] | None:
        """How the tensor is stored in pieces (DCP), None where the format has no pieces."""
        return None

    def verify_seals(self) -> Seals:
        """Check every seal the writer put in the checkpoint (CRC-32s, save identities) against its bytes, raising
        CheckpointError naming the file and tensor of the first one broken; what was checked, and what carries no
        seal. Readers of stored formats override it; a view of another checkpoint passes it on."""
        return Seals()

    def tensors(self) -> Iterator[tuple[Path, TensorMeta]]:
        return ((path, leaf) for path, leaf in self.leaves.items() if isinstance(leaf, TensorMeta))

    def section(self, name: str) -> dict[str | int, Any]:
        """The leaves directly under a top-level key, by their second path element (`model` -> FQN -> leaf)."""
        return {path[1]: leaf for path, leaf in self.leaves.items() if len(path) == 2 and path[0] == name}

    def close(self) -> None:  # noqa: B027 (optional to override: most formats hold no open file)
        """Release open files; formats that keep none need not override it."""

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def dotted(path: Path) -> str:
    """DCP's key for a path, also how errors name it."""
    return ".".join(map(str, path))


def flatten(tree: Mapping[str, Any], where: str) -> dict[Path, Any]:
    """Leaves of a nested state dict by path, DCP's traversal."""
    leaves: dict[Path, Any] = {}

    def walk(path: Path, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise CheckpointError(
                        f"{where}: {dotted(path) or 'the top level'} has the key {key!r}; only str keys are supported "
                        "(DCP stores keys as strings). An optimizer state keyed by parameter ids comes from "
                        "optim.state_dict(): save FSDP.optim_state_dict(model, optim) instead, which is keyed by FQN."
                    )
                walk((*path, key), item)
        elif isinstance(value, list) and not _is_leaf(value):
            for index, item in enumerate(value):
                walk((*path, index), item)
        else:
            leaves[path] = value

    walk((), tree)
    return leaves


def _is_leaf(value: list) -> bool:
    return not any(isinstance(v, (Mapping, torch.Tensor)) or (isinstance(v, list) and not _is_leaf(v)) for v in value)


def unflatten(leaves: Mapping[Path, Any]) -> dict[str, Any]:
    """The nested state dict of `leaves` (int path elements are list indices, in order)."""
    root: dict[str, Any] = {}
    for path, value in leaves.items():
        node: Any = root
        for key, child in itertools.pairwise(path):
            if isinstance(node, list) and key == len(node):
                node.append([] if isinstance(child, int) else {})
            elif isinstance(node, dict) and key not in node:
                node[key] = [] if isinstance(child, int) else {}
            node = node[key]
        if isinstance(node, list):
            node.append(value)
        else:
            node[path[-1]] = value
    return root
