"""The layout of a LOCAL checkpoint that carries no records, inferred from the optimizer state saved beside it.

A plain `dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)})` under
LOCAL_STATE_DICT (torch's FSDP1, or ours without fsdp_legacy.dcp_checkpoint) stores each unit's flat parameter and
nothing about what it holds. The optimizer state beside it names every trained parameter by FQN, in flat-parameter
order within each unit (`param_groups[*]["params"]`), with its shape (the unflattened state tensors). Each parameter
belongs to the unit whose prefix is the longest that its FQN starts with; in that order and with torch's padding rules
(none without use_orig_params, alignment padding with it), the parameters must fill the flat parameter's stored size
exactly, and only one layout may do so: anything else is refused, naming what is missing.

What the optimizer state cannot tell:
* a parameter without state (frozen, or never stepped): refused, its shape is unknown;
* use_orig_params=True checkpoints also store each parameter's per-rank view under its FQN; a key that is not a
  parameter of the optimizer but holds exactly a rank's piece of one (bit for bit) is a second name of that parameter
  (tied weights) and is recorded as such;
* without use_orig_params a tied parameter's second name appears nowhere (the optimizer and the flat parameter hold
  it once): the converted checkpoint names it once, and the report says so.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..flat_param import plan_segments
from .checkpoint import Checkpoint, TensorMeta
from .errors import CheckpointError
from .record import FLAT_PARAM, FlatParamRecord, ParamRecord, is_flat_key

_ALIGNMENTS = (2, 4, 8, 16)  # 16 bytes over the compute dtype's item size (8, 4, 2 or 1 byte)


@dataclass(frozen=True)
class InferredLayout:
    records: dict[str, FlatParamRecord]  # by flat key
    notes: tuple[str, ...]  # what the report says about how the layout was found


@dataclass(frozen=True)
class _Unit:
    prefix: str
    leaf: TensorMeta
    world_size: int


def infer_layout(checkpoint: Checkpoint) -> InferredLayout:
    """The records of `checkpoint`'s flat parameters, from its optimizer state; CheckpointError says why not."""
    units = _units(checkpoint)
    order, shapes = _optimizer_params(checkpoint)
    model = checkpoint.section("model")
    views = any(isinstance(model.get(f), TensorMeta) and tuple(model[f].shape) != shapes[f] for f in order)
    if views:  # use_orig_params: every parameter is stored, managed ones as 1-D per-rank views
        managed = [f for f in order if not (f in model and len(shapes[f]) != 1 and tuple(model[f].shape) == shapes[f])]
    else:  # managed parameters live in the flat parameters only; keys of parameters are those outside FSDP
        managed = [f for f in order if f not in model]
    members: dict[str, list[str]] = {prefix: [] for prefix in units}
    for fqn in managed:
        prefix = max((p for p in units if fqn.startswith(p)), key=len, default=None)
        if prefix is None:
            raise CheckpointError(
                f"the optimizer state names {fqn}, which is in no flat parameter's unit "
                f"({', '.join(p + FLAT_PARAM for p in units)}) and is not a key of the model section"
            )
        members[prefix].append(fqn)
    records = {}
    for prefix, unit in units.items():
        record = _lay_out(unit, members[prefix], shapes, views)
        records[record.flat_key] = record
    notes = ["the flat parameters' layout was inferred from the optimizer state saved beside them"]
    if views:
        tied = _tied_views(checkpoint, records, set(order))
        records = {key: _with_shared(record, tied) for key, record in records.items()}
        notes += [f"{name} is tied to {primary}" for name, primary in sorted(tied.items())]
    else:
        notes.append(
            "a parameter tied to another (stored once, such as an LM head tied to its embedding) is named once, as "
            "the optimizer names it; re-tie it after loading, or give the layout with --layout-from pkg.mod:factory "
            "--wrap pkg.mod.Layer to keep both names"
        )
    return InferredLayout(records, tuple(notes))


def _units(checkpoint: Checkpoint) -> dict[str, _Unit]:
    units = {}
    for key, leaf in checkpoint.section("model").items():
        if not is_flat_key(key) or not isinstance(leaf, TensorMeta) or len(leaf.shape) != 1:
            continue
        if not key.endswith(FLAT_PARAM):
            raise CheckpointError(
                f"model.{key} is one of several flat parameters of a unit (its parameters have different dtypes): "
                "which parameter each holds cannot be told from the optimizer state"
            )
        chunks = checkpoint.chunks(("model", key)) or []
        largest = max((size[0] for _, size in chunks), default=0)
        world_size = -(-leaf.shape[0] // largest) if largest else 1
        units[key.removesuffix(FLAT_PARAM)] = _Unit(key.removesuffix(FLAT_PARAM), leaf, world_size)
    return units


def _optimizer_params(checkpoint: Checkpoint) -> tuple[list[str], dict[str, tuple[int, ...]]]:
    """The trained parameters' FQNs in the optimizer's order, and their shapes."""
    groups: dict[int, Any] = {}
    states: dict[str, dict[str, Any]] = {}
    for path, leaf in checkpoint.leaves.items():
        if path[0] != "optim":
            continue
        if len(path) == 4 and path[1] == "param_groups" and path[3] == "params" and isinstance(path[2], int):
            groups[path[2]] = leaf
        elif len(path) == 4 and path[1] == "state" and isinstance(path[2], str):
            states.setdefault(path[2], {})[str(path[3])] = leaf
    if not groups:
        raise CheckpointError("the checkpoint has no optimizer state (an 'optim' section with param_groups)")
    order = [fqn for index in sorted(groups) for fqn in groups[index]]
    if not all(isinstance(fqn, str) for fqn in order):
        raise CheckpointError("the optimizer's param_groups name parameters by index, not by FQN")
    shapes = {}
    for fqn in order:
        found = {tuple(v.shape) for k, v in states.get(fqn, {}).items() if k != "step" and isinstance(v, TensorMeta)}
        if len(found) != 1:
            why = f"holds state of shapes {sorted(found)}" if found else "holds no state (frozen, or not stepped yet)"
            raise CheckpointError(f"the optimizer {why} for {fqn}, so its shape is unknown")
        shapes[fqn] = found.pop()
    return order, shapes


def _lay_out(unit: _Unit, fqns: list[str], shapes: Mapping[str, tuple[int, ...]], uop: bool) -> FlatParamRecord:
    """The one layout of `fqns`, in this order, that fills the unit's flat parameter (alignment padding if `uop`)."""
    numels = [math.prod(shapes[f]) for f in fqns]
    layouts: dict[tuple[tuple[int, ...], tuple[tuple[int, bool], ...]], int] = {}
    for aligned in _ALIGNMENTS if uop else (0,):
        offsets, segments, numel = plan_segments(numels, aligned, unit.world_size)
        if numel == unit.leaf.shape[0]:
            layouts.setdefault((offsets, segments), aligned)  # the same layout whatever the alignment: one of them
    where = f"model.{unit.prefix}{FLAT_PARAM}"
    if not layouts:
        raise CheckpointError(
            f"{where} holds {unit.leaf.shape[0]} elements, but the {len(fqns)} parameters the optimizer names under "
            f"{unit.prefix or 'the root'} ({sum(numels)} elements) do not fill it by torch's padding rules: the "
            "optimizer does not hold every parameter of the unit (frozen ones, or parameters it does not train)"
        )
    if len(layouts) > 1:
        raise CheckpointError(
            f"{where}: its parameters fit it with several alignments of use_orig_params' padding (the compute dtype "
            "is not in the checkpoint), so their offsets are ambiguous"
        )
    (offsets, segments), aligned = next(iter(layouts.items()))
    return FlatParamRecord(
        prefix=unit.prefix,
        dtype=unit.leaf.dtype,
        world_size=unit.world_size,
        aligned_numel=aligned,
        params=tuple(
            ParamRecord(f.removeprefix(unit.prefix), shapes[f], o) for f, o in zip(fqns, offsets, strict=True)
        ),
        shared=(),
        segments=segments,
        numel=unit.leaf.shape[0],
    )


def _tied_views(checkpoint: Checkpoint, records: Mapping[str, FlatParamRecord], params: set[str]) -> dict[str, str]:
    """use_orig_params' per-rank view keys that are no parameter of the optimizer but hold exactly a rank's piece of
    one: tied names, {name: the stored parameter's FQN}."""
    tied = {}
    for key, leaf in checkpoint.section("model").items():
        if not isinstance(key, str) or key in params or is_flat_key(key) or not isinstance(leaf, TensorMeta):
            continue
        if len(leaf.shape) != 1 or leaf.shape[0] == 0:
            continue
        value = checkpoint.read(("model", key))
        for record in records.values():
            if not key.startswith(record.prefix) or leaf.dtype != record.dtype:
                continue
            for lo, size in record.rank_chunks():
                for param in record.params:
                    start, stop = max(lo, param.offset), min(lo + size, param.offset + param.numel)
                    if stop - start != leaf.shape[0]:
                        continue
                    piece = checkpoint.read_flat(("model", record.flat_key), start, stop)
                    if torch.equal(piece.view(torch.uint8), value.reshape(-1).view(torch.uint8)):
                        if bool((value == value[0]).all()):  # a constant (or one element) matches too easily
                            raise CheckpointError(
                                f"model.{key} is no parameter of the optimizer and its values ({value[0].item()} "
                                f"throughout) equal a piece of {record.prefix}{param.fqn}: whether it is a buffer or "
                                "that parameter's tied name cannot be told"
                            )
                        tied[key] = record.prefix + param.fqn
    return tied


def _with_shared(record: FlatParamRecord, tied: Mapping[str, str]) -> FlatParamRecord:
    shared = tuple(
        (name.removeprefix(record.prefix), primary.removeprefix(record.prefix))
        for name, primary in sorted(tied.items())
        if primary.startswith(record.prefix) and any(record.prefix + p.fqn == primary for p in record.params)
    )
    return replace(record, shared=shared)
