"""verl's FSDP checkpoints (verl/utils/checkpoint/fsdp_checkpoint_manager.py) as one checkpoint. Every rank saves,
into one directory (`global_step_N/actor/`):

    model_world_size_{W}_rank_{r}.pt        model.state_dict(): torch's FSDP1 under SHARDED_STATE_DICT (a ShardedTensor
                                            per parameter) or FSDP2 (a DTensor per parameter)
    optim_world_size_{W}_rank_{r}.pt        optimizer.state_dict(): the optimizer's own state, keyed by parameter index
    extra_state_world_size_{W}_rank_{r}.pt  the LR scheduler's and RNG states (not converted)

The model is assembled from every rank's pieces by their global offsets (rank_files.RankFiles: the restricted
unpickler, no process group). The optimizer's own state dict names no parameter; its index i is the i-th parameter
of model.parameters(), which is the i-th distinct ShardedTensor / DTensor of the model files (buffers are plain
tensors there). What each rank holds of parameter i:
  * FSDP2: a DTensor, placed by its own spec, as the parameter is;
  * FSDP1 with use_orig_params=True: the 1-D piece of the flattened parameter in that rank's shard of its unit's flat
    parameter (or nothing): a parameter is one run of its flat parameter, so its pieces in rank order are it, whole;
  * FSDP1 with use_orig_params=False (verl's default): index i is the i-th flat parameter (the units in module
    order), each rank holding its padded shard. Which parameters a flat parameter holds is not in the files: it comes
    from layout records (`layout_from`, a LOCAL checkpoint of the same model and wrapping saved by fsdp_legacy).
"""

import hashlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .checkpoint import Checkpoint, Path, TensorMeta, dotted, flatten
from .errors import CheckpointError
from .integrity import check_archive
from .loading import LocalShards, load_rank_file
from .optim_keys import index_names
from .rank_files import RankFiles, assemble
from .record import FlatParamRecord
from .seals import Seals

VERL_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def verl_files(source: str | Sequence[str]) -> dict[str, dict[int, str]]:
    """{"model" | "optim" | "extra_state": {rank: path}} of the files `source` names (a directory or a list); the
    world size in every name must be the same."""
    if isinstance(source, str):
        names = sorted(os.listdir(source)) if os.path.isdir(source) else []
        paths = [os.path.join(source, name) for name in names]
    else:
        paths = list(source)
    found: dict[str, dict[int, str]] = {}
    sizes: set[int] = set()
    for path in paths:
        match = VERL_FILE.match(os.path.basename(path))
        if match is not None:
            kind, world_size, rank = match.group(1), int(match.group(2)), int(match.group(3))
            sizes.add(world_size)
            found.setdefault(kind, {})[rank] = path
    if len(sizes) > 1:
        raise CheckpointError(
            f"{source} holds verl files of several world sizes ({sorted(sizes)}): the directory mixes saves. Keep the "
            "files of one save."
        )
    for kind, ranks in found.items():
        missing = sorted(set(range(next(iter(sizes)))) - set(ranks))
        if missing:
            raise CheckpointError(
                f"{source}: the {kind} file of rank(s) {missing} is missing (every one of the "
                f"{next(iter(sizes))} ranks saves {kind}_world_size_{next(iter(sizes))}_rank_<r>.pt). Copy every "
                "rank's file."
            )
    return found


def is_verl(source: str | Sequence[str]) -> bool:
    if isinstance(source, str) and not os.path.isdir(source):
        return False
    names = os.listdir(source) if isinstance(source, str) else [os.path.basename(p) for p in source]
    return any((m := VERL_FILE.match(n)) is not None and m.group(1) == "model" for n in names)


def clean_fqn(name: str) -> str:
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


class VerlCheckpoint(Checkpoint):
    def __init__(
        self, source: str | Sequence[str], layout: Mapping[str, FlatParamRecord] | None = None, optimizer: bool = True
    ) -> None:
        self.location = source if isinstance(source, str) else os.path.commonpath([os.path.abspath(p) for p in source])
        files = verl_files(source)
        if "model" not in files:
            raise CheckpointError(
                f"{self.location} has no model_world_size_<W>_rank_<r>.pt files: not a verl checkpoint."
            )
        ranks = files["model"]
        self._model = RankFiles([ranks[r] for r in sorted(ranks)], self.location)
        if self._model.world_size != len(ranks):
            self._model.close()
            raise CheckpointError(
                f"{self.location}: the model files are named for {len(ranks)} ranks but their tensors were saved by "
                f"{self._model.world_size}: the files were renamed or mixed. Keep the files of one save."
            )
        self.leaves: dict[Path, Any] = {}
        self._origin: dict[Path, Path] = {}
        for path, leaf in self._model.leaves.items():
            if path[0] != "model" or not isinstance(path[1], str):
                continue
            clean = ("model", clean_fqn(path[1]), *path[2:])
            if clean in self.leaves:
                raise CheckpointError(f"{self.location}: {dotted(path)} and another key are both {dotted(clean)}.")
            self.leaves[clean], self._origin[clean] = leaf, path
        self._optim: dict[Path, Callable[[], torch.Tensor]] = {}
        if "optim" in files and optimizer:
            optim = files["optim"]
            try:
                _Optimizer(self, [optim[r] for r in sorted(optim)], layout or {}).add()
            except BaseException:
                self._model.close()
                raise

    def read(self, path: Path) -> torch.Tensor:
        if path in self._optim:
            return self._optim[path]()
        return self._model.read(self._origin[path])

    def verify_seals(self) -> Seals:
        optimizer = Seals(("CRC-32s of every optimizer file's torch.save archive",)) if self._optim else Seals()
        return self._model.verify_seals() + optimizer

    def close(self) -> None:
        self._model.close()


class _Optimizer:
    """The per-rank optimizer.state_dict() files, added to a VerlCheckpoint as its "optim" section keyed by FQN."""

    def __init__(self, owner: VerlCheckpoint, files: list[str], layout: Mapping[str, FlatParamRecord]) -> None:
        self.owner, self.files, self.layout = owner, files, layout
        self.raws = [self._load(file) for file in files]
        self.names = [clean_fqn(str(path[1])) for path in owner._model.sharded]  # parameter i, by index
        self.shapes = {name: owner.leaves[("model", name)].shape for name in self.names}

    def _load(self, file: str) -> Mapping[str, Any]:
        with open(file, "rb") as handle:
            check_archive(handle, file)
        raw = load_rank_file(file)  # DTensors (FSDP2) need the restricted loader; plain tensors load the same
        if not (
            isinstance(raw, Mapping)
            and isinstance(raw.get("state"), Mapping)
            and isinstance(raw.get("param_groups"), list)
        ):
            raise CheckpointError(f"{file} is not an optimizer.state_dict() ({{'state': ..., 'param_groups': ...}}).")
        return raw

    def add(self) -> None:
        where, groups = self.files[0], self.raws[0]["param_groups"]
        count = sum(len(group["params"]) for group in groups)
        if count < len(self.names):
            self.names = self._untied(count)
        if self._per_parameter(count):
            names = index_names(self.raws[0], self.names, where, _HINT)
            expanded = {index: [name] for index, name in names.items()}
            for index, name in names.items():
                self._parameter(index, name)
        else:
            expanded = self._flat(count, where)
        groups = [{**g, "params": [n for index in g["params"] for n in expanded[index]]} for g in groups]
        for path, value in flatten({"optim": {"param_groups": groups}}, where).items():
            self.owner.leaves[path] = value

    def _untied(self, count: int) -> list[str]:
        """The parameters less tied duplicates, for torch's FSDP1, which saves a tied parameter under each of its
        names as a tensor of its own: a later entry equal to an earlier one (shape, dtype and every bit) is taken
        for a tie when exactly as many such entries as the optimizer lacks exist, so no untied parameter can be
        dropped (ties are among them); otherwise the names are left as they are and the index match refuses."""
        seen: dict[tuple, str] = {}
        duplicates = []
        kinds = [(tuple(self.shapes[n]), self.owner.leaves[("model", n)].dtype) for n in self.names]
        for name, kind in zip(self.names, kinds, strict=True):
            if kinds.count(kind) < 2:
                continue
            tensor = self.owner.read(("model", name)).contiguous().reshape(-1).view(torch.uint8)
            digest = (kind, hashlib.sha256(tensor.numpy().data).digest())
            if digest in seen:
                duplicates.append(name)
            else:
                seen[digest] = name
        if len(self.names) - len(duplicates) != count:
            return self.names
        return [name for name in self.names if name not in duplicates]

    def _states(self, index: int) -> list[tuple[str, Mapping[str, Any]]]:
        return [
            (file, raw["state"][index])
            for file, raw in zip(self.files, self.raws, strict=True)
            if index in raw["state"]
        ]

    def _per_parameter(self, count: int) -> bool:
        """Whether the state is per parameter: DTensors (FSDP2), or 1-D pieces adding up to each parameter (FSDP1 with
        use_orig_params); else it is FSDP1's flat parameters' shards."""
        states = [state for raw in self.raws for state in raw["state"].values()]
        if any(isinstance(value, LocalShards) for state in states for value in state.values()):
            return True
        if count != len(self.names):
            return False
        for index, name in enumerate(self.names):
            totals: dict[str, int] = {}
            for _, state in self._states(index):
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() == 1:
                        totals[key] = totals.get(key, 0) + value.numel()
            if any(total != self.shapes[name].numel() for total in totals.values()):
                return False
        return True

    def _parameter(self, index: int, name: str) -> None:
        states = self._states(index)
        keys = list(dict.fromkeys(key for _, state in states for key in state))
        for key in keys:
            path: Path = ("optim", "state", name, key)
            values = [(file, state[key]) for file, state in states if key in state]
            first = values[0][1]
            if isinstance(first, LocalShards):
                if first.shape != self.shapes[name] and len(first.shape):
                    raise CheckpointError(
                        f"{values[0][0]}: matched by its index, the optimizer state {key} of {name} has the shape "
                        f"{tuple(first.shape)} but the parameter {tuple(self.shapes[name])}: the indices do not follow "
                        "the model's parameters (the optimizer was given them in another order). " + _HINT
                    )
                pieces = assemble(path, values, self.owner.location)
                self._add(path, TensorMeta(first.shape, first.dtype), _filler(first.shape, first.dtype, pieces))
            elif isinstance(first, torch.Tensor) and first.dim() == 1:  # FSDP1 use_orig_params: runs, in rank order
                parts = [value for _, value in values]
                self._add(path, TensorMeta(self.shapes[name], first.dtype), _joined(parts, self.shapes[name]))
            else:
                self._leaf(path, first)

    def _flat(self, count: int, where: str) -> dict[int, list[str]]:
        """FSDP1 without use_orig_params: index k is the k-th flat parameter, laid out by the layout records."""
        world_size = len(self.files)
        if not self.layout:
            raise CheckpointError(
                f"{where} holds the optimizer state of torch FSDP1's flat parameters (use_orig_params=False: "
                f"{count} of them), which do not say which parameters they hold. " + _HINT
            )
        records = _unit_order(self.layout.values(), [str(p[1]) for p in self.owner.leaves if p[0] == "model"])
        if len(records) != count:
            raise CheckpointError(
                f"{where}: the optimizer has {count} flat parameters but the layout (--layout-from) describes "
                f"{len(records)}: it is not of this model and wrapping. Use a layout saved with the same wrapping."
            )
        expanded: dict[int, list[str]] = {}
        for index, record in enumerate(records):
            record = record.at_world_size(world_size)
            expanded[index] = [record.prefix + param.fqn for param in record.params]
            for param in record.params:
                name = record.prefix + param.fqn
                if name not in self.shapes or tuple(self.shapes[name]) != tuple(param.shape):
                    raise CheckpointError(
                        f"{where}: the layout's {name} {tuple(param.shape)} is not a parameter of the model files: "
                        "the layout (--layout-from) is of another model."
                    )
            states = [state for _, state in self._states(index)]
            if states and len(states) != world_size:
                raise CheckpointError(
                    f"{where}: flat parameter {index} ({record.flat_key}) has optimizer state on {len(states)} of the "
                    f"{world_size} ranks: the files are not from one save."
                )
            for key in dict.fromkeys(key for state in states for key in state):
                shards = [state.get(key) for state in states]
                if not all(isinstance(s, torch.Tensor) and s.dim() == 1 for s in shards):
                    for name in expanded[index]:  # a step count: one for the whole flat parameter
                        self._leaf(("optim", "state", name, key), shards[0])
                    continue
                tensors = [s for s in shards if isinstance(s, torch.Tensor)]
                sizes = [tensor.numel() for tensor in tensors]
                if any(size != record.shard_numel for size in sizes):
                    raise CheckpointError(
                        f"{where}: {key} of flat parameter {index} ({record.flat_key}) has {sizes} elements per rank, "
                        f"but {record.shard_numel} by the layout: the layout (--layout-from) is not of this model."
                    )
                for param in record.params:
                    name = record.prefix + param.fqn
                    reader = _flat_reader(tensors, record.shard_numel, param.offset, param.numel, self.shapes[name])
                    self._add(("optim", "state", name, key), TensorMeta(self.shapes[name], tensors[0].dtype), reader)
        return expanded

    def _add(self, path: Path, meta: TensorMeta, reader: Callable[[], torch.Tensor]) -> None:
        self.owner.leaves[path], self.owner._optim[path] = meta, reader

    def _leaf(self, path: Path, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self._add(path, TensorMeta.of(value), _joined([value], value.shape))
        else:
            self.owner.leaves[path] = value


_HINT = (
    "Pass --layout-from (layout_from=) a LOCAL checkpoint of the same model and wrapping saved by fsdp_legacy (any "
    "world size), or convert the model alone (--model-only, or pass the model files only: "
    "'DIR/model_world_size_*_rank_*.pt')."
)


def _filler(shape: torch.Size, dtype: torch.dtype, pieces: list) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        for (offsets, sizes), tensor in pieces:
            out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].copy_(tensor)
        return out

    return read


def _joined(parts: list[torch.Tensor], shape: torch.Size) -> Callable[[], torch.Tensor]:
    """The pieces of a flattened tensor, in order, as one of `shape`."""
    return lambda: (torch.cat(parts) if len(parts) > 1 else parts[0]).reshape(shape)


def _flat_reader(
    shards: list[torch.Tensor], shard_numel: int, offset: int, numel: int, shape: torch.Size
) -> Callable[[], torch.Tensor]:
    """Elements [offset, offset + numel) of the flat parameter whose rank r holds [r * shard_numel, ...)."""

    def read() -> torch.Tensor:
        parts = []
        for rank, shard in enumerate(shards):
            lo, hi = max(offset, rank * shard_numel), min(offset + numel, (rank + 1) * shard_numel)
            if lo < hi:
                parts.append(shard[lo - rank * shard_numel : hi - rank * shard_numel])
        return torch.cat(parts).view(shape)

    return read


def _unit_order(records: Any, keys: list[str]) -> list[FlatParamRecord]:
    """The flat parameters in the order model.parameters() yields them: units in module (pre)order, which is the order
    of their first state-dict key, an enclosing unit (shorter prefix) before a nested one starting at the same key."""
    position = {}
    for record in records:
        first = next((i for i, key in enumerate(keys) if key.startswith(record.prefix)), len(keys))
        position[record.flat_key] = (first, len(record.prefix), record.flat_key)
    return sorted(records, key=lambda record: position[record.flat_key])
