"""clip_grad_norm_ over sharded gradients: the norm of the full (unsharded) gradients, without unsharding them.

Without tensor parallelism the norm is computed as torch's FSDP1 computes it, operation for operation, so that the
returned norm and the clipped gradients are equal to torch's bit for bit (a last-bit difference in the norm changes
every clipped step after it): the gradients in the handles' order (each original parameter with use_orig_params,
else the flat parameter), then the parameters no unit manages; per group the vector norm of the stacked per-gradient
norms (fp32); the sharded group's norm raised to p, summed over the ranks, the replicated group's added, the root
taken. A model whose units are all NO_SHARD is clipped by torch.nn.utils.clip_grad_norm_, as torch's FSDP1 does.
With tensor-parallel DTensor parameters, torch's FSDP1 sums over the data-parallel ranks only (a norm that misses
the other tensor-parallel ranks' pieces); ours sums those pieces over the tensor-parallel mesh too
(docs/compatibility.md).
"""

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .handle import FlatParamHandle


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module, handles: list[FlatParamHandle], group: dist.ProcessGroup, max_norm: float, norm_type: float
) -> torch.Tensor:
    """Scale every gradient of `model` so that the norm of all full gradients is at most `max_norm`; returns the
    total norm from before clipping, in the widest dtype of the gradients."""
    norm_type = float(norm_type)
    if any(_tp_groups(handle) for handle in handles):
        return _clip_tensor_parallel(model, handles, group, float(max_norm), norm_type)
    if not any(handle.sharded for handle in handles):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    sharded, replicated = _params_in_torch_order(model, handles)
    device = handles[0].compute_device
    local_sharded = _grad_norm(sharded, norm_type, device)
    local_replicated = _grad_norm(replicated, norm_type, device) if replicated else None
    if math.isinf(norm_type):
        total = local_sharded if local_replicated is None else torch.maximum(local_sharded, local_replicated)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = local_sharded**norm_type
        dist.all_reduce(total, group=group)
        if local_replicated is not None:  # the same on every rank: added once, after the sum
            total += local_replicated**norm_type
        total = total ** (1.0 / norm_type)
    if any(handle.offload for handle in handles):
        total = total.cpu()
    grads = [p.grad for p in (*sharded, *replicated) if p.grad is not None]
    return _scale(grads, float(max_norm), total, group)


def _params_in_torch_order(
    model: nn.Module, handles: list[FlatParamHandle]
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(sharded, replicated) parameters: each handle's (its originals with use_orig_params, else its flat parameter)
    in the handles' order, then the parameters of `model` that no handle manages, as replicated."""
    seen: set[int] = set()
    sharded: list[nn.Parameter] = []
    replicated: list[nn.Parameter] = []
    for handle in handles:
        target = sharded if handle.sharded else replicated
        owned = handle.orig_params.values() if handle.use_orig_params else (handle.flat_param,)
        for param in owned:
            if id(param) not in seen:
                seen.add(id(param))
                target.append(param)
        seen.add(id(handle.flat_param))  # managed, whether or not the module registers it
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            replicated.append(param)
    return sharded, replicated


def _normable(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """The inf norm of an empty tensor raises (a max over nothing); an empty gradient (a parameter without
    elements) adds nothing to any norm, so it is left out there. Other norms keep it, as torch's do (its norm is 0)."""
    return [g for g in grads if g.numel()] if math.isinf(norm_type) else grads


def _grad_norm(params: list[nn.Parameter], norm_type: float, device: torch.device) -> torch.Tensor:
    """The p-norm of the gradients of `params` as one vector, in fp32: the norm of their norms."""
    grads = _normable([p.grad for p in params if p.grad is not None], norm_type)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads])
    return torch.linalg.vector_norm(norms, norm_type, dtype=torch.float32).to(device=device)


def _scale(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Multiply `grads` by min(1, max_norm / (total + 1e-6)); returns `total` in their widest dtype."""
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    if not grads:
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank(group)} with no gradients -- returning the total "
            f"norm in the default dtype {total.dtype}",
            stacklevel=4,
        )
        return total
    dtype = grads[0].dtype
    for grad in grads[1:]:
        dtype = torch.promote_types(dtype, grad.dtype)
    return total.to(dtype)


def _clip_tensor_parallel(
    model: nn.Module, handles: list[FlatParamHandle], group: dist.ProcessGroup, max_norm: float, norm_type: float
) -> torch.Tensor:
    """The whole model's norm where units hold tp-sharded DTensor parameters: gradients of sharded units are
    partitioned across the data-parallel ranks, so their p-th powers (or maxima) are summed over the group;
    replicated gradients (NO_SHARD units, ignored parameters) are counted once, locally; pieces of tp-sharded
    parameters are summed over their tensor-parallel mesh first (copies over it, Replicate, count once)."""
    sharded = {id(p) for h in handles if h.sharded for p in (h.flat_param, *h.orig_params.values())}
    tp_pieces, tp_params = _tp_pieces(handles)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    buckets: dict[tuple[bool, Any], list[torch.Tensor]] = {}  # (dp-sharded, tp group or None) -> gradients
    for param in model.parameters():
        if param.grad is None:
            continue
        dp_sharded = id(param) in sharded
        if id(param) in tp_params:  # a use_orig_params view of a tp-sharded DTensor parameter
            buckets.setdefault((dp_sharded, tp_params[id(param)]), []).append(param.grad)
        elif id(param) in tp_pieces:  # a flat gradient holding pieces of tp-sharded DTensor parameters
            rest, by_group = tp_pieces[id(param)](param.grad)
            buckets.setdefault((dp_sharded, None), []).extend(rest)
            for tp_group, pieces in by_group.items():
                buckets.setdefault((dp_sharded, tp_group), []).extend(pieces)
        else:
            buckets.setdefault((dp_sharded, None), []).append(param.grad)
    # Norms are reduced on the compute device (NCCL needs it even when CPUOffload keeps the gradients on the CPU).
    device = handles[0].compute_device if handles else torch.device("cpu")
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    combine = torch.maximum if math.isinf(norm_type) else torch.add
    local_sharded = _norm_power(buckets.get((True, None), []), norm_type, device)
    local_replicated = _norm_power(buckets.get((False, None), []), norm_type, device)
    # One reduction per tp group, decided by the model's structure alone, so every rank joins the same ones.
    for tp_group in dict.fromkeys(g for h in handles for g in _tp_groups(h)):
        powers = torch.stack(
            [_norm_power(buckets.get((dp_sharded, tp_group), []), norm_type, device) for dp_sharded in (True, False)]
        )
        dist.all_reduce(powers, op=op, group=tp_group)
        local_sharded, local_replicated = combine(local_sharded, powers[0]), combine(local_replicated, powers[1])
    if any(h.sharded for h in handles):  # structural, hence the same decision on every rank
        dist.all_reduce(local_sharded, op=op, group=group)
    if math.isinf(norm_type):
        total = torch.maximum(local_sharded, local_replicated)
    else:
        total = (local_sharded + local_replicated) ** (1.0 / norm_type)
    return _scale(grads, max_norm, total, group)


def _tp_groups(handle: FlatParamHandle) -> list[dist.ProcessGroup]:
    return [record.mesh.get_group() for record in handle.dtensors.values() if record.tp_sharded]


def _tp_pieces(handles: list[FlatParamHandle]) -> tuple[dict[int, Callable], dict[int, dist.ProcessGroup]]:
    """For units holding tp-sharded DTensor parameters: (flat parameter id -> a function splitting its gradient into
    (other pieces, {tp group: pieces of tp-sharded parameters})), (original parameter id -> its tp group)."""
    splitters: dict[int, Callable] = {}
    originals: dict[int, dist.ProcessGroup] = {}
    for handle in handles:
        tp = {info: record.mesh.get_group() for info, record in handle.dtensors.items() if record.tp_sharded}
        if not tp:
            continue
        for info, param in handle.orig_params.items():
            if info in tp:
                originals[id(param)] = tp[info]
        spans = (
            [(p.info, p.offset_in_shard, p.numel_in_shard) for p in handle.layout.shard_pieces(handle.rank)]
            if handle.sharded
            else [(info, info.offset, info.numel) for info in handle.layout.params]
        )

        def split(grad: torch.Tensor, spans=spans, tp=tp) -> tuple[list[torch.Tensor], dict]:
            flat = grad.reshape(-1)
            rest: list[torch.Tensor] = []
            by_group: dict[dist.ProcessGroup, list[torch.Tensor]] = {}
            for info, start, numel in spans:
                piece = flat[start : start + numel]
                (by_group.setdefault(tp[info], []) if info in tp else rest).append(piece)
            return rest, by_group

        splitters[id(handle.flat_param)] = split
    return splitters, originals


def _norm_power(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """sum(|g|^p) over `grads` (max |g| for p = inf), in fp32."""
    grads = _normable(grads, norm_type)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device) for g in grads])
    if math.isinf(norm_type):
        return norms.max()
    return (norms**norm_type).sum()
