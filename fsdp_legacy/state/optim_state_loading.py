"""Loading an FQN-keyed optimizer state dict (FULL, SHARDED or LOCAL values) into an FSDP model's optimizer
(FSDP.optim_state_dict_to_load): without communication for plain tensors (with FULL rank0_only, rank 0's dict is
broadcast first), each rank slices what its shard holds out of the full value. Parameters are matched by FQN, never
by position, so a checkpoint loads across use_orig_params settings, wrap policies and world sizes.
"""

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..api import FullOptimStateDictConfig
from ..flat_param import ParamInfo
from ..handle import FlatParamHandle
from ..naming import clean_fqn
from .fresh_optim import load_target_problem
from .optim_entries import Entry, ParamGroups, copy_scalar, entries_by_param, is_scalar, param_entries
from .optim_state_named import by_param_names
from .state_dict import get_state_dict_type
from .state_dict_loading import gather_full_tensor, materialize


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """This rank's part of an FQN-keyed optimizer state dict (FULL, SHARDED or LOCAL values), keyed as
    `optim.state_dict()` is: int ids, flat shard states (use_orig_params=False) or 1-D pieces of the original
    parameters (True). With a FULL rank0_only config only rank 0 needs to pass the dict. `is_named_optimizer` keys
    it by the model's parameter names instead (what a _NamedOptimizer loads). `load_directly` loads it."""
    settings = get_state_dict_type(model)
    if settings is None:
        raise ValueError("optim_state_dict_to_load needs a model with at least one FullyShardedDataParallel unit.")
    config = settings.optim_state_dict_config
    rank0_only = isinstance(config, FullOptimStateDictConfig) and config.rank0_only
    problem = load_target_problem(optim, optim_state_dict)
    if rank0_only:  # rank 0's dict and its verdict reach every rank in one broadcast
        optim_state_dict, problem = broadcast_from_rank0([optim_state_dict, problem], group)
    if problem:
        raise RuntimeError(problem)
    result = optim_state_to_load(model, optim, optim_state_dict, broadcast=False, group=group)
    if is_named_optimizer:
        result = by_param_names(model, optim, result)
    if load_directly:
        optim.load_state_dict(result)
    return result


@torch.no_grad()
def optim_state_to_load(
    model: nn.Module, optim: ParamGroups, osd: Any, broadcast: bool, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    if broadcast:
        (osd,) = broadcast_from_rank0([osd], group)
    if not isinstance(osd, dict) or "state" not in osd:  # torch's message, word for word
        raise ValueError('`optim_state_dict` must have the keys "state"to be a valid optimizer state dict')
    entries = param_entries(model, optim)
    saved = _by_clean_fqn(osd["state"], entries_by_param(model))
    state: dict[int, dict[str, Any]] = {}
    for key in _keys_in_model_order(model, optim):
        entry = entries[key][1]
        handle = entry.handle
        value_group = handle.group if handle is not None else group or dist.group.WORLD
        assert value_group is not None
        # Every rank reassembles every value (ShardedTensors need all ranks), then keeps what it holds.
        fulls = [
            {
                n: gather_full_tensor(v, value_group) if not is_scalar(v) else v
                for n, v in ((n, materialize(v)) for n, v in saved.get(fqn, {}).items())
            }
            for fqn in entry.fqns
        ]
        if handle is not None:  # a parameter outside every unit has no layout to check against
            for fqn, info, values in zip(entry.fqns, entry.infos, fulls, strict=True):
                record = handle.dtensors.get(info)
                _check_shapes(fqn, values, record.shape if record is not None else info.shape)
                if record is not None:  # the flat parameter holds this rank's tp piece of a DTensor parameter
                    values.update((n, record.local_piece(v)) for n, v in values.items() if not is_scalar(v))
        if handle is None:
            local = {n: copy_scalar(v) if is_scalar(v) else v.clone() for n, v in fulls[0].items()}
        elif not handle.use_orig_params:
            local = _flat_local(handle, entry, fulls)
        else:
            local = _piece_local(handle, entry.infos[0], fulls[0])
        if local:
            state[key] = local
    if "param_groups" not in osd:  # a state alone loads as a state alone, as in torch
        return {"state": state}
    return {"state": state, "param_groups": _param_groups(entries, osd["param_groups"])}


def broadcast_from_rank0(objects: list[Any], group: dist.ProcessGroup | None) -> list[Any]:
    """Rank 0's `objects` on every rank of `group` (one broadcast_object_list; nothing to do alone)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return objects
    holder = list(objects) if dist.get_rank(group) == 0 else [None] * len(objects)
    dist.broadcast_object_list(holder, group=group, group_src=0)
    return holder


def _keys_in_model_order(model: nn.Module, optim: ParamGroups) -> list[int]:
    """The optimizer's ids in the order of the model's parameters: the same on every rank, whose optimizers can order
    them differently, so that values are reassembled in step; and torch's order of the loaded states."""
    params = [param for group in optim.param_groups for param in group["params"]]
    position = {param: index for index, param in enumerate(model.parameters())}
    return sorted(range(len(params)), key=lambda key: position.get(params[key], len(position)))


def _by_clean_fqn(saved: dict[Any, Any], entries: dict[nn.Parameter, Entry]) -> dict[str, Any]:
    """The saved states by clean FQN; a key that names no parameter of the model is an error, not a state to drop
    silently (a checkpoint of another model, keys with wrapper prefixes of another wrapping, or an id-keyed dict)."""
    known = {fqn for entry in entries.values() for fqn in entry.fqns}
    states = {clean_fqn(key) if isinstance(key, str) else key: value for key, value in saved.items()}
    unexpected = [key for key in states if key not in known]
    if unexpected:
        ids = all(isinstance(key, int) for key in unexpected)
        raise ValueError(
            f"The optimizer state dict has states for {sorted(map(str, unexpected))[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}, which name no parameter of this model. "
            + (
                "It is keyed by parameter ids (optim.state_dict()): load it with optim.load_state_dict, or re-key it "
                "with FSDP.rekey_optim_state_dict."
                if ids
                else "Load an optimizer state dict saved from this model with FSDP.optim_state_dict (FQN keys)."
            )
        )
    return states


def _check_shapes(fqn: str, values: dict[str, Any], shape: torch.Size) -> None:
    # Slicing a state of another shape would load garbage silently (or fail far from the cause).
    for name, value in values.items():
        if not is_scalar(value) and value.shape != shape:
            piece = value.dim() == 1 and value.numel() <= math.prod(shape)
            raise ValueError(
                f"The optimizer state '{name}' of {fqn} has shape {tuple(value.shape)} but the parameter has shape "
                f"{tuple(shape)}: load an optimizer state dict saved from this model (same architecture)."
                + (
                    " It looks like one rank's flat piece rather than the whole state: a checkpoint saved from the "
                    "optimizer's own state_dict(), or by torch's DSD helpers without fsdp_legacy.install(), holds "
                    "pieces; save with FSDP.optim_state_dict (or with the switch on)."
                    if piece
                    else ""
                )
            )


def _flat_local(handle: FlatParamHandle, entry: Entry, fulls: list[dict[str, Any]]) -> dict[str, Any]:
    """use_orig_params=False: the flat parameter's state is this rank's shard of the concatenated full states
    (padding and parameters without that state are zeros); none when the first parameter has none, as torch."""
    local: dict[str, Any] = {}
    if not fulls[0]:
        return local
    n = handle.local_shard.numel()
    lo = handle.rank * n if handle.sharded else 0
    for info, values in zip(entry.infos, fulls, strict=True):
        for name, value in values.items():
            if is_scalar(value):
                local.setdefault(name, copy_scalar(value))
                continue
            if name not in local:
                local[name] = torch.zeros(n, dtype=value.dtype, device=handle.local_shard.device)
            start, end = max(lo, info.offset), min(lo + n, info.offset + info.numel)
            if start < end:
                local[name][start - lo : end - lo].copy_(info.flatten(value)[start - info.offset : end - info.offset])
    for name in [name for name, value in local.items() if is_scalar(value)]:
        _check_one_scalar(name, [values.get(name) for values in fulls], list(entry.fqns))
    return local


def _check_one_scalar(name: str, values: list[Any], fqns: list[str]) -> None:
    """A flat parameter has one `step` for all its parameters: torch refuses to invent one for a parameter without
    it (no step means full bias correction) or to pick among differing ones; its messages, word for word."""
    prefix = "All unflattened parameters comprising a single flat parameter must have scalar state with the same value"
    present = [value for value in values if value is not None]
    if not present:  # None everywhere loads as None, as in torch
        return
    missing = len(present) != len(values)
    if isinstance(present[0], torch.Tensor):
        numbers = {v.item() if v is not None else None for v in values}
        dtypes = {v.dtype if v is not None else None for v in values}
        if missing or len(numbers) != 1 or len(dtypes) != 1:
            raise ValueError(
                f"{prefix} and dtype but got values {numbers} and dtypes {dtypes} for state {name} and unflattened "
                f"parameter names {fqns}"
            )
    elif missing or len(set(values)) != 1:
        raise ValueError(
            f"{prefix} and dtype but got values {set(values)} for state {name} and  unflattened parameter names {fqns}"
        )


def _piece_local(handle: FlatParamHandle, info: ParamInfo, values: dict[str, Any]) -> dict[str, Any]:
    """use_orig_params=True: the part of each state this rank's shard holds, 1-D like the parameter; no state at all
    where the parameter's gradient is None (as torch's optimizer, which never saw one there): where the rank holds
    none of it, or it has no elements and lies outside the rank's range (handle.has_grad_slot)."""
    if not handle.has_grad_slot(info):
        return {}
    if not handle.sharded:
        return {n: copy_scalar(v) if is_scalar(v) else v.detach().clone() for n, v in values.items()}
    piece = next((p for p in handle.layout.shard_pieces(handle.rank) if p.info is info), None)
    lo, hi = (0, 0) if piece is None else (piece.start_in_param, piece.start_in_param + piece.numel_in_shard)
    return {n: copy_scalar(v) if is_scalar(v) else info.flatten(v)[lo:hi].clone() for n, v in values.items()}


def _param_groups(entries: list[tuple[int, Entry]], saved: list[dict]) -> list[dict]:
    """The saved groups, in their order and with their hyperparameters, each listing the ids (this rank's order of
    the optimizer's parameters, or of optim_input's) of the parameters whose FQNs it names, sorted: as torch's
    FSDP1 rekeys them. A parameter the saved dict does not name (one the optimizer holds beside FSDP's units, as in
    model parallelism) has no id there; the caller adds its entry to load it, as with torch's."""
    id_of = {fqn: key for key, (_, entry) in enumerate(entries) for fqn in entry.fqns}
    return [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": sorted({id_of[f] for f in map(_clean_name, group["params"]) if f in id_of}),
        }
        for group in saved
    ]


def _clean_name(fqn: Any) -> Any:
    return clean_fqn(fqn) if isinstance(fqn, str) else fqn
