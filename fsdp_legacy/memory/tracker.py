"""MemoryTracker: live tensor memory by category, module and phase, and its peaks.

    with MemoryTracker(model) as tracker:
        loss = model(x).sum(); loss.backward(); optim.step(); optim.zero_grad()
    print(tracker.table())

A TorchDispatchMode sees every tensor an op touches and counts each storage once, from its first appearance until it
dies (a weak reference's callback), so views and aliases cost nothing extra. `UntypedStorage.resize_`, with which
FSDP frees and re-allocates unsharded parameters, bypasses the dispatcher and is patched while the tracker is active.
It works on any device and under FakeTensorMode (the estimator); on CUDA it also records the allocator's per-phase
peaks (`cuda_peaks`) as a cross-check. It counts tensor storages only: not kernel scratch space, not allocator
rounding or caching, and not storages that no op touches while it is active and no known owner holds.
"""

import weakref
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from .categories import Category, Phase, grad_hooks, module_names, roles, units_of
from .profile import MemoryProfile

Key = tuple[str, Category]  # (module FQN, category)
Segment = tuple[int, Phase, Hashable]  # (phase entry number, phase, the label `mark` set last)


@dataclass
class _Storage:
    """One storage being counted. Its key may be refined later (a temporary that becomes a gradient, state an
    optimizer creates): snapshots hold the records, so they show the latest labels."""

    ref: weakref.ref
    device: str
    nbytes: int
    key: Key


@dataclass(frozen=True)
class Snapshot:
    """The storages live on one device at one moment and their sizes then."""

    total: int = 0
    entries: tuple[tuple[_Storage, int], ...] = ()

    @property
    def bytes(self) -> dict[Key, int]:
        """Bytes by (module FQN, category), by the records' current labels."""
        out: dict[Key, int] = defaultdict(int)
        for record, nbytes in self.entries:
            out[record.key] += nbytes
        return dict(out)


@dataclass
class _Hooks:
    handles: list = field(default_factory=list)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class MemoryTracker(TorchDispatchMode):
    """Counts live tensor storages per device, by category, module and phase, and keeps each phase's peak.

    `model` (optional, or later with `track`) names modules and identifies parameters, gradients, buffers and the
    FSDP units' state; its forward marks the forward phase and its arguments count as inputs. Any optimizer stepped
    while the tracker is active marks the optimizer phase and owns its state; backward is what autograd runs.
    """

    def __init__(self, model: nn.Module | None = None, segments: bool = False) -> None:
        super().__init__()
        self._model: weakref.ref | None = None  # weak: `del model` inside the tracker frees it
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self.live: dict[str, int] = defaultdict(int)  # device -> bytes
        self.peaks: dict[Phase, dict[str, Snapshot]] = {phase: {} for phase in Phase}
        self.cuda_peaks: dict[Phase, int] = {}  # torch.cuda.max_memory_allocated per phase, on CUDA
        self._storages: dict[int, _Storage] = {}  # id(storage) -> record
        # With `segments`, a peak per stretch of a phase between two `mark`s too (segment -> device -> snapshot), in
        # the order the segments began: what the estimator of repeated layers extrapolates (memory/repeated.py).
        self.segment_peaks: dict[Segment, dict[str, Snapshot]] | None = {} if segments else None
        self._entries = 0  # phases entered so far
        self._segment_label: Hashable = None
        # A new peak's storages are listed only when memory first drops after it (or when read, or a phase or segment
        # ends): one listing per local maximum rather than one per allocation. All of a device's unlisted peaks are
        # of this moment: memory has not dropped since, and a rise is a new peak of the current phase and segment.
        self._unlisted: dict[str, list[dict[str, Snapshot]]] = {}  # device -> peak tables lacking its entries
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> FQN
        self._module_stack: list[str] = []
        self._forward_depth = 0
        self._phase = Phase.OTHER  # set by hooks; backward is read from autograd
        self._current = Phase.OTHER
        self._hooks = _Hooks()
        self._model_hooks = _Hooks()
        self._original_resize = torch.UntypedStorage.resize_
        if model is not None:
            self.track(model)

    # ----------------------------------------------------------------------------------------------------------------
    # Public API

    def track(self, model: nn.Module) -> None:
        """Attribute memory to `model`'s modules (call again after wrapping it, e.g. in FSDP)."""
        self._model_hooks.remove()
        self._model = weakref.ref(model)
        self._names = weakref.WeakKeyDictionary(module_names(model))
        self._model_hooks.handles += [
            model.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True),
            model.register_forward_hook(self._root_post_forward, always_call=True),
        ]
        # A gradient is a temporary of autograd until it accumulates; these hooks name it as it arrives.
        for param, key in grad_hooks(model):
            self._model_hooks.handles.append(param.register_hook(partial(self._label_grad, key)))
        self.relabel()

    @property
    def model(self) -> nn.Module | None:
        return self._model() if self._model is not None else None

    def peak(self, phase: Phase | None = None, device: str | None = None) -> int:
        """Peak live bytes in `phase` (all phases if None) on `device` (the busiest if None)."""
        return self.peak_snapshot(phase, device).total

    def peak_snapshot(self, phase: Phase | None = None, device: str | None = None) -> Snapshot:
        self._list_peaks()
        phases = [phase] if phase is not None else list(Phase)
        snapshots = [s for p in phases for d, s in self.peaks[p].items() if device is None or d == device]
        return max(snapshots, key=lambda s: s.total, default=Snapshot())

    def current(self, device: str | None = None) -> Snapshot:
        """What is live now on `device` (by default the device holding the most)."""
        self.relabel()
        if device is None:
            device = max(self.live, key=lambda d: self.live[d], default="cpu")
        return self._snapshot_of(device)

    def reset_peak(self) -> None:
        """Start the peaks afresh from what is live now (e.g. after warm-up steps)."""
        self.relabel()
        self._unlisted.clear()
        phase = self._phase_now()
        self.peaks = {p: {} for p in Phase}
        if self.segment_peaks is not None:
            self.segment_peaks = {self._segment(): {}}
        for device in self.live:
            self.peaks[phase][device] = self._snapshot_of(device)
            if self.segment_peaks is not None:
                self.segment_peaks[self._segment()][device] = self.peaks[phase][device]
        self.cuda_peaks.clear()

    def mark(self, label: Hashable) -> None:
        """Begin a new segment of the current phase, named `label` (with `segments`): e.g. "layer 3's forward"."""
        self._phase_now()
        self._segment_label = label
        self._begin_segment()

    def relabel(self) -> None:
        """Re-read the roles of known storages from the model, the FSDP units and the optimizers."""
        model = self.model
        if model is None and not self.optimizers:
            return
        model = model if model is not None else nn.Module()
        for tensor, category, module in roles(model, list(self.optimizers)):
            self._label(tensor, (module, category))

    def units(self) -> list[str]:
        """FQNs of the tracked model's FSDP units (the root is "")."""
        model = self.model
        return units_of(model) if model is not None else []

    def profile(self, device: str | None = None) -> MemoryProfile:
        """The peaks per phase on `device` (by default the busiest) as plain data, with the latest labels."""
        device = device or max(self.live, key=lambda d: self.live[d], default="cpu")
        self.relabel()
        peaks = {p: self.peak_snapshot(p, device).bytes for p in Phase if device in self.peaks[p]}
        segments = {
            segment: snapshots[device].bytes
            for segment, snapshots in (self.segment_peaks or {}).items()
            if device in snapshots
        }
        return MemoryProfile(peaks, tuple(self.units()), device, segments)

    def table(self, top_modules: int = 12) -> str:
        """Peaks per phase by category, and per FSDP unit (or module) at the overall peak, of the busiest device."""
        return self.profile().table(top_modules)

    # ----------------------------------------------------------------------------------------------------------------
    # Counting

    def _storages_of(self, t: torch.Tensor) -> list[tuple[torch.UntypedStorage, str]]:
        if is_traceable_wrapper_subclass(t):  # e.g. DTensor: count its local tensors
            attrs, _ = t.__tensor_flatten__()
            return [s for a in attrs if isinstance(x := getattr(t, a), torch.Tensor) for s in self._storages_of(x)]
        if t.device.type == "meta" or t.is_sparse:
            return []
        return [(t.untyped_storage(), str(t.device))]  # the tensor's device: fake tensors' storages are on meta

    def _count(self, storage: torch.UntypedStorage, device: str) -> _Storage:
        """Start counting `storage` (if new) and update its size."""
        record = self._storages.get(id(storage))
        if record is None or record.ref() is not storage:
            if record is not None:  # the id was reused before the callback ran
                self._drop(id(storage), record.ref)
            phase = self._phase_now()
            category = Category.ACTIVATION if phase == Phase.FORWARD else Category.TEMPORARY
            module = self._module_stack[-1] if self._module_stack else ""
            ref = weakref.ref(storage, partial(self._drop, id(storage)))
            record = self._storages[id(storage)] = _Storage(ref, device, 0, (module, category))
        self._resize(record, storage.nbytes())
        return record

    def _resize(self, record: _Storage, nbytes: int) -> None:
        delta = nbytes - record.nbytes
        if not delta:
            return
        phase = self._phase_now()  # (closes the previous phase first, if this begins a new one)
        if delta < 0 and record.device in self._unlisted:
            self._list_peak(record.device)
        record.nbytes = nbytes
        self.live[record.device] += delta
        if delta > 0:
            self._check_peak(record.device, phase)

    def _label(self, tensor: torch.Tensor, key: Key) -> None:
        for storage, device in self._storages_of(tensor):
            self._count(storage, device).key = key

    def _label_grad(self, key: Key, grad: torch.Tensor) -> None:
        self._label(grad, key)

    def _drop(self, storage_id: int, ref: weakref.ref) -> None:
        record = self._storages.get(storage_id)
        if record is not None and record.ref is ref:
            self._resize(record, 0)
            del self._storages[storage_id]

    def _check_peak(self, device: str, phase: Phase | None = None) -> None:
        phase = phase or self._phase_now()
        live = self.live[device]
        tables = [self.peaks[phase]]
        if self.segment_peaks is not None:
            tables.append(self.segment_peaks.setdefault(self._segment(), {}))
        for table in tables:
            best = table.get(device)
            if best is None or live > best.total:
                table[device] = Snapshot(live)
                unlisted = self._unlisted.setdefault(device, [])
                if not any(t is table for t in unlisted):
                    unlisted.append(table)

    def _list_peak(self, device: str) -> None:
        """Memory is about to drop (or be read, or a phase or segment ends): what is live now is the unlisted peak."""
        snapshot = self._snapshot_of(device)
        for table in self._unlisted.pop(device):
            table[device] = snapshot

    def _list_peaks(self) -> None:
        for device in list(self._unlisted):
            self._list_peak(device)

    def _snapshot_of(self, device: str) -> Snapshot:
        entries = tuple((r, r.nbytes) for r in self._storages.values() if r.device == device and r.nbytes)
        return Snapshot(self.live[device], entries)

    # ----------------------------------------------------------------------------------------------------------------
    # Phases and modules

    def _set_phase(self, phase: Phase) -> None:
        self._phase = phase
        self._phase_now()  # enters it now: a phase that allocates nothing still has a peak

    def _phase_now(self) -> Phase:
        phase = Phase.BACKWARD if torch._C._current_graph_task_id() != -1 else self._phase
        if phase != self._current:
            self._enter(phase)
        return phase

    def _enter(self, phase: Phase) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # the allocator's view, per phase
            previous = self._current
            self.cuda_peaks[previous] = max(self.cuda_peaks.get(previous, 0), torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        if phase == Phase.BACKWARD:  # ends the forward whose activations it consumes
            Variable._execution_engine.queue_callback(self._end_forward)
        self._list_peaks()  # the peaks of the phase that ends
        self._current = phase
        self._entries += 1
        if phase != Phase.FORWARD:
            self._module_stack.clear()
        self._begin_segment()

    def _segment(self) -> Segment:
        return (self._entries, self._current, self._segment_label)

    def _begin_segment(self) -> None:
        self._list_peaks()
        if self.segment_peaks is not None:
            self.segment_peaks.setdefault(self._segment(), {})
        for device in list(self.live):  # a phase's (a segment's) peak is at least what was live when it began
            self._check_peak(device, self._current)

    def _end_forward(self) -> None:
        if self._phase == Phase.FORWARD:
            self._phase = Phase.OTHER

    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._forward_depth += 1
        self._set_phase(Phase.FORWARD)
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._label(t, ("", Category.INPUT))

    def _root_post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._forward_depth -= 1
        if self._forward_depth == 0 and not torch.is_grad_enabled():
            self._set_phase(Phase.OTHER)  # with grad, forward lasts until backward: its activations are still live

    def _module_pre_forward(self, module: nn.Module, args: tuple) -> None:
        name = self._names.get(module)
        if name is not None:
            self._module_stack.append(name)

    def _module_post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        name = self._names.get(module)
        if name is not None and self._module_stack and self._module_stack[-1] == name:
            self._module_stack.pop()

    def _optimizer_pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.optimizers.add(optimizer)
        self._set_phase(Phase.OPTIMIZER)

    def _optimizer_post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.relabel()  # names the state it just created
        self._set_phase(Phase.OTHER)

    # ----------------------------------------------------------------------------------------------------------------
    # Mode

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((out, args, kwargs)):
            if isinstance(t, torch.Tensor):
                for storage, device in self._storages_of(t):
                    self._count(storage, device)
        return out

    def __enter__(self) -> "MemoryTracker":
        tracker, original = self, self._original_resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            record = tracker._storages.get(id(storage))
            if record is not None and record.ref() is storage:
                tracker._resize(record, storage.nbytes())
            elif storage.device.type != "meta":  # first met here (fake tensors' storages are met through ops)
                tracker._count(storage, str(storage.device))
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        self._hooks.handles += [
            module_hooks.register_module_forward_pre_hook(self._module_pre_forward),
            module_hooks.register_module_forward_hook(self._module_post_forward, always_call=True),
            optimizer_hooks.register_optimizer_step_pre_hook(self._optimizer_pre_step),
            optimizer_hooks.register_optimizer_step_post_hook(self._optimizer_post_step),
        ]
        super().__enter__()
        self.relabel()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.relabel()
        self._enter(Phase.OTHER)
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        self._hooks.remove()
        self._model_hooks.remove()

    def __repr__(self) -> str:
        return f"MemoryTracker(peak={self.peak()} bytes)"
