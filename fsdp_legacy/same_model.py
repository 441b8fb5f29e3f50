"""Every rank must wrap the same model; a rank that does not is found before its collectives go wrong.

FSDP's collectives pair each rank's n-th call with every other rank's n-th call, by size. Ranks that built different
models (another config file, a rank-dependent branch, different frozen parameters) pair unrelated flat parameters:
gloo then aborts the process or times out, NCCL hangs, and two flat parameters of equal size but different layout
(a Linear(8, 10) against a Linear(10, 8)) exchange values silently. So the ranks compare what they built, once: the
root's first use (forward, state dict, summon) all-gathers a digest of every unit's layout (one 32-byte collective);
`sync_module_states` compares each unit's states before broadcasting them. Only on a difference do they exchange
the descriptions themselves, so that every rank raises the same error naming the first difference. torch's FSDP1
compares nothing and aborts, hangs or trains on mixed-up values.
"""

import hashlib
import json
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import collectives as comm
from .buckets import ENV_VAR, bucket_bytes_from_env
from .naming import clean_fqn
from .unit import FSDPUnit
from .unit_plan import UnitPlan


def describe_units(root: nn.Module, units: Sequence[FSDPUnit]) -> list[str]:
    """One line per original parameter of every unit under `root`, with what decides each unit's collectives."""
    # Ranks that group units differently for their collectives (buckets.py) pair unrelated ones just the same.
    lines = [f"a bucket budget ({ENV_VAR}) of {bucket_bytes_from_env()} bytes"]
    ours = set(units)
    for name, module in root.named_modules():
        if not isinstance(module, FSDPUnit) or module not in ours:
            continue
        prefix = clean_fqn(name) + "." if clean_fqn(name) else ""
        # (the prefetch settings decide the order of the collectives)
        backward = module.backward_prefetch.name if module.backward_prefetch is not None else None
        prefetch = f"backward_prefetch={backward}, forward_prefetch={module.forward_prefetch}"
        strategy = f"{module.sharding_strategy.name}, {prefetch}"
        for index, handle in enumerate(module._handles):
            for info in handle.layout.params:  # (first: a differing shape is named before the sizes it changes)
                param = handle.orig_params.get(info)
                grad = f", requires_grad={param.requires_grad}" if param is not None else ""
                lines.append(f"parameter '{prefix}{info.fqn}' of shape {tuple(info.shape)}{grad}")
            lines.append(
                f"unit '{clean_fqn(name) or '(root)'}' flat parameter {index}: {strategy}, "
                f"{handle.world_size} ranks, stored {handle.local_shard.dtype}, gathered {handle.full_padded.dtype}, "
                f"reduced {handle.reduce_dtype}, {handle.layout.numel} elements, requires_grad="
                f"{handle.flat_param.requires_grad}"
            )
    return lines


def describe_plan(plan: UnitPlan, module: nn.Module) -> list[str]:
    """One line per state `sync_module_states` broadcasts for the unit wrapping `module` (parameters by name,
    buffers by place; units are wrapped innermost first)."""
    names = {id(ref.param): ref.fqn for ref in plan.references}
    where = f"in the unit wrapping a {type(module).__name__}"
    lines = [
        f"{'parameter ' + repr(names[id(t)]) if id(t) in names else f'buffer {index}'} of shape {tuple(t.shape)}, "
        f"{t.dtype}, {where}"
        for index, t in enumerate(plan.module_states)
    ]
    return lines + [f"no more parameters or buffers {where}"]


def check_same_model(lines: list[str], groups: Sequence[dist.ProcessGroup | None], device: torch.device) -> None:
    """Raise the same kind of ValueError on every rank of `groups` unless all of them described the same thing.

    The groups are one process group, or a hybrid unit's shard and replicate groups, whose ranks together are every
    rank of the model: a difference seen in one group is made known across the other, so no rank goes on alone."""
    # (the "fake" backend: the memory estimator's, whose collectives carry no data)
    real = [g for g in groups if g is not None and g.size() > 1 and dist.get_backend(g) != "fake"]
    if not real:
        return
    digest = torch.tensor(list(hashlib.sha256("\n".join(lines).encode()).digest()), dtype=torch.uint8, device=device)
    differs = torch.zeros(1, dtype=torch.uint8, device=device)
    for group in real:
        digests = _all_gather(digest, group).view(group.size(), -1)
        differs |= (digests != digests[0]).any().to(torch.uint8)
    if len(real) > 1:  # row-wise then column-wise maxima: the maximum over the whole grid of ranks
        for group in real:
            dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
    if not differs.item():
        return
    found = [_first_difference(_all_gather_lines(lines, group, device)) for group in real]
    raise ValueError(
        "FSDP was given a different model on different ranks, so their collectives would not pair up (an abort, a hang "
        "or mixed-up values): "
        + next((text for text in found if text), "this rank's groups agree, other ranks differ (their errors name how)")
        + ". Build and wrap the same model on every rank: the same configuration and code, auto_wrap_policy, ignored "
        "modules, mixed precision and requires_grad flags."
    )


def _first_difference(by_rank: list[list[str]]) -> str:
    """Where the first rank that differs from the group's first rank does, or "" if none does."""
    reference = by_rank[0]
    for rank, lines in enumerate(by_rank[1:], start=1):
        for index in range(max(len(reference), len(lines))):
            ours = reference[index] if index < len(reference) else "no more units"
            theirs = lines[index] if index < len(lines) else "no more units"
            if ours != theirs:
                return f"group rank 0 has {ours} where group rank {rank} has {theirs} (item {index} of what each wraps)"
    return ""


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    output = torch.empty(group.size() * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    comm.all_gather(output, tensor, group).wait()
    return output


def _all_gather_lines(lines: list[str], group: dist.ProcessGroup, device: torch.device) -> list[list[str]]:
    """Every rank's lines, as JSON bytes (no pickles)."""
    data = json.dumps(lines).encode()
    sizes = _all_gather(torch.tensor([len(data)], dtype=torch.int64, device=device), group).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = _all_gather(padded.to(device), group).view(group.size(), -1).cpu()
    return [json.loads(bytes(row[:size].tolist()).decode()) for row, size in zip(gathered, sizes, strict=True)]
