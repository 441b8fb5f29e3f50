"""torch FSDP1's private names on the wrapper, for code that reads or drives them as torch's: the flat parameter and
handles (`_flat_param`, `_has_params`, `_all_handles`), the device handle and stream attributes, the gradient divide
factors, explicit prefetch (`_unshard`) and `_reset_lazy_init`. docs/compatibility.md (§6) says which code reads
which. FullyShardedDataParallel mixes this in; it only reads the unit's state (unit.py) and its handles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .collectives import gradient_divide_factors
from .flat_param import FlatParameter
from .handle import FlatParamHandle
from .unit import fsdp_modules

if TYPE_CHECKING:
    from .runtime import Runtime


class TorchUnitNames:
    """Mixed into FullyShardedDataParallel (before FSDPUnit): torch's private names over the unit's own state."""

    # The unit's state these names read (unit.py, set by the wrapper).
    _handles: list[FlatParamHandle]
    compute_device: torch.device
    world_size: int
    _inter_node_pg: dist.ProcessGroup | None
    _runtime: Runtime | None
    _is_root: bool | None
    # torch's hook for custom DTensor flattening: None, as torch's; one set is named in a warning (patch_watch.py)
    _fsdp_extension: Any = None

    @property
    def _device_handle(self) -> Any:
        """torch's device handle: the compute device's torch module (`torch.cuda`, `torch.cpu`), whose
        `device_count()`, `current_stream()` and `stream()` code calls (ByteCheckpoint, ColossalAI)."""
        return torch.get_device_module(self.compute_device.type)

    @property
    def _gradient_predivide_factor(self) -> float:
        """torch's: what this unit's gradients are divided by before their reduction (its handles hold it)."""
        return self._divide_factors()[0]

    @_gradient_predivide_factor.setter
    def _gradient_predivide_factor(self, value: float) -> None:
        self._set_divide_factors(value, self._divide_factors()[1])

    @property
    def _gradient_postdivide_factor(self) -> float:
        """torch's: what they are divided by after it. Code rescales a unit's gradients through it (VeOmni multiplies
        it by the expert-parallel size for expert units), and the reduction honours it, as torch's does."""
        return self._divide_factors()[1]

    @_gradient_postdivide_factor.setter
    def _gradient_postdivide_factor(self, value: float) -> None:
        self._set_divide_factors(self._divide_factors()[0], value)

    def _divide_factors(self) -> tuple[float, float]:
        if self._handles:
            return self._handles[0].pre_divide, self._handles[0].post_divide
        replicas = self._inter_node_pg.size() if self._inter_node_pg is not None else 1
        return self.__dict__.get("_unit_divide_factors") or gradient_divide_factors(self.world_size * replicas)

    def _set_divide_factors(self, pre: float, post: float) -> None:
        self.__dict__["_unit_divide_factors"] = (pre, post)  # (a unit without parameters keeps them itself)
        for handle in self._handles:
            handle.pre_divide, handle.post_divide = pre, post

    @property
    def _flat_param(self) -> FlatParameter | None:
        return self._handles[0].flat_param if self._handles else None

    @property
    def _has_params(self) -> bool:
        return bool(self._handles)

    @property
    def _all_handles(self) -> list[FlatParamHandle]:
        """The handles of every unit in this one's tree, in pre-order: what torch sets on the root at lazy init (torch
        has none before it, nor on inner units)."""
        assert isinstance(self, nn.Module)  # (mixed into the wrapper)
        return [handle for unit in fsdp_modules(self) for handle in unit._handles]

    def _show_streams(self, stream: Any) -> None:
        """torch's stream attributes, set at lazy init as torch sets them (DINOv2 reads them to share one root's
        streams with another's; torch 2.0 kept them in `_streams`, which code that finds `_handles` reads). All work
        of ours runs on the compute device's current stream, so they all name it; values code sets are kept and
        change nothing."""
        for name in ("unshard", "post_backward", "pre_unshard", "all_reduce", "default"):
            setattr(self, f"_{name}_stream", stream)
        self._streams = {"unshard": stream, "post_backward": stream, "pre_unshard": stream, "default": stream}

    def _unshard(self, async_op: bool = False) -> UnshardWait | None:
        """torch's explicit prefetch: gather this unit's parameters now, so that its next forward uses them instead
        of gathering. With `async_op` the all-gather runs while the caller goes on and the returned object's
        `wait()` completes it (the forward waits for it otherwise)."""
        for handle in self._handles:
            handle.start_unshard()
            handle.prefetched = True
        waiter = UnshardWait(list(self._handles))
        if async_op:
            return waiter
        waiter.wait()
        return None

    def _reset_lazy_init(self) -> None:
        """torch's: the next use decides the root again, as after construction (code that wraps more units around
        ones that already ran, or drives an inner unit on its own). Every unit of this one's runtime is reset with
        it, so that none keeps a runtime whose root may become an inner unit of another."""
        units = self._runtime.units if self._runtime is not None else [self]
        for unit in units:
            assert isinstance(unit, TorchUnitNames)
            unit._is_root = None
            unit._runtime = None


class UnshardWait:
    """What `FSDP._unshard(async_op=True)` returns: `wait()` completes the gathers (torch's UnshardHandle)."""

    def __init__(self, handles: list[FlatParamHandle]) -> None:
        self._handles = handles

    def wait(self) -> None:
        for handle in self._handles:
            if handle.prefetched:  # (else a forward has used the gather already, or it was dropped)
                handle.wait_unshard()
        self._handles = []
