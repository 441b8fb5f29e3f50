"""The sharded gradient of a use_orig_params=True unit, kept on the original parameters.

With a separate unsharded buffer (any sharded, mixed-precision or offloaded unit) it lives in one compact buffer
holding this rank's pieces of the trainable parameters only, each original `.grad` a view of it, so frozen parameters
and alignment padding cost no gradient memory; otherwise (NO_SHARD in full precision) the original gradients are views
of the flat gradient. FlatParamHandle mixes this in; here is what follows the user's edits to those gradients.
"""

import torch
from torch import nn

from .flat_param import FlatParameter, FlatParamLayout, ParamInfo, ShardPiece


class OrigParamGrads:
    # The handle's state this part reads and keeps (set by FlatParamHandle.__init__).
    sharded: bool
    rank: int
    layout: FlatParamLayout
    use_orig_params: bool
    grads_on_orig_params: bool
    local_shard: torch.Tensor
    flat_param: FlatParameter
    orig_params: dict[ParamInfo, nn.Parameter]
    saved_grad: torch.Tensor | None
    unsynced_grad: torch.Tensor | None
    unsynced_in_grad: bool
    _local_pieces: dict[ParamInfo, ShardPiece]
    _orig_grad_views: dict[ParamInfo, torch.Tensor]
    _compact_grad: torch.Tensor | None  # the buffer behind `_compact_views`, when ours
    _compact_views: dict[ParamInfo, torch.Tensor]  # the sharded gradient of each original parameter

    def has_grad_slot(self, info: ParamInfo) -> bool:
        """Whether the parameter's gradient is a tensor (else None), as torch FSDP1's `in_shard`: it overlaps this
        rank's range of the flat parameter. One without elements overlaps when its offset lies strictly inside the
        range (it then gets an empty gradient); under NO_SHARD the range is the whole flat parameter."""
        if info.numel:
            return not self.sharded or info in self._local_pieces
        lo = self.rank * self.layout.shard_numel if self.sharded else 0
        hi = lo + self.layout.shard_numel if self.sharded else self.layout.numel
        return lo < info.offset < hi

    def _local_view(self, flat: torch.Tensor, info: ParamInfo) -> torch.Tensor:
        if not self.sharded:
            return info.view_in(flat)
        piece = self._local_pieces.get(info)
        if piece is None:
            return flat[:0]
        return flat[piece.offset_in_shard : piece.offset_in_shard + piece.numel_in_shard]

    def sync_grad_from_orig_params(self) -> None:
        """use_orig_params=True: adopt what the user did to the original gradients (zero_grad(set_to_none), edits)."""
        if not self.use_orig_params or self.unsynced_grad is not None:
            return
        if self.grads_on_orig_params:
            self._adopt_orig_grads()
            return
        flat_grad = self.flat_param.grad
        grads = {info: p.grad for info, p in self.orig_params.items() if info in self._orig_grad_views}
        storage = flat_grad.untyped_storage().data_ptr() if flat_grad is not None else None
        if flat_grad is not None and all(
            grads[i] is v and v.untyped_storage().data_ptr() == storage for i, v in self._orig_grad_views.items()
        ):
            return  # untouched since we set them (`.grad.data = ...` keeps the object but not the storage)
        if all(g is None for g in grads.values()):
            self.flat_param.grad = None
            self._orig_grad_views = {}
            return
        fresh = torch.zeros_like(self.flat_param)
        for info, grad in grads.items():
            if grad is not None:
                self._local_view(fresh, info).copy_(grad.reshape(self._local_view(fresh, info).shape))
        self.flat_param.grad = fresh
        self._use_orig_grad_views()

    def _use_orig_grad_views(self) -> None:
        if self.grads_on_orig_params:
            for info, param in self.orig_params.items():
                assign_grad(param, self._compact_views.get(info) if param.requires_grad else None)
            return
        flat_grad = self.flat_param.grad
        self._orig_grad_views = {}
        for info, param in self.orig_params.items():
            # (under no_sync() every parameter shows its view of the unsharded gradient, as in torch's FSDP1)
            has_data = self.unsynced_in_grad or self.has_grad_slot(info)
            view = self._local_view(flat_grad, info) if flat_grad is not None and has_data else None
            if view is not None and not param.requires_grad:
                view = None
            assign_grad(param, view)
            if view is not None:
                self._orig_grad_views[info] = view

    def _adopt_orig_grads(self) -> None:
        """Take the original parameters' gradients as the sharded gradient to accumulate into: unchanged when they
        are still our views, dropped after zero_grad(set_to_none=True), copied in on the next reduction otherwise."""
        current = {info: p.grad for info, p in self.orig_params.items() if p.grad is not None}
        if current.keys() == self._compact_views.keys() and all(
            current[i] is v for i, v in self._compact_views.items()
        ):
            return
        self._compact_grad = None  # the next reduction builds a fresh buffer from these values
        self._compact_views = current

    def _trainable_slots(self) -> list[tuple[ParamInfo, int, int]]:
        """(parameter, first element in the local flat shard, numel) of each trainable original parameter that has
        elements on this rank."""
        slots = []
        for info, param in self.orig_params.items():
            if not param.requires_grad or not self.has_grad_slot(info):
                continue
            if not self.sharded:
                slots.append((info, info.offset, info.numel))
            elif info in self._local_pieces:
                piece = self._local_pieces[info]
                slots.append((info, piece.offset_in_shard, piece.numel_in_shard))
            else:  # no elements, inside this rank's range: an empty gradient
                slots.append((info, 0, 0))
        return slots

    def _accumulate_compact(self, shard_grad: torch.Tensor) -> None:
        """Add a reduced gradient in the flat shard's layout into the original parameters' compact gradient."""
        slots = self._trainable_slots()
        if self._compact_grad is None or self._compact_views.keys() != {info for info, _, _ in slots}:
            self._rebuild_compact(slots, shard_grad.dtype, shard_grad.device)
        for info, start, numel in slots:
            target = self._compact_views[info]  # (ours: a 1-D piece, or under NO_SHARD a view in the flat order)
            (target if self.sharded else info.flatten(target)).add_(shard_grad[start : start + numel])

    def _rebuild_compact(self, slots: list[tuple[ParamInfo, int, int]], dtype: torch.dtype, device: torch.device):
        """A fresh compact buffer for `slots`, starting from the current per-parameter values (zero where none)."""
        buffer = torch.zeros(sum(numel for _, _, numel in slots), dtype=dtype, device=device)
        views, offset = {}, 0
        for info, _, numel in slots:
            view = buffer[offset : offset + numel]
            views[info] = view if self.sharded else info.view_of(view)
            previous = self._compact_views.get(info)
            if previous is not None:
                view.copy_(previous.reshape(-1) if self.sharded else info.flatten(previous))
            offset += numel
        self._compact_grad, self._compact_views = buffer, views

    def local_sharded_grad(self) -> torch.Tensor | None:
        """This rank's sharded gradient in the flat shard's layout (assembled, zero-filled, when it lives on the
        original parameters); None if there is none."""
        if not self.grads_on_orig_params:
            return self.saved_grad if self.unsynced_grad is not None else self.flat_param.grad
        self.sync_grad_from_orig_params()
        if not self._compact_views:
            return None
        flat = torch.zeros_like(self.local_shard, dtype=next(iter(self._compact_views.values())).dtype)
        for info, _, _ in self._trainable_slots():
            if info in self._compact_views:
                local = self._local_view(flat, info)
                local.copy_(self._compact_views[info].reshape(local.shape))
        return flat


def assign_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Set a gradient whose shape or dtype differs from the parameter's current data, as torch FSDP1 does under
    no_sync() (unsharded gradients on sharded parameters) and with keep_low_precision_grads: `.grad` assignment
    checks both against `.data`, so the data is swapped for a one-element stand-in (an expanded view) meanwhile."""
    if grad is None or (grad.shape == param.shape and grad.dtype == param.dtype):
        param.grad = grad
        return
    data = param.data
    param.data = grad.new_empty(1).expand(grad.shape)
    param.grad = grad
    param.data = data
