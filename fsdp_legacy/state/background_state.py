"""SHARDED model and optimizer state dicts built away from training: copied in the call, built in a background save.

What FSDP1's SHARDED state dicts cost in the call is their communication: each parameter (and each optimizer state)
is cut into per-rank dim-0 chunks, which other ranks' shards hold. A background save instead copies this rank's flat
shards, its buffers and its optimizer's state (memory copies), and builds the same dicts in its own thread,
exchanging the copies' chunks over its own group. The result equals `model.state_dict()` and
`FSDP.optim_state_dict()` under SHARDED_STATE_DICT at the moment of the copy (test_async_save.py). Models this does
not cover (NO_SHARD units, DTensor state dicts, a unit sharded over fewer than every rank) make `capture` return
None, and the caller builds the dicts in the call.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives as comm
from ..api import ShardedOptimStateDictConfig, ShardedStateDictConfig, ShardingStrategy, StateDictType
from ..flat_param import ParamInfo
from ..handle import FlatParamHandle
from ..unit import FSDPUnit
from .chunk_exchange import ChunkPlan, can_exchange, chunk_rows, exchange_chunks
from .hf_checkpoint import SaveSources, ShardCopy, collect_for_save, copy_sources
from .optim_state import OptimSavePlan, build_optim_state, plan_optim_save
from .state_dict import chunk_sharded_tensor, sharded_tensor_of_chunk
from .state_dict_dtensor import uses_dtensor


@dataclass
class CapturedState:
    """Copies of what the SHARDED dicts are built from: the model's tensors (local shards, whole tensors on every
    rank) with the handles that describe them, and the optimizer's save plan whose state dict holds copies."""

    model: SaveSources
    handles: list[FlatParamHandle]
    optim: OptimSavePlan

    @property
    def copied_bytes(self) -> int:
        return self.model.copied_bytes + tensor_bytes(self.optim.osd["state"])


def capture(model: nn.Module, optim: torch.optim.Optimizer, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A CapturedState, or None where this model's SHARDED dicts are built in the call (see the module's note)."""
    everyone = sorted(range(dist.get_world_size()))
    for unit in (m for m in model.modules() if isinstance(m, FSDPUnit)):
        if unit.sharding_strategy == ShardingStrategy.NO_SHARD or uses_dtensor(unit, ShardedStateDictConfig()):
            return None
        for handle in unit._handles:
            ranks = sorted(dist.get_process_group_ranks(handle.group))
            if not handle.sharded or ranks != everyone or handle.dtensors:
                return None
    sources = collect_for_save(model)
    handles = [h for h in sources.handles if isinstance(h, FlatParamHandle)]
    plan = plan_optim_save(model, optim, None)
    copied = replace(plan, osd={**plan.osd, "state": _copy_tree(plan.osd["state"], copy)})
    return CapturedState(copy_sources(sources, copy, every_rank=True), handles, copied)


def build(captured: CapturedState, group: dist.ProcessGroup) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state dict, optimizer state dict) as SHARDED_STATE_DICT gives them, gathered over `group`."""
    unit_groups = {handle.group: group for handle in captured.handles}
    model_state = _model_state(captured, group)
    optim_state = build_optim_state(
        captured.optim, StateDictType.SHARDED_STATE_DICT, ShardedOptimStateDictConfig(), group, unit_groups
    )
    return model_state, optim_state


def _model_state(captured: CapturedState, group: dist.ProcessGroup) -> dict[str, Any]:
    state: dict[str, Any] = {}
    entries = captured.model.entries
    for index, (handle, copy) in enumerate(zip(captured.handles, captured.model.handles, strict=True)):
        assert isinstance(copy, ShardCopy)
        values = _chunked(handle, copy.local_shard, group)
        for entry in entries:
            if entry.unit == index and entry.info is not None:
                state.update((key, values[entry.info]) for key in (entry.key, *entry.aliases))
    for entry in entries:
        if entry.tensor is not None:
            whole = entry.tensor.to(entry.dtype)  # a buffer kept in MixedPrecision's buffer_dtype: saved in its own
            state.update((key, whole) for key in (entry.key, *entry.aliases))
    return state


def _chunked(handle: FlatParamHandle, local: torch.Tensor, group: dist.ProcessGroup) -> dict[ParamInfo, Any]:
    """Each parameter's ShardedTensor from the ranks' copies of their shards: dim-0 chunks exchanged
    (chunk_exchange.py), or cut from the unit gathered whole where a parameter is held in memory order."""
    if can_exchange(handle.layout):
        chunks = exchange_chunks(ChunkPlan.of(handle.layout, handle.rank), local, group, offload_to_cpu=False)
        rows = {info: chunk_rows(info.shape[0], handle.world_size) for info in handle.layout.params}
        return {
            info: sharded_tensor_of_chunk(chunks.get(info), info.shape, local.dtype, rows[info], handle)
            for info in handle.layout.params
        }
    full = torch.empty(handle.layout.padded_numel, dtype=local.dtype)
    comm.all_gather(full, local, group).wait()
    return {
        info: chunk_sharded_tensor(info.view_in(full), handle, offload_to_cpu=False) for info in handle.layout.params
    }


def _copy_tree(value: Any, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return copy(value.detach())
    if isinstance(value, dict):
        return {key: _copy_tree(item, copy) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy_tree(item, copy) for item in value)
    return value


def tensor_bytes(state: Any) -> int:
    """The bytes of this rank's tensors in a state dict (a ShardedTensor's local shards, a DTensor's local tensor)."""
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(value) for value in state)
    local_shards = getattr(state, "local_shards", None)
    if callable(local_shards):  # a ShardedTensor
        return sum(shard.tensor.nbytes for shard in local_shards())
    to_local = getattr(state, "to_local", None)
    if callable(to_local):  # a DTensor
        return int(to_local().nbytes)
    return int(state.nbytes) if isinstance(state, torch.Tensor) else 0
