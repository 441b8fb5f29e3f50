"""Between a LOCAL checkpoint's flat parameters and the original parameters by FQN, driven by layout records.

`Unflattened` shows a LOCAL checkpoint as full and DCP checkpoints are (every original parameter under its FQN); its
records move to a `layout` section, which travels along so the way back needs no model code either. `Flattened` is
the reverse, for a layout at any world size: each flat parameter is assembled from its parameters, alignment padding
filled with torch's value. Everything else (buffers, parameters outside FSDP units, the optimizer state, which is
keyed by FQN in every format) passes through unchanged.
"""

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch

from ..flat_param import PADDING_VALUE
from .checkpoint import Checkpoint, Chunk, Path, TensorMeta
from .errors import CheckpointError
from .record import LAYOUT_KEYS_ENV, RECORD_SUFFIX, FlatParamRecord, ParamRecord, is_flat_key, is_record_key
from .side_file import SIDE_FILE

LAYOUT = "layout"  # the top-level section that carries records through full and DCP checkpoints


def records_in(checkpoint: Checkpoint) -> dict[str, FlatParamRecord]:
    """The layout records a checkpoint carries (outside its keys: a state dict's _metadata, a DCP side file; or as
    tensors of earlier versions beside LOCAL flat parameters, or in its layout section), by flat key."""
    found: dict[str, FlatParamRecord] = dict(checkpoint.side_records)
    for section in ("model", LAYOUT):
        for key, leaf in checkpoint.section(section).items():
            if is_record_key(key) and isinstance(leaf, TensorMeta):
                where = f"{section}.{key} in {checkpoint.location}"
                record = FlatParamRecord.from_tensor(checkpoint.read((section, key)), where)
                if record.record_key != key:
                    raise CheckpointError(
                        f"{where} is the record of {record.flat_key}, not of the key it is stored "
                        "under: the checkpoint was edited inconsistently. Restore it from a copy."
                    )
                found[record.flat_key] = record
    return found


def no_layout_message(where: str) -> str:
    """Why a flat parameter without a layout record cannot be read, and the ways to give its layout."""
    return (
        f"{where} is a flat parameter without a layout record, so which parameters it holds is unknown. "
        "fsdp_legacy keeps the record in the state dict's _metadata (which torch.save keeps), and in a "
        f"DCP directory's {SIDE_FILE} when saved through fsdp_legacy.dcp_checkpoint.save; this checkpoint "
        "was saved by torch's FSDP1, by a plain dcp.save, or from a copy of the state dict without its "
        "_metadata. Pass --layout-from (layout_from=) a checkpoint of the same model and wrapping saved by "
        "fsdp_legacy at any world size, or the model's code (--layout-from pkg.mod:factory --wrap "
        "pkg.mod.Layer); or save with fsdp_legacy.dcp_checkpoint.save (or "
        f"{LAYOUT_KEYS_ENV}=1, which adds the records as <flat key>{RECORD_SUFFIX} tensors) next time."
    )


def is_local(checkpoint: Checkpoint) -> bool:
    """Whether the model section has flat parameters (or records of them)."""
    return any(is_flat_key(key) or is_record_key(key) for key in checkpoint.section("model"))


class Unflattened(Checkpoint):
    """A LOCAL checkpoint by original FQN. `layout` supplies records for flat parameters saved without one (by
    torch's FSDP1), taken from another checkpoint of the same model and wrapping, at any world size."""

    def __init__(self, source: Checkpoint, layout: Mapping[str, FlatParamRecord] | None = None) -> None:
        self.location, self._source = source.location, source
        model = source.section("model")
        own = records_in(source)
        flats = [key for key in model if is_flat_key(key)]
        for key in own.keys() - set(flats):
            raise CheckpointError(
                f"{source.location} has the layout record model.{key}{RECORD_SUFFIX} but no flat "
                f"parameter model.{key}: the checkpoint is incomplete or was edited."
            )
        self._records = {key: self._record(key, model[key], own.get(key), layout or {}) for key in flats}
        self._params: dict[Path, tuple[Path, ParamRecord]] = {}  # parameter's path -> (flat path, its place)
        managed: dict[str, list[Path]] = {}  # flat key -> its parameters' paths (tied ones included)
        for key, record in self._records.items():
            stored = {p.fqn: p for p in record.params}
            pairs = [(p.fqn, p) for p in record.params] + [(fqn, stored[primary]) for fqn, primary in record.shared]
            for fqn, param in pairs:
                self._params[("model", record.prefix + fqn)] = (("model", key), param)
            managed[key] = [("model", record.prefix + fqn) for fqn, _ in pairs]
        self.leaves = {}
        for path, leaf in source.leaves.items():
            flat_key = path[1] if len(path) == 2 and path[0] == "model" else None
            if isinstance(flat_key, str) and flat_key in self._records:
                dtype = self._records[flat_key].dtype
                self.leaves.update(
                    (p, TensorMeta(torch.Size(self._params[p][1].shape), dtype)) for p in managed[flat_key]
                )
            elif path in self._params or path[0] == LAYOUT or is_record_key(flat_key):
                continue  # use_orig_params' per-rank views, and the records (now in the layout section)
            else:
                self.leaves[path] = leaf
        self._layout = {(LAYOUT, r.record_key): r.to_tensor() for r in self._records.values()}
        self.leaves.update((path, TensorMeta.of(t)) for path, t in self._layout.items())

    def _record(self, key: str, leaf: Any, own: FlatParamRecord | None, layout: Mapping) -> FlatParamRecord:
        where = f"model.{key} in {self.location}"
        if not isinstance(leaf, TensorMeta) or len(leaf.shape) != 1:
            raise CheckpointError(f"{where} is not a 1-D tensor, so not a flat parameter of a LOCAL_STATE_DICT.")
        chunks = self._source.chunks(("model", key))
        record = own
        if record is None:
            if key not in layout:
                raise CheckpointError(no_layout_message(where))
            # The flat parameter's world size, from the chunks the ranks saved: ceil(numel / shard numel).
            world_size = -(-leaf.shape[0] // max(s[0] for _, s in chunks)) if chunks else layout[key].world_size
            record = layout[key].at_world_size(world_size)
        if (record.numel, record.dtype) != (leaf.shape[0], leaf.dtype):
            raise CheckpointError(
                f"{where} holds {leaf.shape[0]} {leaf.dtype} elements but its layout record describes "
                f"{record.numel} {record.dtype} elements: the record belongs to another model, wrapping or world "
                "size. Use a layout from a checkpoint of this model."
            )
        if chunks is not None and len(chunks) > 1 and sorted(chunks) != [((o,), (n,)) for o, n in record.rank_chunks()]:
            raise CheckpointError(
                f"{where} is stored in chunks {[(c[0][0], c[1][0]) for c in chunks]} (offset, numel) but its layout "
                f"record says it was saved at world size {record.world_size}, in chunks "
                f"{record.rank_chunks()}: the record and the data come from different saves. Re-save the checkpoint."
            )
        return record

    def read(self, path: Path) -> torch.Tensor:
        if path in self._params:
            flat, param = self._params[path]
            return param.unflatten(self._source.read_flat(flat, param.offset, param.offset + param.numel))
        if path in self._layout:
            return self._layout[path]
        return self._source.read(path)

    def close(self) -> None:
        self._source.close()


class Flattened(Checkpoint):
    """A checkpoint by FQN as a LOCAL one laid out by `records`: flat parameters in the model section, stored in one
    chunk per rank, their records in `side_records`."""

    def __init__(self, source: Checkpoint, records: Iterable[FlatParamRecord]) -> None:
        self.location, self._source = source.location, source
        self._records: dict[Path, FlatParamRecord] = {("model", r.flat_key): r for r in records}
        # The records travel outside the keys (the writer's side file), as a LOCAL state dict's do.
        self.side_records = {r.flat_key: replace(r, save_id=None) for r in self._records.values()}
        model = source.section("model")
        owner: dict[Path, FlatParamRecord] = {}  # every parameter a flat parameter holds, tied ones included
        for record in self._records.values():
            for param in record.params:
                self._check(record, record.prefix + param.fqn, param.shape, model)
            owner.update((("model", fqn), record) for fqn in record.fqns())
        self.leaves = {}
        for path, leaf in source.leaves.items():
            holder = owner.get(path)
            if holder is None:
                if path[0] != LAYOUT:  # the records now sit beside their flat parameters
                    self.leaves[path] = leaf
            elif ("model", holder.flat_key) not in self.leaves:  # where the unit's first parameter was
                self.leaves[("model", holder.flat_key)] = TensorMeta(torch.Size([holder.numel]), holder.dtype)

    def _check(self, record: FlatParamRecord, fqn: str, shape: tuple[int, ...], model: Mapping[str | int, Any]) -> None:
        where = f"model.{fqn} in {self.location}"
        leaf = model.get(fqn)
        if leaf is None:
            raise CheckpointError(
                f"{where} is missing: the layout of {record.flat_key} holds it. The checkpoint is not of the model "
                "the layout describes; use a layout (--layout-from) from a checkpoint of this model."
            )
        if not isinstance(leaf, TensorMeta) or tuple(leaf.shape) != tuple(shape):
            raise CheckpointError(
                f"size mismatch for {where}: {tuple(leaf.shape) if isinstance(leaf, TensorMeta) else leaf!r} in the "
                f"checkpoint, {tuple(shape)} in the layout of {record.flat_key}. The checkpoint is not of the model "
                "the layout describes; use a layout (--layout-from) from a checkpoint of this model."
            )
        if leaf.dtype != record.dtype:
            raise CheckpointError(
                f"dtype mismatch for {where}: {leaf.dtype} in the checkpoint, but the flat parameter "
                f"{record.flat_key} holds {record.dtype}. Convert the checkpoint's tensors to {record.dtype} first, or "
                "use a layout from a model with parameters in that dtype."
            )

    def read(self, path: Path) -> torch.Tensor:
        record = self._records.get(path)
        if record is None:
            return self._source.read(path)
        flat = torch.full((record.numel,), PADDING_VALUE, dtype=record.dtype)
        for param in record.params:
            flat[param.offset : param.offset + param.numel].copy_(
                param.flatten(self._source.read(("model", record.prefix + param.fqn)))
            )
        return flat

    def chunks(self, path: Path) -> list[Chunk] | None:
        record = self._records.get(path)
        return [((o,), (n,)) for o, n in record.rank_chunks()] if record is not None else None

    def close(self) -> None:
        self._source.close()
