"""Model state dicts of FSDP units: FULL_STATE_DICT, SHARDED_STATE_DICT and LOCAL_STATE_DICT (torch FSDP1 formats).

Every unit registers nn.Module state-dict hooks, so `model.state_dict()` / `model.load_state_dict()` work on the root
(or on any module containing FSDP units):

* saving: nn.Module saves a unit's subtree (nested units first, each already converted by its own hook); then the
  unit's post hook rewrites its entries: `_fsdp_wrapped_module.` goes, and its flat parameter (or, with
  use_orig_params, the 1-D shard views) becomes full tensors (FULL), dim-0 chunks in ShardedTensors/DTensors (SHARDED)
  or a ShardedTensor of the local flat shard (LOCAL). A unit is gathered, copied out and dropped before the next one
  is, so at most one unit is ever unsharded.
* loading: state_dict_loading.py.
"""

import contextlib
import dataclasses
import functools
import os
import warnings
import weakref
from collections.abc import Iterator
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives as comm
from ..api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from ..convert.record import LAYOUT_KEYS_ENV, METADATA_KEY, RECORD_SUFFIX, FlatParamRecord
from ..flat_param import ParamInfo
from ..handle import FlatParamHandle
from ..naming import CHECKPOINT_WRAPPED_MODULE, join_fqn
from ..storage import free_storage
from ..unit import FSDPUnit, clean_fqn, fsdp_modules
from . import save_identity
from .chunk_exchange import ChunkPlan, can_exchange, chunk_rows, exchange_chunks
from .sharded_tensor_compat import Shard, ShardedTensor, ShardedTensorMetadata, ShardMetadata, TensorProperties
from .state_dict_dtensor import (
    check_model_settings,
    check_optim_settings,
    chunk_dtensor,
    chunks_on_own_mesh,
    dtensor_of_chunk,
    uses_dtensor,
)

_CONFIG_TYPES = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}
_DEPRECATION = (
    "FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated. Please use APIs, get_state_dict() "
    "and set_state_dict(), which can support different parallelisms, FSDP1, FSDP2, DDP. API doc: "
    "https://pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.state_dict."
    "get_state_dict .Tutorial: https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html ."
)
_NO_SHARD_WARNING = "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned."


def init_unit(unit: FSDPUnit) -> None:
    """Give a new FSDP unit torch's default settings (FULL_STATE_DICT) and its state-dict hooks."""
    unit._state_dict_type = StateDictType.FULL_STATE_DICT
    unit._state_dict_config = FullStateDictConfig()
    unit._optim_state_dict_config = FullOptimStateDictConfig()
    unit.register_state_dict_pre_hook(_pre_state_dict_hook)
    unit._register_state_dict_hook(_post_state_dict_hook)
    # The save identity of later LOCAL saves changes with every optimizer step and load (save_identity.py).
    save_identity.track(
        unit, [p for handle in unit._handles for p in (handle.flat_param, *handle.orig_params.values())]
    )
    unit._register_load_state_dict_pre_hook(functools.partial(_count_load, weakref.ref(unit)))


def _count_load(unit_ref: "weakref.ref[FSDPUnit]", *_: Any) -> None:
    unit = unit_ref()
    if unit is not None:
        save_identity.note_load(unit)


# --------------------------------------------------------------------------------------------------------------------
# Settings: FSDP.set_state_dict_type / get_state_dict_type / state_dict_type


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: Any = None,
) -> StateDictSettings:
    """Set the state-dict type and configs of every FSDP unit in `module`; returns the previous settings."""
    warnings.warn(_DEPRECATION, FutureWarning, stacklevel=2)
    state_dict_type = _as_ours(StateDictType, state_dict_type)
    config_type, optim_config_type = _CONFIG_TYPES[state_dict_type]
    state_dict_config = _config(config_type, state_dict_config, "state_dict_config")
    optim_state_dict_config = _config(optim_config_type, optim_state_dict_config, "optim_state_dict_config")
    previous: StateDictSettings | None = None
    for unit in fsdp_modules(module):
        if previous is None:
            previous = _settings(unit)
        elif unit._state_dict_type != previous.state_dict_type:
            raise AssertionError("All FSDP modules should have the same state_dict_type.")
        elif not isinstance(unit._state_dict_config, type(previous.state_dict_config)):
            raise AssertionError("All FSDP modules must have the same type of state_dict_config.")
        elif not isinstance(unit._optim_state_dict_config, type(previous.optim_state_dict_config)):
            raise AssertionError("All FSDP modules must have the same type of optim_state_dict_config.")
        unit._state_dict_type = state_dict_type
        unit._state_dict_config = state_dict_config
        unit._optim_state_dict_config = optim_state_dict_config
    return previous or StateDictSettings(None, None, None)  # type: ignore[arg-type]


def get_state_dict_type(module: nn.Module) -> StateDictSettings | None:
    """The settings shared by every FSDP unit in `module` (None without units); AssertionError if they differ."""
    settings: StateDictSettings | None = None
    for unit in fsdp_modules(module):
        if settings is None:
            settings = _settings(unit)
        elif _settings(unit) != settings:
            raise AssertionError(
                f"All FSDP modules must have the same state dict settings.Got {_settings(unit)} and {settings}."
            )
        check_optim_settings(unit, settings)  # as torch: LOCAL with a device mesh raises here
    return settings


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: Any = None,
) -> Iterator[None]:
    """Temporarily set the state-dict type; the previous settings come back on exit, even on an exception."""
    previous = set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        set_state_dict_type(
            module, previous.state_dict_type, previous.state_dict_config, previous.optim_state_dict_config
        )


def _settings(unit: FSDPUnit) -> StateDictSettings:
    return StateDictSettings(unit._state_dict_type, unit._state_dict_config, unit._optim_state_dict_config)


def _as_ours(enum_cls: type[Enum], value: Any) -> Any:
    """Users mix imports: accept torch's enum members by name."""
    if isinstance(value, enum_cls):
        return value
    name = getattr(value, "name", None)
    if not isinstance(name, str) or name not in enum_cls.__members__:
        raise ValueError(f"Expected a {enum_cls.__name__} but got {value!r}")
    return enum_cls[name]


def _config(expected: type, config: Any, what: str) -> Any:
    if config is None:
        return expected()
    if type(config) is not expected and type(config).__name__ == expected.__name__ and dataclasses.is_dataclass(config):
        config = expected(**{f.name: getattr(config, f.name) for f in dataclasses.fields(expected)})  # torch's class
    if type(config) is not expected:
        raise RuntimeError(f"Expected {what} of type {expected} but got {type(config)}")
    return config


def effective_settings(unit: FSDPUnit) -> tuple[StateDictType, StateDictConfig]:
    """The type and config a unit uses now: NO_SHARD units always use a default FULL_STATE_DICT, as torch does."""
    if unit.sharding_strategy == ShardingStrategy.NO_SHARD:
        warnings.warn(_NO_SHARD_WARNING, stacklevel=3)
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
    check_model_settings(unit)
    return unit._state_dict_type, unit._state_dict_config


# --------------------------------------------------------------------------------------------------------------------
# Saving


def _pre_state_dict_hook(unit: FSDPUnit, prefix: str, keep_vars: bool) -> None:
    # As torch's, saving lazily initialises: the first unit saved becomes a root and MixedPrecision.buffer_dtype
    # casts the buffers (so a dict saved before any forward holds them rounded through that dtype, as torch's does).
    unit._lazy_init()
    # use_orig_params: after zero_grad(set_to_none=True) the sharded gradients of the whole subtree are freed before
    # its first gather, as torch's FSDP1 frees them at the root (else the next forward would); nested units then find
    # nothing left to do.
    for inner in fsdp_modules(unit):
        for handle in inner._handles:
            handle.sync_grad_from_orig_params()


@torch.no_grad()
def _post_state_dict_hook(unit: FSDPUnit, destination: dict, prefix: str, local_metadata: Any) -> None:
    kind, config = effective_settings(unit)
    # The unit's entries are the last ones saved (its whole subtree); take them out and put them back rewritten.
    entries = {_relative(key, prefix): destination.pop(key) for key in [k for k in destination if k.startswith(prefix)]}
    own_buffers = _own_buffer_keys(unit)
    rank0_only = isinstance(config, FullStateDictConfig) and config.rank0_only
    keep = not rank0_only or unit.rank == 0
    if unit._handles and kind == StateDictType.LOCAL_STATE_DICT:
        for handle in unit._handles:
            entries[handle.flat_name] = _local_flat_tensor(handle, config.offload_to_cpu)
        _add_layout_records(unit, prefix, local_metadata, entries)
    elif unit._handles:
        values: dict[str, Any] = {}
        for handle in unit._handles:
            entries.pop(handle.flat_name, None)
            values.update(_unsharded_values(unit, handle, kind, config, keep))
        entries = _in_module_order(unit, entries, values)
    if kind != StateDictType.LOCAL_STATE_DICT:
        for key in own_buffers & entries.keys():
            if not keep:
                del entries[key]
                continue
            # Buffers kept in MixedPrecision.buffer_dtype are saved in their original dtype, as torch does.
            entries[key] = entries[key].to(unit._buffer_dtypes.get(key, entries[key].dtype))
            if config.offload_to_cpu:
                entries[key] = entries[key].cpu()
    destination.update((prefix + key, value) for key, value in entries.items())


def _add_layout_records(unit: FSDPUnit, prefix: str, local_metadata: Any, entries: dict[str, Any]) -> None:
    """fsdp_legacy's addition to a LOCAL state dict: the layout records that make it readable without the model's
    code, with the save's identity, in the unit's `_metadata` entry (the keys stay torch's: convert/record.py). With
    FSDP_LEGACY_LAYOUT_KEYS=1 also as the `<flat key>_meta` tensors of earlier versions, right after each flat
    parameter (for savers that keep only tensors, such as a plain dcp.save)."""
    save_id = save_identity.save_id(unit, unit.process_group)
    records = {
        handle.flat_name: dataclasses.replace(
            FlatParamRecord.from_layout(handle.layout, clean_key(prefix), handle.local_shard.dtype, handle.flat_name),
            save_id=save_id,
        )
        for handle in unit._handles
    }
    if isinstance(local_metadata, dict):
        local_metadata[METADATA_KEY] = [record.to_json() for record in records.values()]
    if os.environ.get(LAYOUT_KEYS_ENV, "0") not in ("", "0"):
        rewritten = {}
        for name, entry in entries.items():
            rewritten[name] = entry
            if name in records:
                rewritten[name + RECORD_SUFFIX] = records[name].to_tensor()
        entries.clear()
        entries.update(rewritten)


def _relative(key: str, prefix: str) -> str:
    return clean_fqn(key[len(prefix) :])


def clean_key(key: str) -> str:
    return clean_fqn(key)


def _walk(unit: FSDPUnit) -> Iterator[tuple[str, nn.Module, bool]]:
    """(clean path, module, is a nested unit) below the unit's wrapped module, in nn.Module.state_dict order.
    Activation-checkpoint wrappers are looked through: the module they wrap stands at their path."""
    root = unit._fsdp_wrapped_module
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        path, module = stack.pop()
        inner = module._modules.get(CHECKPOINT_WRAPPED_MODULE)
        if inner is not None:
            stack.append((path, inner))
            continue
        nested = module is not root and isinstance(module, FSDPUnit)
        yield path, module, nested
        if not nested:
            children = [(join_fqn(path, name), child) for name, child in module._modules.items() if child is not None]
            stack.extend(reversed(children))


def _own_buffer_keys(unit: FSDPUnit) -> set[str]:
    return {
        join_fqn(path, name)
        for path, module, nested in _walk(unit)
        if not nested
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    }


def managed_keys(handle: FlatParamHandle) -> Iterator[tuple[str, nn.Module, str, ParamInfo]]:
    """(key relative to the wrapped module, owning module, attribute name, the stored parameter) of every reference
    to a managed parameter, tied ones too."""
    for info in handle.layout.params:
        yield info.fqn, info.module, info.param_name, info
    for shared in handle.layout.shared:
        yield join_fqn(shared.module_name, shared.param_name), shared.module, shared.param_name, shared.primary


@contextlib.contextmanager
def _gathered(handle: FlatParamHandle) -> Iterator[torch.Tensor]:
    """The unit's whole flat parameter, all-gathered into a temporary (the handle's own state is left alone) whose
    memory is released on exit: the backend's work object may keep the tensor itself alive for a while."""
    if not handle.sharded:
        yield handle.local_shard
        return
    full = torch.empty(handle.layout.padded_numel, dtype=handle.local_shard.dtype, device=handle.local_shard.device)
    comm.all_gather(full, handle.local_shard, handle.group).wait()
    try:
        yield full
    finally:
        free_storage(full)


def _unsharded_values(
    unit: FSDPUnit, handle: FlatParamHandle, kind: StateDictType, config: StateDictConfig, keep: bool
) -> dict[str, Any]:
    """FULL: a cloned full tensor per parameter reference; SHARDED: its dim-0 chunk as a ShardedTensor/DTensor.
    Ranks that keep nothing (rank0_only) still take part in the gather and get None values."""
    values: dict[str, Any] = {}
    summoned = handle.summoned
    if summoned is not None and not summoned.rank0_only and not handle.dtensors:
        return _summoned_values(unit, handle, kind, config, keep)
    if kind == StateDictType.SHARDED_STATE_DICT and exchanges_chunks(unit, handle, config):
        chunks = sharded_chunks(unit, handle, handle.local_shard, handle.group, config)
        for (key, _, _, _), (_, value) in zip(managed_keys(handle), chunks, strict=True):
            values[key] = value
        return values
    with _gathered(handle) as full:
        for key, _, _, info in managed_keys(handle):
            if not keep:
                values[key] = None
                continue
            param = info.view_in(full)
            if kind == StateDictType.FULL_STATE_DICT:  # what nn.Module saves: the parameter's detach()
                values[key] = detached_copy(handle.typed(param, info).detach(), config.offload_to_cpu)
            elif uses_dtensor(unit, config):
                values[key] = chunk_dtensor(param, unit, config.offload_to_cpu, handle.dtensors.get(info))
            else:
                values[key] = chunk_sharded_tensor(param, handle, config.offload_to_cpu)
    return values


def _summoned_values(
    unit: FSDPUnit, handle: FlatParamHandle, kind: StateDictType, config: StateDictConfig, keep: bool
) -> dict[str, Any]:
    """Inside summon_full_params: the values of the parameters as the modules show them now, edits of the summon
    included (a LoRA merge written into the full weights before writeback), as torch's FSDP1 reads its summoned
    parameters; no collective, as in torch. (A rank0_only summon, whose other ranks hold no full copy, and tensor
    parallelism's DTensors take the usual path, from the local shards.)"""
    values: dict[str, Any] = {}
    for key, module, name, _ in managed_keys(handle):
        shown = module._parameters.get(name)
        if not keep or shown is None:
            values[key] = None if not keep else shown
            continue
        param = shown.detach()
        if kind == StateDictType.FULL_STATE_DICT:
            values[key] = detached_copy(param, config.offload_to_cpu)
        elif uses_dtensor(unit, config):
            values[key] = chunk_dtensor(param, unit, config.offload_to_cpu)
        else:
            values[key] = chunk_sharded_tensor(param, handle, config.offload_to_cpu)
    return values


def detached_copy(tensor: torch.Tensor, offload_to_cpu: bool) -> torch.Tensor:
    # Straight to the CPU when offloading from an accelerator (no second copy on the device); a clone otherwise, so the
    # value never aliases memory FSDP reuses (torch's CPU offload returns views of a freed buffer on CPU).
    if offload_to_cpu and tensor.device.type != "cpu":
        return tensor.to("cpu")
    return tensor.clone()


def _in_module_order(unit: FSDPUnit, entries: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """Merge the parameter values into the saved entries where nn.Module.state_dict puts them: per module its
    parameters, then its buffers; gathered parameters after the ones still registered (as torch re-registers them).
    Entries holding None (rank0_only on other ranks) are dropped."""
    walk = list(_walk(unit))
    paths = {path for path, _, _ in walk}
    shared = {join_fqn(s.module_name, s.param_name) for handle in unit._handles for s in handle.layout.shared}
    grouped: dict[str, list[str]] = {}
    for key in entries:
        owner = key.rpartition(".")[0]
        while owner and owner not in paths:  # keys below a nested unit belong to it
            owner = owner.rpartition(".")[0]
        grouped.setdefault(owner, []).append(key)
    by_module: dict[str, list[str]] = {}
    for key in values:
        by_module.setdefault(key.rpartition(".")[0], []).append(key)
    ordered: dict[str, Any] = {}
    for path, module, nested in walk:
        keys = grouped.pop(path, [])
        if not nested:
            # Registered parameters first; a tied reference comes with the gathered ones, where torch puts it.
            params = [k for k in keys if k.rpartition(".")[2] in module._parameters and k not in shared]
            gathered = [k for k in by_module.pop(path, []) if k not in params]
            if len(unit._handles) > 1:  # several flat parameters: as registered (one: torch's order, as it is)
                gathered.sort(key=lambda k: unit._registration_order.get(k, -1))
            keys = params + gathered + [k for k in keys if k not in params]
        for key in keys:
            ordered[key] = values[key] if key in values else entries[key]
    for keys in grouped.values():  # entries of custom _save_to_state_dict overrides, if any
        ordered.update((key, entries[key]) for key in keys)
    unplaced = sorted(values.keys() - ordered.keys())
    if unplaced:  # never hand out an incomplete checkpoint (every rank reaches this verdict)
        raise RuntimeError(
            f"FSDP state_dict(): the unit wrapping {type(unit.module).__name__} could not place {unplaced} among its "
            "module's entries, so the state dict would be incomplete. This is a bug in fsdp_legacy: please report it "
            "with print(model). A LOCAL_STATE_DICT saves this unit in the meantime."
        )
    return {key: value for key, value in ordered.items() if value is not None}


def _placement(handle: FlatParamHandle, rank: int, device: torch.device) -> str:
    """torch's placement string: `rank:{global rank}/cpu`, or `.../cuda:{global rank % devices per node}`."""
    global_rank = dist.get_global_rank(handle.group, rank)
    if device.type == "cpu":
        return f"rank:{global_rank}/cpu"
    index = device.index if rank == handle.rank else global_rank % getattr(torch, device.type).device_count()
    return f"rank:{global_rank}/{device.type}:{index}"


def _sharded_tensor(
    handle: FlatParamHandle, size: torch.Size, dtype: torch.dtype, local: torch.Tensor | None, geometry: list
) -> ShardedTensor:
    """A ShardedTensor from this rank's piece and every rank's (rank, offsets, sizes), built without communication."""
    device = local.device if local is not None else handle.local_shard.device
    metadata = [ShardMetadata(offsets, sizes, _placement(handle, r, device)) for r, offsets, sizes in geometry]
    properties = TensorProperties(
        dtype=dtype, layout=torch.strided, requires_grad=False, memory_format=torch.contiguous_format, pin_memory=False
    )
    mine = [meta for (r, _, _), meta in zip(geometry, metadata, strict=True) if r == handle.rank]
    local_shards = [Shard(local, meta) for meta in mine] if local is not None else []
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, ShardedTensorMetadata(metadata, size, properties), process_group=handle.group
    )


def chunk_sharded_tensor(param: torch.Tensor, handle: FlatParamHandle, offload_to_cpu: bool) -> ShardedTensor:
    """torch FSDP1's SHARDED layout: `param.chunk(world_size)` along dim 0, chunk r on rank r; ranks past the
    number of chunks hold nothing and have no metadata entry. A parameter held in memory order (a transpose,
    channels_last) gives row-major chunks, which ShardedTensor requires (torch's raises its ValueError there)."""
    chunks = param.chunk(handle.world_size)
    local = detached_copy(chunks[handle.rank], offload_to_cpu).contiguous() if handle.rank < len(chunks) else None
    return sharded_tensor_of_chunk(local, param.shape, param.dtype, [chunk.shape[0] for chunk in chunks], handle)


def exchanges_chunks(unit: FSDPUnit, handle: FlatParamHandle, config: StateDictConfig | OptimStateDictConfig) -> bool:
    """Whether the SHARDED values of the unit's parameters (or states) are built by exchanging dim-0 chunks
    (chunk_exchange.py) rather than by gathering the unit whole: row-major parameters, ShardedTensors or DTensors on
    FSDP's own mesh (not tensor parallelism's)."""
    if not handle.sharded or handle.dtensors or not can_exchange(handle.layout):
        return False
    return not uses_dtensor(unit, config) or chunks_on_own_mesh(unit)


def sharded_chunks(
    unit: FSDPUnit,
    handle: FlatParamHandle,
    local: torch.Tensor,
    group: dist.ProcessGroup,
    config: StateDictConfig | OptimStateDictConfig,
    local_owned: bool = False,
) -> Iterator[tuple[ParamInfo, Any]]:
    """(the parameter, this rank's SHARDED value of it: a ShardedTensor or a DTensor) of each reference to the unit's
    parameters (tied ones too, each with a tensor of its own, as gathered values have), from every rank's `local`
    shard of a flat tensor (the flat parameter or one of its optimizer states), by one exchange of dim-0 chunks."""
    dtensors = uses_dtensor(unit, config)
    plan = ChunkPlan.of(handle.layout, handle.rank)
    chunks = exchange_chunks(plan, local, group, config.offload_to_cpu and not dtensors, local_owned)
    taken: set[ParamInfo] = set()
    for _, _, _, info in managed_keys(handle):
        piece = chunks.get(info)
        if piece is not None and info in taken:
            piece = piece.clone()
        taken.add(info)
        if dtensors:
            piece = piece if piece is not None else local.new_empty((0, *info.shape[1:]))
            stride = torch.empty(info.shape, device="meta").stride()
            yield info, dtensor_of_chunk(piece, info.shape, stride, unit, config.offload_to_cpu)
        else:
            rows = chunk_rows(info.shape[0], handle.world_size)
            yield info, sharded_tensor_of_chunk(piece, info.shape, local.dtype, rows, handle)


def sharded_tensor_of_chunk(
    local: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype, chunk_rows: list[int], handle: FlatParamHandle
) -> ShardedTensor:
    """The SHARDED value of a parameter (or a state of its shape) of which this rank holds the dim-0 chunk `local`
    (None past the number of chunks); `chunk_rows`: every chunk's number of rows, in rank order."""
    geometry, offset = [], 0
    for r, rows in enumerate(chunk_rows):
        geometry.append((r, [offset] + [0] * (len(shape) - 1), [rows, *shape[1:]]))
        offset += rows
    return _sharded_tensor(handle, shape, dtype, local, geometry)


def local_geometry(handle: FlatParamHandle) -> tuple[int, int, int]:
    """(flat numel without world padding, shard numel, this rank's unpadded shard numel) of a LOCAL_STATE_DICT."""
    layout = handle.layout
    valid = min(layout.shard_numel, max(0, layout.numel - handle.rank * layout.shard_numel))
    return layout.numel, layout.shard_numel, valid


def _local_flat_tensor(handle: FlatParamHandle, offload_to_cpu: bool) -> ShardedTensor:
    """LOCAL_STATE_DICT: the local shard (a view, no copy) in a ShardedTensor over the flat parameter without its
    world padding (with use_orig_params its alignment padding stays), so it only loads at the same world size."""
    numel, shard_numel, valid = local_geometry(handle)
    geometry = [
        (r, [r * shard_numel], [min(shard_numel, numel - r * shard_numel)])
        for r in range(handle.world_size)
        if r * shard_numel < numel
    ]
    local = handle.local_shard[:valid] if valid else None
    if local is not None and offload_to_cpu:
        local = local.cpu()
    return _sharded_tensor(handle, torch.Size([numel]), handle.local_shard.dtype, local, geometry)
