"""clip_grad_norm_ over sharded gradients: the norm of the full (unsharded) gradients, without unsharding them."""

import math
import warnings

import torch
import torch.distributed as dist
from torch import nn

from .handle import FlatParamHandle


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module, handles: list[FlatParamHandle], group: dist.ProcessGroup, max_norm: float, norm_type: float
) -> torch.Tensor:
    """Scale every gradient of `model` so that the norm of all full gradients is at most `max_norm`.

    Gradients of sharded units are partitioned across ranks, so their p-th powers (or maxima) are summed over the
    group; replicated gradients (NO_SHARD units, ignored parameters) are counted once, locally. Returns the total
    norm from before clipping, equal on every rank.
    """
    norm_type = float(norm_type)
    sharded = {id(p) for h in handles if h.sharded for p in (h.flat_param, *h.orig_params.values())}
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sharded_grads = [p.grad for p in model.parameters() if p.grad is not None and id(p) in sharded]
    replicated_grads = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in sharded]
    # Norms are reduced on the compute device (NCCL needs it even when CPUOffload keeps the gradients on the CPU).
    device = handles[0].compute_device if handles else torch.device("cpu")
    local_sharded = _norm_power(sharded_grads, norm_type, device)
    local_replicated = _norm_power(replicated_grads, norm_type, device)
    if any(h.sharded for h in handles):  # structural, hence the same decision on every rank
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(local_sharded, op=op, group=group)
    if math.isinf(norm_type):
        total = torch.maximum(local_sharded, local_replicated)
    else:
        total = (local_sharded + local_replicated) ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    if not grads:
        dtype = torch.get_default_dtype()
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank(group)} with no gradients -- returning the total "
            f"norm in the default dtype {dtype}",
            stacklevel=3,
        )
        return total.to(dtype)
    dtype = grads[0].dtype
    for grad in grads[1:]:
        dtype = torch.promote_types(dtype, grad.dtype)
    return total.to(dtype)


def _norm_power(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """sum(|g|^p) over `grads` (max |g| for p = inf), in fp32."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device) for g in grads])
    if math.isinf(norm_type):
        return norms.max()
    return (norms**norm_type).sum()
