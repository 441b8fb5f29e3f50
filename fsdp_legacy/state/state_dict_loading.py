"""Loading model state dicts into FSDP units (FULL_STATE_DICT, SHARDED_STATE_DICT, LOCAL_STATE_DICT): the
load_state_dict hooks. Each unit's pre hook copies what this rank owns straight into its local shard (FULL: a slice of
the full tensor, no communication; SHARDED: the dim-0 chunks reassembled first; LOCAL: the flat shard) and hands
nn.Module the tensors it has registered, so nn.Module's own missing/unexpected/size bookkeeping stays right.
"""

import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..api import StateDictType
from ..convert.errors import CheckpointError
from ..convert.record import METADATA_KEY, RECORD_SUFFIX, FlatParamRecord
from ..flat_param import ParamInfo
from ..handle import FlatParamHandle
from ..unit import FLAT_PARAM, FSDP_PREFIX, FSDPUnit
from .sharded_tensor_compat import ShardedTensor
from .state_dict import clean_key, effective_settings, local_geometry, managed_keys


def register_load_hooks(unit: FSDPUnit) -> None:
    unit._register_load_state_dict_pre_hook(_pre_load_state_dict_hook, with_module=True)
    unit.register_load_state_dict_post_hook(_post_load_state_dict_hook)


def load_state_dict(unit: FSDPUnit, state_dict: Mapping[str, Any], strict: bool, assign: bool) -> Any:
    """FSDP.load_state_dict: nn.Module's, with the strict-mode error also saying what to do about it."""
    result = nn.Module.load_state_dict(unit, state_dict, strict=False, assign=assign)
    if strict and (result.missing_keys or result.unexpected_keys):
        lines = []
        if result.missing_keys:
            lines.append("Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in result.missing_keys)))
        if result.unexpected_keys:
            lines.append(
                "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in result.unexpected_keys))
            )
        lines.append(_strict_hint(unit))
        raise RuntimeError(f"Error(s) in loading state_dict for {type(unit).__name__}:\n\t" + "\n\t".join(lines))
    return result


def _strict_hint(unit: FSDPUnit) -> str:
    return (
        f"The model loads a {unit._state_dict_type.name} (set with FSDP.state_dict_type): load a checkpoint saved from "
        "this model under the same type, or pass strict=False to load only the keys present (load_state_dict returns "
        "the others)."
    )


@torch.no_grad()
def _pre_load_state_dict_hook(
    unit: FSDPUnit,
    state_dict: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    unit._lazy_init()  # as torch's: loading before any forward casts the buffers to buffer_dtype first
    kind, _ = effective_settings(unit)
    wrapped = prefix + FSDP_PREFIX
    for key in [k for k in state_dict if k.startswith(prefix)]:  # checkpoint names -> this unit's module names
        state_dict[wrapped + key[len(prefix) :]] = state_dict.pop(key)
    if not unit._handles:
        return
    if local_metadata.get("assign_to_params_buffers"):  # raised before any module of the unit has loaded
        raise RuntimeError(
            "load_state_dict(assign=True) is not supported by FSDP: its parameters are flat shards that cannot be "
            "replaced by the checkpoint's tensors. Call load_state_dict(state_dict) without assign."
        )
    if kind == StateDictType.LOCAL_STATE_DICT:  # our records ride in _metadata: checked as those of the keys are
        for handle, text in _saved_records(unit, local_metadata).items():
            state_dict.setdefault(wrapped + handle.flat_name + RECORD_SUFFIX, text)
    for handle in unit._handles:
        _load_handle(unit, handle, kind, state_dict, wrapped, missing_keys, error_msgs)


def _saved_records(unit: FSDPUnit, local_metadata: Any) -> dict[FlatParamHandle, str]:
    """The layout records (JSON) our LOCAL saves put in the unit's _metadata entry (convert/record.py), by handle."""
    texts = local_metadata.get(METADATA_KEY) if isinstance(local_metadata, dict) else None
    by_name: dict[str, str] = {}
    for text in texts if isinstance(texts, list) else []:
        try:
            name = json.loads(text).get("name", FLAT_PARAM)
        except (TypeError, ValueError, AttributeError):
            name = FLAT_PARAM  # unreadable: the record check reports it
        by_name.setdefault(str(name), text)
    return {handle: by_name[handle.flat_name] for handle in unit._handles if handle.flat_name in by_name}


def _load_handle(
    unit: FSDPUnit,
    handle: FlatParamHandle,
    kind: StateDictType,
    state_dict: dict,
    wrapped: str,
    missing_keys: list[str],
    error_msgs: list[str],
) -> None:
    if handle.sharded and handle.holds_gathered_copy:
        handle.reshard()  # an unsharded copy left from forward would go stale; backward re-gathers if it needs it
    # Take the flat parameter's entries out: they are loaded (and reported missing) here, not by nn.Module.
    flat_key = wrapped + handle.flat_name
    flat_value = materialize(state_dict.pop(flat_key, None))
    local = kind == StateDictType.LOCAL_STATE_DICT
    record = state_dict.pop(flat_key + RECORD_SUFFIX, None) if local else None  # absent in torch's LOCAL dicts
    refs = [(wrapped + relative, module, name, info) for relative, module, name, info in managed_keys(handle)]
    values = {key: materialize(state_dict.pop(key)) for key, *_ in refs if key in state_dict}
    registered = {key: module._parameters.get(name) for key, module, name, _ in refs}
    # A LOCAL_STATE_DICT names parameters only as use_orig_params' 1-D local views (beside _flat_param).
    by_name = [key for key, value in values.items() if not _same_shape(value, registered[key])]
    if (flat_value is not None and not local) or (local and by_name):
        error_msgs.append(_wrong_type_message(kind, clean_key(flat_key if flat_value is not None else by_name[0])))
        values = {}
    elif local:
        if flat_value is None:
            missing_keys.append(flat_key)
        else:
            _load_local(handle, clean_key(flat_key), flat_value, record, error_msgs)
    else:
        _load_by_name(handle, [(key, info) for key, _, _, info in refs], values, missing_keys, error_msgs)
    # nn.Module then checks the tensors registered on the unit's modules (the flat parameter, or with use_orig_params
    # the 1-D shard views): give it each one itself, a no-op copy, so it reports nothing twice; except that a LOCAL
    # dict's named views are loaded as they are, as torch does.
    for key, param in registered.items():
        if param is not None:
            state_dict[key] = values[key] if local and key in values else param.detach()
    if not unit._use_orig_params:
        state_dict[flat_key] = handle.flat_param.detach()


def materialize(value: Any) -> Any:
    """A real tensor for a tensor-like that loads on first use (Lightning's lazy checkpoint loader gives those: no
    tensor methods, but torch functions work on it through __torch_function__), as torch's FSDP1 accepts them;
    anything else as it is. A reshape to its own shape returns the loaded tensor itself, without a copy."""
    if isinstance(value, torch.Tensor) or not hasattr(type(value), "__torch_function__"):
        return value
    shape = getattr(value, "shape", None)
    return torch.reshape(value, tuple(shape)) if shape is not None else value


def _same_shape(value: Any, registered: torch.Tensor | None) -> bool:
    return registered is not None and type(value) is torch.Tensor and value.shape == registered.shape


def _wrong_type_message(kind: StateDictType, key: str) -> str:
    if kind == StateDictType.LOCAL_STATE_DICT:
        return (
            f"{key} is a parameter by name, but the model loads a LOCAL_STATE_DICT (a ShardedTensor under "
            f"{FLAT_PARAM} per FSDP unit): load this checkpoint inside FSDP.state_dict_type(model, "
            "StateDictType.FULL_STATE_DICT) for plain tensors or SHARDED_STATE_DICT for ShardedTensor/DTensor values."
        )
    return (
        f"{key} is a LOCAL_STATE_DICT entry, but the model loads a {kind.name}: load this checkpoint inside "
        "FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT)."
    )


def _load_by_name(
    handle: FlatParamHandle,
    refs: list[tuple[str, ParamInfo]],
    values: dict[str, Any],
    missing_keys: list[str],
    error_msgs: list[str],
) -> None:
    """FULL/SHARDED: copy the part of each full parameter that lies in this rank's shard into the shard (tied
    references in order, so the last one wins, as in torch)."""
    pieces = {piece.info: piece for piece in handle.layout.shard_pieces(handle.rank)}
    for key, info in refs:
        if key not in values:
            missing_keys.append(key)
            continue
        record = handle.dtensors.get(info)  # a DTensor parameter is saved whole (global shape), stored as its piece
        if not _check(
            clean_key(key), values[key], record.shape if record else info.shape, handle.local_shard.dtype, error_msgs
        ):
            continue
        full = gather_full_tensor(values[key], handle.group)  # every rank joins, whatever it owns
        full = info.flatten(record.local_piece(full) if record else full)
        if not handle.sharded:
            handle.local_shard[info.offset : info.offset + info.numel].copy_(full)
        elif info in pieces:
            piece = pieces[info]
            start = piece.start_in_param
            handle.local_shard[piece.offset_in_shard : piece.offset_in_shard + piece.numel_in_shard].copy_(
                full[start : start + piece.numel_in_shard]
            )


def _check(key: str, value: Any, shape: torch.Size, dtype: torch.dtype, error_msgs: list[str]) -> bool:
    """Shape and dtype validation, worded like nn.Module's. Every rank reaches the same verdict (it reads global
    metadata), so a skipped parameter never leaves a collective half-joined."""
    if isinstance(value, ShardedTensor):  # from the metadata: ShardedTensor's tensor methods warn (deprecated)
        saved_shape, saved_dtype = torch.Size(value.metadata().size), value.metadata().tensor_properties.dtype
    elif isinstance(value, torch.Tensor):
        saved_shape, saved_dtype = value.shape, value.dtype
    else:
        error_msgs.append(
            f'While copying the parameter named "{key}", expected torch.Tensor, ShardedTensor or DTensor from '
            f"checkpoint but received {type(value)}."
        )
        return False
    if saved_shape != shape:
        error_msgs.append(
            f"size mismatch for {key}: copying a param with shape {saved_shape} from checkpoint, the shape in current "
            f"model is {shape}. Load a checkpoint of this model (same architecture), or drop the key and pass "
            "strict=False."
        )
        return False
    if saved_dtype != dtype:
        error_msgs.append(
            f"dtype mismatch for {key}: the checkpoint holds {saved_dtype}, the model's parameter is {dtype}. "
            f"FSDP does not cast on load; convert the checkpoint first, e.g. {{k: v.to({dtype}) ...}}."
        )
        return False
    return True


def gather_full_tensor(value: Any, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor behind a state-dict value: plain tensors as they are, DTensors gathered, ShardedTensors
    reassembled from every rank's shards (any non-overlapping layout: each rank writes its shards into zeros, then a
    sum all-reduce, which is exact since every element has one non-zero contributor)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if not isinstance(value, ShardedTensor):
        return value
    metadata = value.metadata()
    full = torch.zeros(metadata.size, dtype=metadata.tensor_properties.dtype, device=collective_device(group))
    for shard in value.local_shards():
        region = tuple(
            slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True)
        )
        full[region].copy_(shard.tensor)
    dist.all_reduce(full, group=group)
    return full


def collective_device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _load_local(handle: FlatParamHandle, key: str, value: Any, record: Any, error_msgs: list[str]) -> None:
    """LOCAL_STATE_DICT: `_flat_param` must be a ShardedTensor laid out exactly as this rank's shard, and its layout
    record, when the checkpoint has one (torch's have none), must describe this unit's flat parameter."""
    if not isinstance(value, ShardedTensor):
        error_msgs.append(
            f"{key} of a LOCAL_STATE_DICT must be a ShardedTensor (as state_dict() returns under LOCAL_STATE_DICT) but "
            f"is a {type(value).__name__}. A full checkpoint loads under FSDP.state_dict_type(model, "
            "StateDictType.FULL_STATE_DICT)."
        )
        return
    if record is not None and not _check_record(handle, key, record, error_msgs):
        return
    numel, shard_numel, valid = local_geometry(handle)
    metadata = value.metadata()
    saved_numel = torch.Size(metadata.size).numel()
    saved_shard_numel = max((m.shard_sizes[0] for m in metadata.shards_metadata), default=0)
    shards = value.local_shards()
    expected = [([handle.rank * shard_numel], [valid])] if valid else []
    if (saved_numel, saved_shard_numel) != (numel, shard_numel) or [
        (list(s.metadata.shard_offsets), list(s.metadata.shard_sizes)) for s in shards
    ] != expected:
        saved_world_size = -(-saved_numel // saved_shard_numel) if saved_shard_numel else 0
        if saved_world_size != handle.world_size:
            error_msgs.append(
                f"{key} is a LOCAL_STATE_DICT saved with world size {saved_world_size} (shards of {saved_shard_numel} "
                f"elements) but this model runs with world size {handle.world_size}: a LOCAL_STATE_DICT only loads at "
                "the world size it was saved with. Save a SHARDED_STATE_DICT or FULL_STATE_DICT to change world size, "
                f"or convert a saved checkpoint offline: {_CONVERT_HINT.format(world_size=handle.world_size)}."
            )
        else:
            error_msgs.append(
                f"size mismatch for {key}: the checkpoint's flat parameter has {saved_numel} elements in shards of "
                f"{saved_shard_numel}, this model's has {numel} in shards of {shard_numel}. A LOCAL_STATE_DICT loads "
                "only into the same model, wrap policy and use_orig_params setting it was saved from."
            )
        return
    if _check(key, value, torch.Size([numel]), handle.local_shard.dtype, error_msgs) and valid:
        handle.local_shard[:valid].copy_(shards[0].tensor.reshape(-1))


_CONVERT_HINT = "python tools/convert_checkpoint.py CHECKPOINT NEW_CHECKPOINT --to local --world-size {world_size}"


def _check_record(handle: FlatParamHandle, key: str, value: Any, error_msgs: list[str]) -> bool:
    """The record's parameters, shapes and offsets must be this unit's. Its world size may differ where the flat
    parameter is the same (use_orig_params=False): DCP then reshards it correctly; the shard geometry check catches
    per-rank files from another world size."""
    where = f"{key}{RECORD_SUFFIX}" if not isinstance(value, str) else f"{key} (its layout record in _metadata)"
    try:
        saved = (
            FlatParamRecord.from_json(value, where)
            if isinstance(value, str)
            else FlatParamRecord.from_tensor(value, where)
        )
    except CheckpointError as error:
        error_msgs.append(str(error))
        return False
    mine = FlatParamRecord.from_layout(handle.layout, saved.prefix, handle.local_shard.dtype, handle.flat_name)
    if (saved.params, saved.shared, saved.numel, saved.dtype) == (mine.params, mine.shared, mine.numel, mine.dtype):
        return True
    if saved.world_size != mine.world_size and saved.at_world_size(mine.world_size) == mine:
        error_msgs.append(
            f"{key} is a LOCAL_STATE_DICT saved with world size {saved.world_size} but this model runs with world size "
            f"{mine.world_size}, and its flat parameter's padding depends on the world size (use_orig_params=True). "
            f"Convert the saved checkpoint offline: {_CONVERT_HINT.format(world_size=mine.world_size)}, or save a "
            "SHARDED_STATE_DICT or FULL_STATE_DICT to change world size."
        )
    else:
        error_msgs.append(
            f"{key}: the checkpoint's flat parameter holds {_summary(saved)}, this model's holds {_summary(mine)}. A "
            "LOCAL_STATE_DICT loads only into the same model, wrap policy and use_orig_params setting it was saved "
            "from; convert it offline with python tools/convert_checkpoint.py CHECKPOINT NEW_CHECKPOINT --to local "
            "--layout-from A_LOCAL_CHECKPOINT_OF_THIS_MODEL."
        )
    return False


def _summary(record: FlatParamRecord) -> str:
    params = ", ".join(f"{p.fqn} {list(p.shape)}@{p.offset}" for p in record.params)
    return f"[{params}] ({record.numel} {str(record.dtype).removeprefix('torch.')} elements)"


def _post_load_state_dict_hook(unit: FSDPUnit, incompatible_keys: Any) -> None:
    """Report keys by their checkpoint names, without `_fsdp_wrapped_module.`."""
    for keys in incompatible_keys:
        keys[:] = [clean_key(key) for key in keys]
