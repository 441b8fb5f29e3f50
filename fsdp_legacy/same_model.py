"""Every rank must wrap the same model; a rank that does not is found before its collectives go wrong.

FSDP's collectives pair each rank's n-th call with every other rank's n-th call, by size. Ranks that built different
models (another config file, a rank-dependent branch) pair unrelated flat parameters: gloo then aborts the process or
times out, NCCL hangs, and two flat parameters of equal size but different layout (a Linear(8, 10) against a
Linear(10, 8)) exchange values silently. So the ranks compare what they built, once: the root's first use (forward,
state dict, summon) all-gathers two digests of every unit's layout (one 64-byte collective); `sync_module_states`
compares each unit's states before broadcasting them. Only on a difference do they exchange the descriptions
themselves, so that every rank reports the same first difference.

What must agree for the collectives to pair (shapes in order, dtypes, strategies and the settings that order the
collectives) raises a ValueError. Names and requires_grad flags alone only warn: torch's FSDP1 runs ranks that ignore
different modules (the same parameters under shifted names), and its own DETAIL-level order check, not this one,
reports ranks that freeze and run different units (exec_order.py).
"""

import hashlib
import json
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import collectives as comm
from .buckets import ENV_VAR, bucket_bytes_from_env
from .naming import clean_fqn
from .unit import FSDPUnit
from .unit_plan import UnitPlan


@dataclass(frozen=True)
class Described:
    """One thing a rank wrapped: `pairing` is what the collectives need to agree on, `text` the whole description."""

    pairing: str
    text: str


def describe_units(root: nn.Module, units: Sequence[FSDPUnit]) -> list[Described]:
    """One item per original parameter of every unit under `root`, with what decides each unit's collectives."""
    # Ranks that group units differently for their collectives (buckets.py) pair unrelated ones just the same.
    budget = f"a bucket budget ({ENV_VAR}) of {bucket_bytes_from_env()} bytes"
    items = [Described(budget, budget)]
    ours = set(units)
    for name, module in root.named_modules():
        if not isinstance(module, FSDPUnit) or module not in ours:
            continue
        unit_name = clean_fqn(name)
        prefix = unit_name + "." if unit_name else ""
        # (the prefetch settings decide the order of the collectives)
        backward = module.backward_prefetch.name if module.backward_prefetch is not None else None
        prefetch = f"backward_prefetch={backward}, forward_prefetch={module.forward_prefetch}"
        strategy = f"{module.sharding_strategy.name}, {prefetch}"
        for index, handle in enumerate(module._handles):
            for info in handle.layout.params:  # (first: a differing shape is named before the sizes it changes)
                param = handle.orig_params.get(info)
                grad = f", requires_grad={param.requires_grad}" if param is not None else ""
                shape = f"of shape {tuple(info.shape)}"
                items.append(Described(f"parameter {shape}", f"parameter '{prefix}{info.fqn}' {shape}{grad}"))
            pairing = (
                f"flat parameter {index}: {strategy}, {handle.world_size} ranks, stored {handle.local_shard.dtype}, "
                f"gathered {handle.full_padded.dtype}, reduced {handle.reduce_dtype}, {handle.layout.numel} elements"
            )
            grad = f", requires_grad={handle.flat_param.requires_grad}"
            items.append(Described(pairing, f"unit '{unit_name or '(root)'}' {pairing}{grad}"))
    return items


def describe_plan(plan: UnitPlan, module: nn.Module) -> list[Described]:
    """One item per state `sync_module_states` broadcasts for the unit wrapping `module` (parameters by name,
    buffers by place; units are wrapped innermost first)."""
    names = {id(ref.param): ref.fqn for ref in plan.references}
    where = f"in the unit wrapping a {type(module).__name__}"
    items = []
    for index, state in enumerate(plan.module_states):
        kind = "parameter" if id(state) in names else "buffer"
        pairing = f"{kind} {index} of shape {tuple(state.shape)}, {state.dtype}"
        name = repr(names[id(state)]) if id(state) in names else str(index)
        items.append(Described(pairing, f"{kind} {name} of shape {tuple(state.shape)}, {state.dtype}, {where}"))
    end = f"no more parameters or buffers {where}"
    return [*items, Described(end, end)]


def check_same_model(items: list[Described], groups: Sequence[dist.ProcessGroup | None], device: torch.device) -> None:
    """Raise the same kind of ValueError on every rank of `groups` unless all of them described things that pair up,
    and warn on every rank where they pair up but differ in names or requires_grad.

    The groups are one process group, or a hybrid unit's shard and replicate groups, whose ranks together are every
    rank of the model: a difference seen in one group is made known across the other, so no rank goes on alone."""
    # (the "fake" backend: the memory estimator's, whose collectives carry no data)
    real = [g for g in groups if g is not None and g.size() > 1 and dist.get_backend(g) != "fake"]
    if not real:
        return
    digests = [_digest(item.pairing for item in items), _digest(item.text for item in items)]
    digest = torch.tensor(digests[0] + digests[1], dtype=torch.uint8, device=device)
    differs = torch.zeros(2, dtype=torch.uint8, device=device)  # (pairing, text)
    for group in real:
        everyone = _all_gather(digest, group).view(group.size(), 2, -1)
        differs |= (everyone != everyone[0]).any(dim=2).any(dim=0).to(torch.uint8)
    if len(real) > 1:  # row-wise then column-wise maxima: the maximum over the whole grid of ranks
        for group in real:
            dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
    pairing_differs, text_differs = differs.tolist()
    if not text_differs:
        return
    by_group = [_all_gather_items(items, group, device) for group in real]
    if pairing_differs:
        found = [_first_difference(by_rank, lambda item: item.pairing) for by_rank in by_group]
        elsewhere = "this rank's groups agree, other ranks differ (their errors name how)"
        raise ValueError(
            "FSDP was given a different model on different ranks, so their collectives would not pair up (an abort, "
            "a hang or mixed-up values): "
            + next((text for text in found if text), elsewhere)
            + ". Build and wrap the same model on every rank: the same configuration and code, auto_wrap_policy, "
            "ignored modules, mixed precision and sharding settings."
        )
    found = [_first_difference(by_rank, lambda item: item.text) for by_rank in by_group]
    warnings.warn(
        "FSDP was given models that differ by rank in their names or requires_grad flags only: "
        + next((text for text in found if text), "this rank's groups agree, other ranks differ")
        + ". Their collectives pair up, but a flat parameter that requires grad on one rank and not on another is "
        "reduced on one of them only, which hangs or mixes gradients; set requires_grad the same way on every rank.",
        stacklevel=3,
    )


def _digest(lines: Iterable[str]) -> list[int]:
    return list(hashlib.sha256("\n".join(lines).encode()).digest())


def _first_difference(by_rank: list[list[Described]], key: Callable[[Described], str]) -> str:
    """Where the first rank that differs from the group's first rank does (by `key`), or "" if none does."""
    end = Described("no more units", "no more units")
    reference = by_rank[0]
    for rank, items in enumerate(by_rank[1:], start=1):
        for index in range(max(len(reference), len(items))):
            ours = reference[index] if index < len(reference) else end
            theirs = items[index] if index < len(items) else end
            if key(ours) != key(theirs):
                return (
                    f"group rank 0 has {ours.text} where group rank {rank} has {theirs.text} "
                    f"(item {index} of what each wraps)"
                )
    return ""


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    output = torch.empty(group.size() * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    comm.all_gather(output, tensor, group).wait()
    return output


def _all_gather_items(items: list[Described], group: dist.ProcessGroup, device: torch.device) -> list[list[Described]]:
    """Every rank's items, as JSON bytes (no pickles)."""
    data = json.dumps([[item.pairing, item.text] for item in items]).encode()
    sizes = _all_gather(torch.tensor([len(data)], dtype=torch.int64, device=device), group).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = _all_gather(padded.to(device), group).view(group.size(), -1).cpu()
    return [
        [Described(*pair) for pair in json.loads(bytes(row[:size].tolist()).decode())]
        for row, size in zip(gathered, sizes, strict=True)
    ]
