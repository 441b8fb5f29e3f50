"""The estimate of a model of many identical layers from traces of a few of them, exact (or a full trace).

Tracing costs time per layer (FakeTensorMode's dispatch, twice per op with the tracker), so a 70B decoder's 80 layers
take minutes where 3, 4 and 5 of them take seconds. When the units (the layers) are identical, what a rank holds at
any moment is a sum of the same few kinds of things per layer, so memory during layer i of an L-layer model is
affine in i and L, except near the ends, where prefetching, the root and the loss differ. The extrapolation rests on
that, and checks it instead of assuming it:

- The tracker keeps a peak per segment: each phase is cut where a layer's forward begins, where it ends and where its
  backward begins (`MemoryTracker.mark`, from hooks on the units). A segment's peak, by (module, category), with the
  layers' modules summed (`layers.*`), is then a function of the segment's class: one not inside a layer, the first
  or last `edge` layers (counted from their end), or the first or last of the interior layers between them.
- Each class's breakdown must be affine in the number of layers across the three samples, exactly, key by key; in
  each sample the interior layers' segments must be an arithmetic progression (so their largest is the first or the
  last); the sample's own phase peaks must be the largest of its segments; and all the units must be alike (module
  types, plain attributes, parameter and buffer shapes, dtypes and requires_grad).
- Each phase's peak at L layers is then the largest of its classes' extrapolated peaks (the first in time on a tie,
  as the tracker keeps it).

Where any check fails the model is traced whole, as `estimate_memory` does. Taking the largest per class rather than
extrapolating the phase peaks themselves matters: a phase's peak can move from one moment to another as layers are
added (at 70B, the "other" phase's peak moves from construction to the optimizer state between 20 and 40 layers).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import fields, is_dataclass, replace
from itertools import pairwise
from typing import Any

import torch
from torch import nn

from .categories import Phase, clean
from .estimator import estimate_memory
from .profile import MemoryProfile
from .table import Breakdown
from .tracker import MemoryTracker
from .training import LossFn, OptimizerFn, sgd

SAMPLES = (3, 4, 5)  # the layer counts traced
EDGE = 1  # layers at each end that may differ from the interior ones

Class = tuple[int, Phase, Hashable]  # (phase entry number, phase, the segment's class)
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def estimate_memory_repeated(
    build_layers: Callable[[int], nn.Module],
    num_layers: int,
    unit: type[nn.Module],
    loss_fn: LossFn,
    world_size: int,
    fsdp_kwargs: dict[str, Any] | None = None,
    optimizer_fn: OptimizerFn = sgd,
    steps: int = 2,
    rank: int = 0,
    hybrid_shape: tuple[int, int] | None = None,
    samples: Sequence[int] = SAMPLES,
    full_model: nn.Module | None = None,
) -> MemoryProfile:
    """`estimate_memory(lambda: build_layers(num_layers), ...)`'s peaks per phase, from traces of
    `build_layers(n)` for n in `samples` when the model's `unit` modules are identical layers `prefix.0` ..
    `prefix.{num_layers - 1}` (the layers' modules summed as `prefix.*` in the breakdowns), else from the full trace.
    `build_layers(n)` is the model with its first n layers. The profile's `method` says which it was. `full_model`:
    `build_layers(num_layers)` on the meta device, if at hand (the layers are compared on it; built otherwise)."""

    def estimate(layers: int, instrument: Any = None) -> MemoryProfile:
        return estimate_memory(
            lambda: build_layers(layers),
            loss_fn,
            world_size,
            fsdp_kwargs,
            optimizer_fn,
            steps,
            rank,
            hybrid_shape=hybrid_shape,
            instrument=instrument,
        )

    counts = sorted(samples)
    prefix, why = _layers_prefix(build_layers, num_layers, unit, counts, full_model)
    if prefix is not None:
        traced = {n: estimate(n, _marker(prefix)) for n in counts}
        profile, why = extrapolate(traced, num_layers, prefix)
        if profile is not None:
            return profile
    return replace(estimate(num_layers), method=f"traced ({why})")


def _meta(build_layers: Callable[[int], nn.Module], layers: int) -> nn.Module:
    with torch.device("meta"):
        return build_layers(layers)


def _layers_prefix(
    build_layers: Callable[[int], nn.Module],
    num_layers: int,
    unit: type[nn.Module],
    counts: list[int],
    model: nn.Module | None,
) -> tuple[str | None, str]:
    """(the layers' FQN prefix, "") when the model can be estimated from `counts` layers, else (None, why not)."""
    if len(counts) != 3 or counts != list(range(counts[0], counts[0] + 3)) or counts[0] < 2 * EDGE + 1:
        return None, f"samples {counts}: three consecutive layer counts of at least {2 * EDGE + 1}"
    if num_layers <= counts[-1]:
        return None, f"{num_layers} layers: no more than the samples"
    model = model if model is not None else _meta(build_layers, num_layers)
    prefix = _prefix(model, unit)
    layers = [m for m in model.modules() if isinstance(m, unit)]
    if prefix is None or len(layers) != num_layers:
        return None, f"the {unit.__name__} units are not one list of {num_layers} layers"
    first = signature(layers[0])
    if any(signature(layer) != first for layer in layers[1:]):
        return None, f"the {unit.__name__} layers are not identical"
    return prefix, ""


def _prefix(model: nn.Module, unit: type[nn.Module]) -> str | None:
    """ "layers." when the `unit` modules are model.layers[0], [1], ... in order (none inside another), else None."""
    names = [clean(name) for name, m in model.named_modules() if isinstance(m, unit)]
    if not names:
        return None
    parent, _, _ = names[0].rpartition(".")
    prefix = parent + "." if parent else ""
    return prefix if names == [f"{prefix}{i}" for i in range(len(names))] else None


def signature(module: nn.Module) -> tuple:
    """What makes two layers alike: each submodule's type and plain attributes, each parameter's and buffer's shape,
    dtype, type and requires_grad."""
    modules = tuple((name, type(m).__qualname__, _attributes(m)) for name, m in module.named_modules())
    params = tuple(
        (name, tuple(p.shape), p.dtype, type(p).__qualname__, p.requires_grad) for name, p in module.named_parameters()
    )
    buffers = tuple((name, tuple(b.shape), b.dtype) for name, b in module.named_buffers())
    return modules, params, buffers


def _attributes(module: nn.Module) -> tuple:
    return tuple(sorted((k, _plain(v)) for k, v in vars(module).items() if not k.startswith("_")))


def _plain(value: object) -> object:
    """A comparable stand-in: plain values as they are, dataclasses field by field, anything else by its type."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, tuple((f.name, _plain(getattr(value, f.name))) for f in fields(value)))
    return type(value).__qualname__


def _marker(prefix: str) -> Callable[[nn.Module, MemoryTracker], None]:
    """The instrument that marks, for each layer i, where its forward begins and ends and where its backward begins
    (the gradient of its output arriving), on the outermost module named `prefix` + i."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")

    def instrument(wrapped: nn.Module, tracker: MemoryTracker) -> None:
        seen: set[int] = set()
        for name, module in wrapped.named_modules():
            match = pattern.match(clean(name))
            if match and int(match[1]) not in seen:
                seen.add(int(match[1]))
                _hook(module, int(match[1]), tracker)

    return instrument


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _hook(module: nn.Module, index: int, tracker: MemoryTracker) -> None:
    def mark_backward(grad: torch.Tensor) -> None:
        tracker.mark(("backward", index))

    def pre_forward(module: nn.Module, args: tuple) -> None:
        if not _in_backward():  # (a checkpointed layer's recomputation stays in its backward's segment)
            tracker.mark(("forward", index))

    def post_forward(module: nn.Module, args: tuple, output: Any) -> None:
        if _in_backward():
            return
        tracker.mark(("after forward", index))
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(mark_backward)

    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward)


def extrapolate(traced: dict[int, MemoryProfile], num_layers: int, prefix: str) -> tuple[MemoryProfile | None, str]:
    """The profile at `num_layers` layers from the segment peaks of three consecutive layer counts, or (None, why)
    when a check fails (module docstring)."""
    counts = sorted(traced)
    tables: dict[int, dict[Class, Breakdown]] = {}
    for n in counts:
        profile = traced[n]
        segments = {key: _grouped(b, prefix) for key, b in profile.segments.items()}
        if any(_first_largest(segments, phase) != _grouped(profile.peaks[phase], prefix) for phase in profile.peaks):
            return None, f"{n} layers: the segments' peaks are not the phases' peaks"
        if not _progressions(segments, n):
            return None, f"{n} layers: the interior layers' peaks are not in arithmetic progression"
        tables[n] = _classes(segments, n)
    if len({frozenset(t) for t in tables.values()}) != 1:
        return None, "the segments differ between the samples"
    out: dict[Class, Breakdown] = {}
    for key in tables[counts[-1]]:
        values = [tables[n][key] for n in counts]
        steps = {k: values[1].get(k, 0) - values[0].get(k, 0) for k in {*values[0], *values[1], *values[2]}}
        if any(values[2].get(k, 0) - values[1].get(k, 0) != step for k, step in steps.items()):
            return None, f"segment {key} does not grow by the same bytes per layer"
        grown = {k: values[2].get(k, 0) + (num_layers - counts[-1]) * step for k, step in steps.items()}
        if any(v < 0 for v in grown.values()):
            return None, f"segment {key} would hold negative bytes"
        out[key] = {k: v for k, v in grown.items() if v}
    sample = traced[counts[-1]]
    peaks = {phase: _first_largest(out, phase) for phase in sample.peaks}
    units = (*(u for u in sample.units if not re.match(rf"^{re.escape(prefix)}\d+$", u)), prefix + "*")
    method = f"extrapolated from {', '.join(map(str, counts[:-1]))} and {counts[-1]} layers"
    return MemoryProfile(peaks, units, sample.device, method=method), ""


def _grouped(breakdown: Breakdown, prefix: str) -> Breakdown:
    """`breakdown` with the layers' modules (prefix + i ...) summed as prefix + "*" ..."""
    layer = re.compile(rf"^{re.escape(prefix)}\d+(?=\.|$)")
    out: Breakdown = defaultdict(int)
    for (module, category), n in breakdown.items():
        out[(layer.sub(prefix + "*", module), category)] += n
    return dict(out)


def _first_largest(segments: dict, phase: Phase) -> Breakdown:
    """The breakdown of the first (in time) of `phase`'s segments with the largest total."""
    best: Breakdown = {}
    for (_, seg_phase, _), breakdown in segments.items():
        if seg_phase == phase and (not best or sum(breakdown.values()) > sum(best.values())):
            best = breakdown
    return best


def _layer_of(label: Hashable) -> tuple[str, int] | None:
    if isinstance(label, tuple) and len(label) == 2 and isinstance(label[1], int):
        return label[0], label[1]
    return None


def _progressions(segments: dict, n: int) -> bool:
    """Whether, in each run of a kind of layer segment, the interior layers' peaks step by the same bytes."""
    runs: dict[tuple, dict[int, Breakdown]] = defaultdict(dict)
    for (entry, phase, label), breakdown in segments.items():
        layer = _layer_of(label)
        if layer is not None and EDGE <= layer[1] <= n - 1 - EDGE:
            runs[(entry, phase, layer[0])][layer[1]] = breakdown
    for run in runs.values():
        if sorted(run) != list(range(EDGE, n - EDGE)):
            return False
        ordered = [run[i] for i in sorted(run)]
        keys = {k for b in ordered for k in b}
        steps = {tuple(b.get(k, 0) - a.get(k, 0) for k in sorted(keys, key=str)) for a, b in pairwise(ordered)}
        if len(steps) > 1:
            return False
    return True


def _classes(segments: dict, n: int) -> dict[Class, Breakdown]:
    """Segments by class, in the order they began: layers by their distance from the nearer end (within `EDGE`),
    else as the first or last interior layer (the middle ones left out: no larger than those)."""
    out: dict[Class, Breakdown] = {}
    for (entry, phase, label), breakdown in segments.items():
        layer = _layer_of(label)
        if layer is None:
            out[(entry, phase, label)] = breakdown
            continue
        kind, i = layer
        if i < EDGE:
            out[(entry, phase, (kind, "start", i))] = breakdown
        elif i > n - 1 - EDGE:
            out[(entry, phase, (kind, "end", n - 1 - i))] = breakdown
        else:
            for position, at in (("first", EDGE), ("last", n - 1 - EDGE)):
                if i == at:
                    out[(entry, phase, (kind, position))] = breakdown
    return out
