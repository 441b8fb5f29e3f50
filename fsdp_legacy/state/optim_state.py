"""Saving optimizer state dicts of FSDP models in torch FSDP1's formats (FSDP.optim_state_dict); loading them is
optim_state_loading.py, and what each optimizer parameter stands for, optim_entries.py.

The optimizer sees flat-parameter shards (use_orig_params=False: one 1-D state per unit) or 1-D pieces of the
original parameters (use_orig_params=True; none on a rank that holds no element). Checkpoints instead name every
original parameter by its clean FQN. Per unit and state name, one at a time: assemble this rank's shard of the flat
state, then either exchange dim-0 chunks (SHARDED/LOCAL: each parameter's chunk as a ShardedTensor or DTensor, the
layout of the SHARDED model state dict; chunk_exchange.py) or all-gather it and cut out each original parameter
(FULL: a copy of the original shape). 0-d states (`step`) and non-tensors are copied, never gathered.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives as comm
from ..api import (
    FullOptimStateDictConfig,
    OptimStateDictConfig,
    StateDictType,
)
from ..flat_param import ParamInfo
from ..handle import FlatParamHandle
from ..storage import free_storage
from ..tensor_parallel import DTensorParam
from ..unit import FSDPUnit
from .dcp_load_hook import install as install_dcp_load_hook
from .fresh_optim import Refill, note_returned
from .optim_entries import Entry, copy_scalar, entries_by_param, is_scalar, param_entries
from .optim_state_named import by_param_ids, keyed_by_name
from .state_dict import chunk_sharded_tensor, detached_copy, exchanges_chunks, get_state_dict_type, sharded_chunks
from .state_dict_dtensor import chunk_dtensor, uses_dtensor


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _local_state_by_fqn(entries: list[tuple[int, Entry]], state: dict[int, dict[str, Any]]) -> dict[str, dict]:
    """Per FQN, the local state values (flat-parameter states are listed under each of its FQNs)."""
    result: dict[str, dict[str, Any]] = {}
    for key, (_, entry) in enumerate(entries):
        if key in state:
            for fqn in entry.fqns:
                result[fqn] = state[key]
    return result


def _raise_first(errors: list[str | None]) -> None:
    """The first rank's error, raised alike on every rank that saw the list."""
    for error in errors:
        if error is not None:
            raise ValueError(error)


def _global_specs(
    local: dict[str, dict[str, Any]], group: dist.ProcessGroup | None, error: str | None = None
) -> dict[str, dict[str, Any]]:
    """Per FQN and state name, across ranks: the dtype of a sharded state, or the value of a scalar one.

    Ranks can lack a parameter's state (use_orig_params=True, no local elements); they still have to join the gathers
    and, for rank0_only, rank 0 needs the scalars of parameters it holds no part of."""
    # Scalars travel on the CPU: an unpickled accelerator tensor would land on the sender's device index.
    mine = {
        fqn: {name: (False, _to_cpu(v)) if is_scalar(v) else (True, v.dtype) for name, v in values.items()}
        for fqn, values in local.items()
    }
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        _raise_first([error])
        return mine
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (mine, error), group=group)
    _raise_first([e for _, e in everyone])
    everyone = [specs for specs, _ in everyone]
    merged: dict[str, dict[str, Any]] = {}
    for specs in everyone:
        for fqn, names in specs.items():
            for name, spec in names.items():
                merged.setdefault(fqn, {}).setdefault(name, spec)
    return merged


# --------------------------------------------------------------------------------------------------------------------
# Saving


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """The optimizer state keyed by clean FQNs, in the format of the model's current state_dict_type: FULL gives
    full tensors of the original shapes (honouring rank0_only and offload_to_cpu); SHARDED and LOCAL give their
    dim-0 chunks as ShardedTensors (DTensors with a device mesh). `group` (default: the world) is where the parameters'
    state names are exchanged and whose rank 0 keeps the dict with rank0_only; each unit gathers over its own group."""
    settings = get_state_dict_type(model)
    if settings is None:
        raise ValueError("optim_state_dict needs a model with at least one FullyShardedDataParallel unit.")
    kind, config = settings.state_dict_type, settings.optim_state_dict_config
    result = save_optim_state(model, optim, optim_state_dict, kind, config, group)
    # A fresh optimizer's dict may come back as a load target, to be filled from the checkpoint (fresh_optim.py).
    rank0_only = kind == StateDictType.FULL_STATE_DICT and getattr(config, "rank0_only", False)
    refill = None
    if not rank0_only:  # every rank holds a target, so every rank builds its state (a collective) at the load
        refill = Refill(
            lambda: _params_and_fqns(model, optim),
            lambda osd: save_optim_state(model, optim, osd, kind, config, group),
            _uses_orig_params(model),
        )
    note_returned(optim, result, refill)
    install_dcp_load_hook()  # (normally done when fsdp_legacy was imported)
    return result


def _params_and_fqns(model: nn.Module, optim: torch.optim.Optimizer) -> list[tuple[torch.Tensor, tuple[str, ...]]]:
    """Each parameter the optimizer holds, in its state-dict order, with the FQNs it stands for."""
    params = [param for group in optim.param_groups for param in group["params"]]
    return [(param, entry.fqns) for param, (_, entry) in zip(params, param_entries(model, optim), strict=True)]


@dataclass
class OptimSavePlan:
    """What saving an optimizer's state reads of the model and the optimizer: its state dict (`osd`, keyed by ids),
    what each of its parameters stands for, and the flat parameters in the model's order. Building the saved dict
    from it reads the handles' layouts, never their values, so a plan whose `osd` holds copies builds in the
    background (async_save.py)."""

    osd: dict[str, Any]
    entries: list[tuple[int, Entry]]
    units: list[tuple[FSDPUnit, FlatParamHandle, list[tuple[ParamInfo, str]]]]
    uses_orig_params: bool
    error: str | None = None  # this rank's dict could not be read: every rank raises it at the first exchange


def plan_optim_save(model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any] | None) -> OptimSavePlan:
    osd = optim.state_dict() if osd is None else osd
    entries = param_entries(model, optim)
    error = None
    if keyed_by_name(osd):  # a named optimizer (_NamedOptimizer, torchrec's): saved as if keyed by ids
        try:
            osd = by_param_ids(model, [param for group in optim.param_groups for param in group["params"]], osd)
        except ValueError as failure:  # raised on every rank at the first exchange, not here alone (no hang)
            osd, error = {"state": {}, "param_groups": []}, str(failure)
    units = _handles_in_model_order(model)
    for _, handle, _ in units:
        # use_orig_params: after zero_grad(set_to_none=True) the sharded gradients are freed before the save's
        # gathers, as torch's FSDP1 frees them (else the next forward would).
        handle.sync_grad_from_orig_params()
    return OptimSavePlan(osd, entries, units, _uses_orig_params(model), error)


@torch.no_grad()
def save_optim_state(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    osd: dict[str, Any] | None,
    kind: StateDictType,
    config: OptimStateDictConfig,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    return build_optim_state(plan_optim_save(model, optim, osd), kind, config, group)


@torch.no_grad()
def build_optim_state(
    plan: OptimSavePlan,
    kind: StateDictType,
    config: OptimStateDictConfig,
    group: dist.ProcessGroup | None = None,
    unit_groups: dict[dist.ProcessGroup, dist.ProcessGroup] | None = None,
) -> dict[str, Any]:
    """The saved dict; `unit_groups` maps a unit's group to the one its gathers use instead (a background save's own,
    whose gathers then run on the CPU, where the copies of the plan's state are)."""
    osd, entries = plan.osd, plan.entries
    rank0_keys = None if plan.uses_orig_params else _check_rank0_states(entries, osd["state"], group, plan.error)
    local = _local_state_by_fqn(entries, osd["state"])
    specs = _global_specs(local, group, plan.error if plan.uses_orig_params else None)
    rank0_only = isinstance(config, FullOptimStateDictConfig) and config.rank0_only
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank(group) == 0
    full = kind == StateDictType.FULL_STATE_DICT
    values: dict[str, dict[str, Any]] = {}  # fqn -> name -> saved value
    for key, (_, entry) in enumerate(entries):
        if entry.handle is None and keep:
            values[entry.fqns[0]] = {
                n: copy_scalar(v) if is_scalar(v) else detached_copy(v, config.offload_to_cpu)
                for n, v in osd["state"].get(key, {}).items()
            }
    # Units gather in the model's order, the same on every rank whatever order each rank's optimizer has.
    for unit, handle, infos in plan.units:
        unit_specs = {fqn: specs[fqn] for _, fqn in infos if fqn in specs}
        if unit_specs:
            saved = _save_unit(unit, handle, infos, local, unit_specs, _SaveAs(full, config, keep), unit_groups)
            values.update(saved)
    if not keep:
        return {}
    # torch's order: rank 0's optimizer's with flat parameters (it takes rank 0's keys), else this rank's.
    first = [fqn for fqns in rank0_keys or () for fqn in fqns]
    order = dict.fromkeys([*first, *(fqn for _, entry in entries for fqn in entry.fqns)])
    state = {fqn: values[fqn] for fqn in order if values.get(fqn)}
    if any(entry.handle is not None and entry.handle.use_orig_params for _, entry in entries):
        state = _in_torch_uop_order(state, entries)
    if "param_groups" not in osd:  # a state alone saves as a state alone, as in torch
        return {"state": state}
    # Each saved group as it is, its parameters' ids (in its order) replaced by their FQNs.
    param_groups = [
        {k: [fqn for key in v for fqn in entries[key][1].fqns] if k == "params" else v for k, v in saved.items()}
        for saved in osd["param_groups"]
    ]
    return {"state": state, "param_groups": param_groups}


def _uses_orig_params(model: nn.Module) -> bool:
    unit = next((m for m in model.modules() if isinstance(m, FSDPUnit)), None)
    return unit is not None and all(handle.use_orig_params for handle in unit._handles)


def _check_rank0_states(
    entries: list[tuple[int, Entry]], state: dict[Any, Any], group: dist.ProcessGroup | None, error: str | None
) -> list[tuple[str, ...]] | None:
    """With flat parameters torch takes rank 0's list of states as the one every rank gathers; a rank lacking one of
    them would skip a gather and hang the others, so every rank raises torch's RuntimeError instead. (A rank's
    `error` travels with the list: every rank raises it.)"""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        _raise_first([error])
        return None
    held = [entry.fqns for key, (_, entry) in enumerate(entries) if key in state]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (held, error), group=group)
    _raise_first([e for _, e in everyone])
    everyone = [h for h, _ in everyone]
    missing = [[fqns for fqns in everyone[0] if fqns not in set(mine)] for mine in everyone]
    if any(missing):  # torch's message, word for word
        raise RuntimeError(
            "FSDP currently requires each rank to have at least the optimizer states needed by rank 0's optimizer "
            "but some ranks are missing some of those states"
            + "".join(
                f"\nRank {rank} is missing states for the parameters: {keys}"
                for rank, keys in enumerate(missing)
                if keys
            )
        )
    return everyone[0]


def _handles_in_model_order(model: nn.Module) -> list[tuple[FSDPUnit, FlatParamHandle, list[tuple[ParamInfo, str]]]]:
    """(unit, flat parameter, [(layout info, FQN)]) of every flat parameter, in an order every rank shares."""
    handles: dict[int, tuple[FSDPUnit, FlatParamHandle, list[tuple[ParamInfo, str]]]] = {}
    for entry in entries_by_param(model).values():
        if entry.unit is not None and entry.handle is not None:
            handles.setdefault(id(entry.handle), (entry.unit, entry.handle, []))[2].extend(
                zip(entry.infos, entry.fqns, strict=True)
            )
    return list(handles.values())


def _in_torch_uop_order(state: dict[str, Any], entries: list[tuple[int, Entry]]) -> dict[str, Any]:
    """torch's FQN order with use_orig_params (it walks the sorted FQNs, copying parameters outside FSDP units at
    once and deferring the others to their unit): unmanaged sorted, then unit by unit in the order the sorted FQNs
    first reach them, each unit's sorted."""
    unit_of = {fqn: id(entry.unit) for _, entry in entries if entry.unit is not None for fqn in entry.fqns}
    unit_rank: dict[int, int] = {}
    for fqn in sorted(state):
        if fqn in unit_of:
            unit_rank.setdefault(unit_of[fqn], len(unit_rank))
    return dict(sorted(state.items(), key=lambda kv: (unit_rank[unit_of[kv[0]]] if kv[0] in unit_of else -1, kv[0])))


@dataclass(frozen=True)
class _SaveAs:
    """How a state is saved: whole (FULL) or as dim-0 chunks, by `config`; `keep` is False on the ranks that only
    take part in the gathers (rank0_only)."""

    full: bool
    config: OptimStateDictConfig
    keep: bool


def _save_unit(
    unit: FSDPUnit,
    handle: FlatParamHandle,
    infos: list[tuple[ParamInfo, str]],
    local_by_fqn: dict[str, dict[str, Any]],
    specs: dict[str, dict[str, Any]],
    save_as: _SaveAs,
    unit_groups: dict[dist.ProcessGroup, dist.ProcessGroup] | None,
) -> dict[str, dict[str, Any]]:
    """{fqn: {state name: saved value}} of the unit's parameters that have state anywhere (`specs`), in torch's order;
    a scalar is this rank's own where it has one, else another rank's.

    One state at a time: its SHARDED chunks are exchanged (chunk_exchange.py: a rank holds its shard and its chunks),
    or it is gathered whole and each parameter's value cut out of it before the next gather. The unit's states are
    never all whole at once (AdamW's two would be twice the unit's unsharded size beside the saved copies)."""
    group = handle.group if unit_groups is None else unit_groups[handle.group]
    device = handle.local_shard.device if unit_groups is None else torch.device("cpu")
    names = {name: spec[1] for _, fqn in infos for name, spec in specs.get(fqn, {}).items() if spec[0]}
    exchange = not save_as.full and exchanges_chunks(unit, handle, save_as.config)
    tensors: dict[str, dict[str, Any]] = {fqn: {} for fqn in specs}
    for name, dtype in names.items():
        values = [local_by_fqn.get(fqn, {}).get(name) for _, fqn in infos]
        local, owned = _local_state(handle, infos, values, dtype, device)
        wanted = [(info, fqn) for info, fqn in infos if name in specs.get(fqn, {})]
        if exchange:
            chunks = dict(sharded_chunks(unit, handle, local, group, save_as.config, local_owned=owned))
            for info, fqn in wanted:
                tensors[fqn][name] = chunks[info]
        else:
            whole = local
            if handle.sharded:
                whole = torch.empty(handle.layout.padded_numel, dtype=dtype, device=local.device)
                comm.all_gather(whole, local, group).wait()
            for info, fqn in wanted if save_as.keep else []:
                record = handle.dtensors.get(info)
                tensors[fqn][name] = _save_value(info.view_in(whole), unit, handle, save_as, record)
            if handle.sharded:  # now, and not when the backend drops its work object (gloo's may outlive wait())
                free_storage(whole)
        if owned:  # (the exchange has released it already)
            free_storage(local)
    if not save_as.keep:
        return {}
    return {
        fqn: {
            name: tensors[fqn][name]
            if is_tensor
            else _save_value(local_by_fqn.get(fqn, {}).get(name, value), unit, handle, save_as, None)
            for name, (is_tensor, value) in _in_torch_order(specs[fqn], handle)
        }
        for fqn in specs
    }


def _local_state(
    handle: FlatParamHandle,
    infos: list[tuple[ParamInfo, str]],
    values: list[torch.Tensor | None],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, bool]:
    """This rank's part of one state of the unit, laid out as its flat parameter's (its shard, or its whole when not
    sharded), from `values` (one per info: the original parameters' pieces with use_orig_params, the flat shard's
    state without); and whether it is a new tensor (else the optimizer's own, which the caller must leave alone)."""
    flat_state = next((v for v in values if v is not None), None) if not handle.use_orig_params else None
    if (
        handle.sharded
        and flat_state is not None
        and (flat_state.dtype, flat_state.device, flat_state.numel()) == (dtype, device, handle.local_shard.numel())
    ):
        return flat_state.reshape(-1), False  # the flat parameter's state is this rank's whole shard, as it is
    local = torch.zeros(handle.local_shard.numel(), dtype=dtype, device=device)
    pieces = {p.info: p for p in handle.layout.shard_pieces(handle.rank)} if handle.sharded else {}
    for (info, _), value in zip(infos, values, strict=True):
        if value is None:
            continue
        if not handle.use_orig_params:
            local.copy_(value.reshape(-1))
            break
        if not handle.sharded:
            local[info.offset : info.offset + info.numel].copy_(info.flatten(value))
        elif info in pieces:
            piece = pieces[info]
            local[piece.offset_in_shard : piece.offset_in_shard + piece.numel_in_shard].copy_(value.reshape(-1))
    return local, True


def _in_torch_order(specs: dict[str, Any], handle: FlatParamHandle) -> list[tuple[str, Any]]:
    """The state names in torch's order, each kind by name: flat parameters list the gathered states, then 0-d
    tensors, then other values; original parameters that were gathered list other values, then 0-d tensors, then the
    gathered states; ones that were not (NO_SHARD, one rank) keep the optimizer's order."""
    if handle.use_orig_params and not (handle.sharded and handle.world_size > 1):
        return list(specs.items())
    order = (0, 1, 2) if not handle.use_orig_params else (2, 1, 0)

    def rank(item: tuple[str, tuple[bool, Any]]) -> tuple[int, str]:
        name, (is_tensor, value) = item
        return order[0 if is_tensor else 1 if isinstance(value, torch.Tensor) else 2], name

    return sorted(specs.items(), key=rank)


def _save_value(
    value: Any, unit: FSDPUnit, handle: FlatParamHandle, save_as: _SaveAs, record: DTensorParam | None
) -> Any:
    """One state of one parameter (`value`: whole over dp; the local piece of a DTensor parameter, which `record`
    describes) as the checkpoint holds it: as the model's state dict holds the parameter."""
    if is_scalar(value):
        return copy_scalar(value)
    full, config = save_as.full, save_as.config
    # NO_SHARD with use_orig_params keeps full tensors under SHARDED/LOCAL too, as torch does (not without).
    if full or (not handle.sharded and handle.use_orig_params):
        copy = detached_copy(value, config.offload_to_cpu)  # never a view of the gather buffer (torch's CPU bug)
        return record.wrap(copy) if record is not None else copy
    if uses_dtensor(unit, config):
        return chunk_dtensor(value, unit, config.offload_to_cpu, record)
    return chunk_sharded_tensor(value, handle, config.offload_to_cpu)
