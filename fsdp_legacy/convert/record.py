"""The layout record of one flat parameter: what a LOCAL checkpoint needs to be read without the model's code.

A LOCAL_STATE_DICT stores each FSDP unit's flat shard under `<prefix>_flat_param` and, like torch's, nothing about
what it holds. The record, UTF-8 JSON, lists the original parameters by clean FQN with shape and offset, the padding
segments, the dtype, the world size it was saved at, the alignment rule (so the layout can be re-planned for another
world size), the tied parameters stored once and, where known, the save's identity (save_identity.py).

Where it travels (the state dict's keys stay exactly torch's):
* in the state dict's `_metadata` (the per-module dict nn.Module.state_dict keeps beside the keys), as a list of JSON
  strings under METADATA_KEY in the unit's entry: torch.save keeps it and torch.load(weights_only=True) restores it;
* in a DCP directory saved through fsdp_legacy (fsdp_legacy.state.dcp_checkpoint, the converter), in its side file
  (side_file.py), since DCP drops `_metadata`;
* in checkpoints of earlier versions, and with the opt-in FSDP_LEGACY_LAYOUT_KEYS=1, as `<prefix>_flat_param_meta`:
  the JSON in a 1-D uint8 tensor beside the flat parameter (without a save identity, so its size never changes).
"""

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeGuard

import torch

from ..flat_param import FlatParamLayout, flatten_in_order, plan_segments, view_flat
from .errors import CheckpointError

FLAT_PARAM = "_flat_param"  # torch's name, as fully_sharded_data_parallel.FLAT_PARAM (not imported: no model code here)
RECORD_SUFFIX = "_meta"
# A unit whose parameters differ in dtype has one flat parameter per dtype: `_flat_param`, then `_flat_param_1`, ...
_FLAT_NAME = re.compile(rf"(^|\.)({FLAT_PARAM}(_[1-9][0-9]*)?)$")
LAYOUT_KEYS_ENV = "FSDP_LEGACY_LAYOUT_KEYS"  # "1": LOCAL state dicts also carry the records as tensor keys (opt-in)
METADATA_KEY = "fsdp_legacy_layout"  # in a state dict's _metadata entry of a unit: its records as JSON strings
FORMAT = "fsdp_legacy.flat_param_layout"
VERSION = 1
# A record with a parameter held in memory order says version 2, so that readers before it, which know no strides,
# refuse it rather than read that parameter row-major; the others stay version 1, byte for byte.
VERSION_WITH_STRIDES = 2


@dataclass(frozen=True)
class ParamRecord:
    fqn: str  # relative to the unit's prefix
    shape: tuple[int, ...]
    offset: int  # first element in the flat parameter
    stride: tuple[int, ...] | None = None  # held in memory order with these strides (None: row-major; flat_param.py)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def unflatten(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameter, row-major, from its `numel` elements as the flat parameter holds them."""
        return view_flat(flat, self.shape, self.stride).contiguous()

    def flatten(self, tensor: torch.Tensor) -> torch.Tensor:
        """The parameter's elements in the order the flat parameter holds them: 1-D."""
        return flatten_in_order(tensor, self.stride)


@dataclass(frozen=True)
class FlatParamRecord:
    prefix: str  # the unit's clean state-dict prefix: "" for the root, "block." for a nested unit
    dtype: torch.dtype
    world_size: int
    aligned_numel: int  # 0: no alignment padding (use_orig_params=False)
    params: tuple[ParamRecord, ...]
    shared: tuple[tuple[str, str], ...]  # (fqn, fqn of the stored parameter it is tied to), relative to the prefix
    segments: tuple[tuple[int, bool], ...]  # (numel, is_padding) covering [0, numel)
    numel: int  # alignment padding included, world padding not (the LOCAL_STATE_DICT's global size)
    name: str = FLAT_PARAM  # the flat parameter's name in its unit
    save_id: str | None = field(default=None, compare=False)  # the save's identity; not part of the layout

    @property
    def flat_key(self) -> str:
        return self.prefix + self.name

    @property
    def record_key(self) -> str:
        return self.prefix + self.name + RECORD_SUFFIX

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)

    def rank_chunks(self) -> list[tuple[int, int]]:
        """(offset, numel) of every rank's part of the flat parameter, world padding left out, empty ranks omitted:
        the chunks a LOCAL_STATE_DICT's ShardedTensor (and so DCP) records."""
        shard, numel = self.shard_numel, self.numel
        return [(r * shard, min(shard, numel - r * shard)) for r in range(self.world_size) if r * shard < numel]

    def fqns(self) -> list[str]:
        """Clean FQNs of every parameter the flat parameter holds, tied references included."""
        return [self.prefix + p.fqn for p in self.params] + [self.prefix + fqn for fqn, _ in self.shared]

    def at_world_size(self, world_size: int) -> "FlatParamRecord":
        """The same parameters laid out for another world size (only use_orig_params' final padding changes)."""
        offsets, segments, numel = plan_segments([p.numel for p in self.params], self.aligned_numel, world_size)
        params = tuple(replace(p, offset=o) for p, o in zip(self.params, offsets, strict=True))
        return replace(self, world_size=world_size, params=params, segments=segments, numel=numel)

    # ----------------------------------------------------------------------------------------------------------------

    @classmethod
    def from_layout(
        cls, layout: FlatParamLayout, prefix: str, dtype: torch.dtype, name: str = FLAT_PARAM
    ) -> "FlatParamRecord":
        return cls(
            name=name,
            prefix=prefix,
            dtype=dtype,
            world_size=layout.world_size,
            aligned_numel=layout.aligned_numel,
            params=tuple(ParamRecord(p.fqn, tuple(p.shape), p.offset, p.stride) for p in layout.params),
            shared=tuple(
                (f"{s.module_name}.{s.param_name}" if s.module_name else s.param_name, s.primary.fqn)
                for s in layout.shared
            ),
            segments=tuple(layout.segments),
            numel=layout.numel,
        )

    def to_json(self) -> str:
        body = {
            "format": FORMAT,
            "version": VERSION if all(p.stride is None for p in self.params) else VERSION_WITH_STRIDES,
            "prefix": self.prefix,
            **({"name": self.name} if self.name != FLAT_PARAM else {}),  # (one-dtype units: as before)
            **({"save_id": self.save_id} if self.save_id is not None else {}),
            "dtype": str(self.dtype).removeprefix("torch."),
            "world_size": self.world_size,
            "aligned_numel": self.aligned_numel,
            "numel": self.numel,
            "params": [
                {"fqn": p.fqn, "shape": list(p.shape), "offset": p.offset}
                | ({"stride": list(p.stride)} if p.stride is not None else {})
                for p in self.params
            ],
            "shared": [list(pair) for pair in self.shared],
            "segments": [list(s) for s in self.segments],
        }
        return json.dumps(body, separators=(",", ":"))

    def to_tensor(self) -> torch.Tensor:
        """The record as the tensor key of earlier versions (without the save identity: a fixed size per layout)."""
        text = replace(self, save_id=None).to_json()
        return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, where: str) -> "FlatParamRecord":
        """Decode and validate a record stored as a tensor key; `where` (key and file) goes into every error."""
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise CheckpointError(
                f"{where}: a flat-parameter layout record must be a 1-D uint8 tensor, got "
                f"{_describe(tensor)}. The checkpoint is damaged or the key is not a layout record."
            )
        try:
            text = bytes(tensor.cpu().numpy()).decode()
        except UnicodeDecodeError as error:
            raise CheckpointError(
                f"{where}: the flat-parameter layout record is not readable ({error}); the "
                "checkpoint is damaged. Re-save it, or restore it from a copy."
            ) from None
        return cls.from_json(text, where)

    @classmethod
    def from_json(cls, text: object, where: str) -> "FlatParamRecord":
        """Decode and validate a record's JSON; `where` goes into every error."""
        try:
            if not isinstance(text, str):
                raise TypeError(f"a {type(text).__name__}, not a JSON string")
            body = json.loads(text)
            record = cls(
                prefix=body["prefix"],
                dtype=_dtype(body["dtype"]),
                world_size=int(body["world_size"]),
                aligned_numel=int(body["aligned_numel"]),
                params=tuple(
                    ParamRecord(p["fqn"], tuple(p["shape"]), int(p["offset"]), _stride(p.get("stride")))
                    for p in body["params"]
                ),
                shared=tuple((a, b) for a, b in body["shared"]),
                segments=tuple((int(n), bool(pad)) for n, pad in body["segments"]),
                numel=int(body["numel"]),
                name=str(body.get("name", FLAT_PARAM)),
                save_id=_save_id(body.get("save_id")),
            )
            ok = body.get("format") == FORMAT and body.get("version") in (VERSION, VERSION_WITH_STRIDES)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as error:
            raise CheckpointError(
                f"{where}: the flat-parameter layout record is not readable ({error}); the "
                "checkpoint is damaged. Re-save it, or restore it from a copy."
            ) from None
        if not ok:
            raise CheckpointError(
                f"{where}: unknown layout record format {body.get('format')!r} version "
                f"{body.get('version')!r} (this fsdp_legacy reads {FORMAT!r} version {VERSION}); "
                "upgrade fsdp_legacy."
            )
        stored = {p.fqn for p in record.params}
        if (
            not is_flat_key(record.name)
            or record.world_size < 1
            or record.at_world_size(record.world_size) != record
            or any(primary not in stored for _, primary in record.shared)
        ):
            raise CheckpointError(
                f"{where}: the layout record is inconsistent (its offsets and padding do not follow "
                "from its parameter shapes); the checkpoint is damaged. Re-save it."
            )
        return record


def records_in_metadata(metadata: object, where: str) -> list[FlatParamRecord]:
    """The records a state dict's `_metadata` carries (none where it has none, as torch's state dicts)."""
    if not isinstance(metadata, Mapping):
        return []
    found = []
    for prefix, entry in metadata.items():
        texts = entry.get(METADATA_KEY) if isinstance(entry, Mapping) else None
        if texts is None:
            continue
        if not isinstance(texts, (list, tuple)):
            raise CheckpointError(
                f"{where}: the state dict's _metadata[{prefix!r}][{METADATA_KEY!r}] is a {type(texts).__name__}, not "
                "a list of layout records: the checkpoint is damaged. Re-save it."
            )
        found += [FlatParamRecord.from_json(text, f"{where} (_metadata[{prefix!r}])") for text in texts]
    return found


def is_flat_key(key: object) -> TypeGuard[str]:
    """Whether a state-dict key names a flat parameter (`_flat_param`, or `_flat_param_<i>` of a mixed-dtype unit)."""
    return isinstance(key, str) and _FLAT_NAME.search(key) is not None


def is_record_key(key: object) -> TypeGuard[str]:
    return isinstance(key, str) and key.endswith(RECORD_SUFFIX) and is_flat_key(key[: -len(RECORD_SUFFIX)])


def _save_id(value: object) -> str | None:
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"save_id {value!r} is not a non-empty string")
    return value


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _stride(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(step) for step in value)
