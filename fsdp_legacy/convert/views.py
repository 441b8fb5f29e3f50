"""Checkpoints made of other checkpoints: the frameworks' layouts spread one checkpoint over several files, under
their own top-level keys, and these present them as one with the "model" and "optim" sections every writer expects.

* `Composite`: leaves of several opened checkpoints, each path renamed (or dropped) by a function of its own;
* `Tree`: a state dict already loaded (memory-mapped), for files whose keys need fixing before they are leaves (an
  optimizer state keyed by parameter index);
* `Prefixless`: a prefix taken off the model's keys and the optimizer's parameter names (a LightningModule's
  attribute, "model.", in front of a Hugging Face model's own names);
* `find_sections`: which top-level keys of a checkpoint hold the model state dict and the optimizer state, for
  layouts whose keys are the user's (Lightning Fabric's `fabric.save(path, {"net": model, "opt": optim})`).
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .checkpoint import Checkpoint, Chunk, Path, TensorMeta, dotted, flatten
from .errors import CheckpointError
from .seals import Seals, combined

Rename = Callable[[Path], Path | None]  # a path of a part -> its path in the composite, None to leave it out


class Composite(Checkpoint):
    def __init__(self, location: str, parts: Sequence[tuple[Checkpoint, Rename]]) -> None:
        self.location, self._parts = location, [part for part, _ in parts]
        self.leaves = {}
        self._origin: dict[Path, tuple[Checkpoint, Path]] = {}
        for part, rename in parts:
            for path, leaf in part.leaves.items():
                new = rename(path)
                if new is None:
                    continue
                if new in self.leaves:
                    raise CheckpointError(
                        f"{dotted(new)} is in both {self._origin[new][0].location} and {part.location}: the files "
                        "are from different saves, or the layout was not detected right (pass --from)."
                    )
                self.leaves[new], self._origin[new] = leaf, (part, path)

    def verify_seals(self) -> Seals:
        return combined(part.verify_seals() for part in self._parts)

    def read(self, path: Path) -> torch.Tensor:
        part, original = self._origin[path]
        return part.read(original)

    def read_flat(self, path: Path, start: int, stop: int) -> torch.Tensor:
        part, original = self._origin[path]
        return part.read_flat(original, start, stop)

    def chunks(self, path: Path) -> list[Chunk] | None:
        part, original = self._origin[path]
        return part.chunks(original)

    def close(self) -> None:
        for part in self._parts:
            part.close()


class Tree(Checkpoint):
    """A nested state dict (str keys) as a checkpoint; its tensors must be plain."""

    def __init__(self, location: str, tree: Mapping[str, Any], seals: Seals | None = None) -> None:
        """`seals`: what the reader that loaded `tree` checked of its file."""
        self.location, self._seals = location, seals or Seals()
        self._values = flatten(tree, location)
        for path, value in self._values.items():
            if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter):
                raise CheckpointError(f"{location}: {dotted(path)} is a {type(value).__name__}, not a plain tensor.")
        self.leaves = {p: TensorMeta.of(v) if isinstance(v, torch.Tensor) else v for p, v in self._values.items()}

    def verify_seals(self) -> Seals:
        return self._seals

    def read(self, path: Path) -> torch.Tensor:
        return self._values[path]


class Prefixless(Checkpoint):
    """`source` with `prefix` taken off every model key and optimizer parameter name that starts with it (the others
    are left as they are). The layout records, which name the parameters with it, are left out."""

    def __init__(self, source: Checkpoint, prefix: str) -> None:
        self.location, self._source, self._prefix = source.location, source, prefix
        self.leaves, self._origin = {}, {}
        for path, leaf in source.leaves.items():
            if path[0] == "layout":
                continue
            new = self._path(path)
            if new in self.leaves:
                raise CheckpointError(
                    f"{dotted(path)} in {source.location}: without the prefix {prefix!r} it is {dotted(new)}, which "
                    "the checkpoint also has. Choose another --strip-prefix."
                )
            if path[:2] == ("optim", "param_groups") and path[-1] == "params" and isinstance(leaf, list):
                leaf = [self._name(name) for name in leaf]
            self.leaves[new], self._origin[new] = leaf, path

    def _name(self, name: Any) -> Any:
        return name.removeprefix(self._prefix) if isinstance(name, str) else name

    def _path(self, path: Path) -> Path:
        if path[0] == "model" and len(path) > 1:
            return ("model", self._name(path[1]), *path[2:])
        if path[:2] == ("optim", "state") and len(path) > 2:
            return ("optim", "state", self._name(path[2]), *path[3:])
        return path

    def read(self, path: Path) -> torch.Tensor:
        return self._source.read(self._origin[path])

    def close(self) -> None:
        self._source.close()


def renamed(sections: Mapping[str, str]) -> Rename:
    """Keep the leaves under the given top-level keys, each moved under its new name."""

    def rename(path: Path) -> Path | None:
        new = sections.get(path[0]) if isinstance(path[0], str) else None
        return None if new is None else (new, *path[1:])

    return rename


def find_sections(checkpoint: Checkpoint, what: str) -> tuple[str | None, str | None]:
    """The top-level keys of the model state dict (every leaf under it a tensor, one level down) and of the optimizer
    state ({"state": ..., "param_groups": [...]}) in `checkpoint`; None where there is none. `what` names the layout
    in errors."""
    models, optimizers = [], []
    top: dict[str, list[Path]] = {}
    for path in checkpoint.leaves:
        if isinstance(path[0], str):
            top.setdefault(path[0], []).append(path)
    for key, paths in top.items():
        if all(len(p) == 2 and isinstance(checkpoint.leaves[p], TensorMeta) for p in paths):
            models.append(key)
        elif any(p[1:2] == ("param_groups",) for p in paths) and all(p[1] in ("state", "param_groups") for p in paths):
            optimizers.append(key)
    if len(models) > 1 or len(optimizers) > 1:
        raise CheckpointError(
            f"{checkpoint.location} ({what}) holds {len(models)} model state dicts ({', '.join(models)}) and "
            f"{len(optimizers)} optimizer states ({', '.join(optimizers)}): converting several into one checkpoint is "
            "not supported. Save one model and at most one optimizer per checkpoint."
        )
    return (models[0] if models else None), (optimizers[0] if optimizers else None)
