"""Model state dicts of FSDP units: FULL_STATE_DICT, SHARDED_STATE_DICT and LOCAL_STATE_DICT (torch FSDP1 formats).

Every unit registers nn.Module state-dict hooks, so `model.state_dict()` / `model.load_state_dict()` work on the root
(or on any module containing FSDP units):

* saving: nn.Module saves a unit's subtree (nested units first, each already converted by its own hook); then the
  unit's post hook rewrites its entries: `_fsdp_wrapped_module.` goes, and its flat parameter (or, with
  use_orig_params, the 1-D shard views) becomes full tensors (FULL), dim-0 chunks in ShardedTensors/DTensors (SHARDED)
  or a ShardedTensor of the local flat shard (LOCAL). A unit is gathered, copied out and dropped before the next one
  is, so at most one unit is ever unsharded.
* loading: each unit's pre hook copies what this rank owns straight into its local shard (FULL: a slice of the full
  tensor, no communication; SHARDED: the dim-0 chunks reassembled first; LOCAL: the flat shard) and hands nn.Module
  the tensors it has registered, so nn.Module's own missing/unexpected/size bookkeeping stays right.
"""

import contextlib
import dataclasses
import warnings
from enum import Enum
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard

from . import _collectives as comm
from . import fully_sharded_data_parallel as _fsdp  # circular: only used at call time
from .api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .convert.errors import CheckpointError
from .convert.record import RECORD_SUFFIX, FlatParamRecord
from .flat_param import ParamInfo
from .handle import FlatParamHandle

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel as Unit

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


def init_unit(unit: "Unit") -> None:
    """Give a new FSDP unit torch's default settings (FULL_STATE_DICT) and its state-dict hooks."""
    unit._state_dict_type = StateDictType.FULL_STATE_DICT
    unit._state_dict_config = FullStateDictConfig()
    unit._optim_state_dict_config = FullOptimStateDictConfig()
    unit._register_state_dict_hook(_post_state_dict_hook)
    unit._register_load_state_dict_pre_hook(_pre_load_state_dict_hook, with_module=True)
    unit.register_load_state_dict_post_hook(_post_load_state_dict_hook)


# --------------------------------------------------------------------------------------------------------------------
# Settings: FSDP.set_state_dict_type / get_state_dict_type / state_dict_type


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: Optional[StateDictConfig] = None,
    optim_state_dict_config: Any = None,
) -> StateDictSettings:
    """Set the state-dict type and configs of every FSDP unit in `module`; returns the previous settings."""
    warnings.warn(_DEPRECATION, FutureWarning, stacklevel=2)
    state_dict_type = _as_ours(StateDictType, state_dict_type)
    config_type, optim_config_type = _CONFIG_TYPES[state_dict_type]
    state_dict_config = _config(config_type, state_dict_config, "state_dict_config")
    optim_state_dict_config = _config(optim_config_type, optim_state_dict_config, "optim_state_dict_config")
    previous: Optional[StateDictSettings] = None
    for unit in _fsdp.FullyShardedDataParallel.fsdp_modules(module):
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


def get_state_dict_type(module: nn.Module) -> Optional[StateDictSettings]:
    """The settings shared by every FSDP unit in `module` (None without units); AssertionError if they differ."""
    settings: Optional[StateDictSettings] = None
    for unit in _fsdp.FullyShardedDataParallel.fsdp_modules(module):
        if settings is None:
            settings = _settings(unit)
        elif _settings(unit) != settings:
            raise AssertionError(
                f"All FSDP modules must have the same state dict settings.Got {_settings(unit)} and {settings}."
            )
    return settings


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: Optional[StateDictConfig] = None,
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


def _settings(unit: "Unit") -> StateDictSettings:
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


def _effective(unit: "Unit") -> tuple[StateDictType, StateDictConfig]:
    """The type and config a unit uses now: NO_SHARD units always use a default FULL_STATE_DICT, as torch does."""
    if unit.sharding_strategy == ShardingStrategy.NO_SHARD:
        warnings.warn(_NO_SHARD_WARNING, stacklevel=3)
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
    if unit._state_dict_type == StateDictType.LOCAL_STATE_DICT and unit._device_mesh is not None:
        raise RuntimeError(
            "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with LOCAL_STATE_DICT. "
            "Please set state_dict_type to SHARDED_STATE_DICT to get DTensor state_dict."
        )
    return unit._state_dict_type, unit._state_dict_config


# --------------------------------------------------------------------------------------------------------------------
# Saving


@torch.no_grad()
def _post_state_dict_hook(unit: "Unit", destination: dict, prefix: str, local_metadata: Any) -> None:
    kind, config = _effective(unit)
    handle: Optional[FlatParamHandle] = unit._handle
    # The unit's entries are the last ones saved (its whole subtree); take them out and put them back rewritten.
    entries = {_relative(key, prefix): destination.pop(key) for key in [k for k in destination if k.startswith(prefix)]}
    own_buffers = _own_buffer_keys(unit)
    rank0_only = isinstance(config, FullStateDictConfig) and config.rank0_only
    keep = not rank0_only or unit.rank == 0
    if handle is not None:
        if kind == StateDictType.LOCAL_STATE_DICT:
            entries[_fsdp.FLAT_PARAM] = _local_flat_tensor(handle, config.offload_to_cpu)
            # fsdp_legacy's addition, right after it: the layout record that makes the checkpoint readable without the
            # model's code (docs/compatibility.md).
            record = FlatParamRecord.from_layout(handle.layout, _clean(prefix), handle.local_shard.dtype)
            entries = {
                key: value
                for name, entry in entries.items()
                for key, value in [(name, entry)] + ([(name + RECORD_SUFFIX, record.to_tensor())]
                                                     if name == _fsdp.FLAT_PARAM else [])
            }
        else:
            entries.pop(_fsdp.FLAT_PARAM, None)
            values = _unsharded_values(unit, handle, kind, config, keep)
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


def _relative(key: str, prefix: str) -> str:
    return key[len(prefix) :].removeprefix(_fsdp.FSDP_PREFIX)


def _clean(key: str) -> str:
    return key.replace(_fsdp.FSDP_PREFIX, "")


def _walk(unit: "Unit") -> Iterator[tuple[str, nn.Module, bool]]:
    """(path, module, is a nested unit) below the unit's wrapped module, in nn.Module.state_dict order."""
    root = unit._fsdp_wrapped_module
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        path, module = stack.pop()
        nested = module is not root and isinstance(module, _fsdp.FullyShardedDataParallel)
        yield path, module, nested
        if not nested:
            children = [(_join(path, name), child) for name, child in module._modules.items() if child is not None]
            stack.extend(reversed(children))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _own_buffer_keys(unit: "Unit") -> set[str]:
    return {
        _join(path, name)
        for path, module, nested in _walk(unit)
        if not nested
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    }


def _managed_keys(handle: FlatParamHandle) -> Iterator[tuple[str, nn.Module, str, ParamInfo]]:
    """(key relative to the wrapped module, owning module, attribute name, the stored parameter) of every reference
    to a managed parameter, tied ones too."""
    for info in handle.layout.params:
        yield info.fqn, info.module, info.param_name, info
    for shared in handle.layout.shared:
        yield _join(shared.module_name, shared.param_name), shared.module, shared.param_name, shared.primary


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
        full.untyped_storage().resize_(0)


def _unsharded_values(
    unit: "Unit", handle: FlatParamHandle, kind: StateDictType, config: StateDictConfig, keep: bool
) -> dict[str, Any]:
    """FULL: a cloned full tensor per parameter reference; SHARDED: its dim-0 chunk as a ShardedTensor/DTensor.
    Ranks that keep nothing (rank0_only) still take part in the gather and get None values."""
    values: dict[str, Any] = {}
    with _gathered(handle) as full:
        for key, _, _, info in _managed_keys(handle):
            if not keep:
                values[key] = None
                continue
            param = full[info.offset : info.offset + info.numel].view(info.shape)
            if kind == StateDictType.FULL_STATE_DICT:
                values[key] = _copy(param, config.offload_to_cpu)
            elif getattr(config, "_use_dtensor", False) or unit._device_mesh is not None:
                values[key] = _chunk_dtensor(param, unit, config.offload_to_cpu)
            else:
                values[key] = _chunk_sharded_tensor(param, handle, config.offload_to_cpu)
    return values


def _copy(tensor: torch.Tensor, offload_to_cpu: bool) -> torch.Tensor:
    # Straight to the CPU when offloading from an accelerator (no second copy on the device); a clone otherwise, so the
    # value never aliases memory FSDP reuses (torch's CPU offload returns views of a freed buffer on CPU).
    if offload_to_cpu and tensor.device.type != "cpu":
        return tensor.to("cpu")
    return tensor.clone()


def _in_module_order(unit: "Unit", entries: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """Merge the parameter values into the saved entries where nn.Module.state_dict puts them: per module its
    parameters, then its buffers; gathered parameters after the ones still registered (as torch re-registers them).
    Entries holding None (rank0_only on other ranks) are dropped."""
    walk = list(_walk(unit))
    paths = {path for path, _, _ in walk}
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
            params = [k for k in keys if k.rpartition(".")[2] in module._parameters]
            gathered = [k for k in by_module.pop(path, []) if k not in params]
            keys = params + gathered + [k for k in keys if k not in params]
        for key in keys:
            ordered[key] = values[key] if key in values else entries[key]
    for keys in grouped.values():  # entries of custom _save_to_state_dict overrides, if any
        ordered.update((key, entries[key]) for key in keys)
    return {key: value for key, value in ordered.items() if value is not None}


def _placement(handle: FlatParamHandle, rank: int, device: torch.device) -> str:
    """torch's placement string: `rank:{global rank}/cpu`, or `.../cuda:{global rank % devices per node}`."""
    global_rank = dist.get_global_rank(handle.group, rank)
    if device.type == "cpu":
        return f"rank:{global_rank}/cpu"
    index = device.index if rank == handle.rank else global_rank % getattr(torch, device.type).device_count()
    return f"rank:{global_rank}/{device.type}:{index}"


def _sharded_tensor(
    handle: FlatParamHandle, size: torch.Size, dtype: torch.dtype, local: Optional[torch.Tensor], geometry: list
) -> ShardedTensor:
    """A ShardedTensor from this rank's piece and every rank's (rank, offsets, sizes), built without communication."""
    device = local.device if local is not None else handle.local_shard.device
    metadata = [ShardMetadata(offsets, sizes, _placement(handle, r, device)) for r, offsets, sizes in geometry]
    properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    mine = [meta for (r, _, _), meta in zip(geometry, metadata) if r == handle.rank]
    local_shards = [Shard(local, meta) for meta in mine] if local is not None else []
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, ShardedTensorMetadata(metadata, size, properties), process_group=handle.group
    )


def _chunk_sharded_tensor(param: torch.Tensor, handle: FlatParamHandle, offload_to_cpu: bool) -> ShardedTensor:
    """torch FSDP1's SHARDED layout: `param.chunk(world_size)` along dim 0, chunk r on rank r; ranks past the
    number of chunks hold nothing and have no metadata entry."""
    chunks = param.chunk(handle.world_size)
    geometry, offset = [], 0
    for r, chunk in enumerate(chunks):
        geometry.append((r, [offset] + [0] * (param.dim() - 1), list(chunk.shape)))
        offset += chunk.shape[0]
    local = _copy(chunks[handle.rank], offload_to_cpu) if handle.rank < len(chunks) else None
    return _sharded_tensor(handle, param.shape, param.dtype, local, geometry)


def _chunk_dtensor(param: torch.Tensor, unit: "Unit", offload_to_cpu: bool) -> torch.Tensor:
    chunks = param.chunk(unit.world_size)
    rank = unit.rank
    local = chunks[rank].clone() if rank < len(chunks) else param.new_empty((0, *param.shape[1:]))
    dtensor = DTensor.from_local(
        local, unit._device_mesh, [DShard(0)], run_check=False, shape=param.shape, stride=param.stride()
    )
    return dtensor.cpu() if offload_to_cpu and dtensor.device.type != "cpu" else dtensor


def _local_geometry(handle: FlatParamHandle) -> tuple[int, int, int]:
    """(flat numel without world padding, shard numel, this rank's unpadded shard numel) of a LOCAL_STATE_DICT."""
    layout = handle.layout
    valid = min(layout.shard_numel, max(0, layout.numel - handle.rank * layout.shard_numel))
    return layout.numel, layout.shard_numel, valid


def _local_flat_tensor(handle: FlatParamHandle, offload_to_cpu: bool) -> ShardedTensor:
    """LOCAL_STATE_DICT: the local shard (a view, no copy) in a ShardedTensor over the flat parameter without its
    world padding (with use_orig_params its alignment padding stays), so it only loads at the same world size."""
    numel, shard_numel, valid = _local_geometry(handle)
    geometry = [
        (r, [r * shard_numel], [min(shard_numel, numel - r * shard_numel)])
        for r in range(handle.world_size)
        if r * shard_numel < numel
    ]
    local = handle.local_shard[:valid] if valid else None
    if local is not None and offload_to_cpu:
        local = local.cpu()
    return _sharded_tensor(handle, torch.Size([numel]), handle.local_shard.dtype, local, geometry)


# --------------------------------------------------------------------------------------------------------------------
# Loading


def load_state_dict(unit: "Unit", state_dict: Mapping[str, Any], strict: bool, assign: bool) -> Any:
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


def _strict_hint(unit: "Unit") -> str:
    return (
        f"The model loads a {unit._state_dict_type.name} (set with FSDP.state_dict_type): load a checkpoint saved from "
        "this model under the same type, or pass strict=False to load only the keys present (load_state_dict returns "
        "the others)."
    )


@torch.no_grad()
def _pre_load_state_dict_hook(
    unit: "Unit",
    state_dict: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    kind, _ = _effective(unit)
    wrapped = prefix + _fsdp.FSDP_PREFIX
    for key in [k for k in state_dict if k.startswith(prefix)]:  # checkpoint names -> this unit's module names
        state_dict[wrapped + key[len(prefix) :]] = state_dict.pop(key)
    handle: Optional[FlatParamHandle] = unit._handle
    if handle is None:
        return
    if local_metadata.get("assign_to_params_buffers"):  # raised before any module of the unit has loaded
        raise RuntimeError(
            "load_state_dict(assign=True) is not supported by FSDP: its parameters are flat shards that cannot be "
            "replaced by the checkpoint's tensors. Call load_state_dict(state_dict) without assign."
        )
    if handle.sharded and handle.is_unsharded:
        handle.reshard()  # an unsharded copy left from forward would go stale; backward re-gathers if it needs it
    # Take the unit's parameter entries out: they are loaded (and reported missing) here, not by nn.Module.
    flat_key = wrapped + _fsdp.FLAT_PARAM
    flat_value = state_dict.pop(flat_key, None)
    local = kind == StateDictType.LOCAL_STATE_DICT
    record = state_dict.pop(flat_key + RECORD_SUFFIX, None) if local else None  # absent in torch's LOCAL dicts
    refs = [(wrapped + relative, module, name, info) for relative, module, name, info in _managed_keys(handle)]
    values = {key: state_dict.pop(key) for key, *_ in refs if key in state_dict}
    registered = {key: module._parameters.get(name) for key, module, name, _ in refs}
    # A LOCAL_STATE_DICT names parameters only as use_orig_params' 1-D local views (beside _flat_param).
    by_name = [key for key, value in values.items() if not _same_shape(value, registered[key])]
    if (flat_value is not None and not local) or (local and by_name):
        error_msgs.append(_wrong_type_message(kind, _clean(flat_key if flat_value is not None else by_name[0])))
        values = {}
    elif local:
        if flat_value is None:
            missing_keys.append(flat_key)
        else:
            _load_local(handle, _clean(flat_key), flat_value, record, error_msgs)
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


def _same_shape(value: Any, registered: Optional[torch.Tensor]) -> bool:
    return registered is not None and type(value) is torch.Tensor and value.shape == registered.shape


def _wrong_type_message(kind: StateDictType, key: str) -> str:
    if kind == StateDictType.LOCAL_STATE_DICT:
        return (
            f"{key} is a parameter by name, but the model loads a LOCAL_STATE_DICT (a ShardedTensor under "
            f"{_fsdp.FLAT_PARAM} per FSDP unit): load this checkpoint inside FSDP.state_dict_type(model, "
            "StateDictType.FULL_STATE_DICT) for plain tensors or SHARDED_STATE_DICT for ShardedTensor/DTensor values."
        )
    return (
        f"{key} is a LOCAL_STATE_DICT entry, but the model loads a {kind.name}: load this checkpoint inside "
        "FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT)."
    )


def _load_by_name(
    handle: FlatParamHandle, refs: list[tuple[str, ParamInfo]], values: dict[str, Any], missing_keys: list[str],
    error_msgs: list[str],
) -> None:
    """FULL/SHARDED: copy the part of each full parameter that lies in this rank's shard into the shard (tied
    references in order, so the last one wins, as in torch)."""
    pieces = {piece.info: piece for piece in handle.layout.shard_pieces(handle.rank)}
    for key, info in refs:
        if key not in values:
            missing_keys.append(key)
            continue
        if not _check(_clean(key), values[key], info.shape, handle.local_shard.dtype, error_msgs):
            continue
        full = _full_tensor(values[key], handle.group).reshape(-1)  # every rank joins, whatever it owns
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


def _full_tensor(value: Any, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor behind a state-dict value: plain tensors as they are, DTensors gathered, ShardedTensors
    reassembled from every rank's shards (any non-overlapping layout: each rank writes its shards into zeros, then a
    sum all-reduce, which is exact since every element has one non-zero contributor)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if not isinstance(value, ShardedTensor):
        return value
    metadata = value.metadata()
    full = torch.zeros(metadata.size, dtype=metadata.tensor_properties.dtype, device=_collective_device(group))
    for shard in value.local_shards():
        region = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
        full[region].copy_(shard.tensor)
    dist.all_reduce(full, group=group)
    return full


def _collective_device(group: dist.ProcessGroup) -> torch.device:
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
    numel, shard_numel, valid = _local_geometry(handle)
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
    where = f"{key}{RECORD_SUFFIX}"
    try:
        saved = FlatParamRecord.from_tensor(value, where)
    except CheckpointError as error:
        error_msgs.append(str(error))
        return False
    mine = FlatParamRecord.from_layout(handle.layout, saved.prefix, handle.local_shard.dtype)
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


def _post_load_state_dict_hook(unit: "Unit", incompatible_keys: Any) -> None:
    """Report keys by their checkpoint names, without `_fsdp_wrapped_module.`."""
    for keys in incompatible_keys:
        keys[:] = [_clean(key) for key in keys]
