"""What the modules register for the original parameters of a use_orig_params=True unit, and taking in the user's
replacements of them, as torch's FSDP1 does:

* outside forward/backward the modules register the original Parameters, as views of the local shard;
* inside forward they register the unsharded views themselves (named_parameters() lists them there), and a unit that
  stays unsharded until backward (SHARD_GRAD_OP) keeps them registered until it reshards; a unit that reshards, or
  only keeps its gathered buffer for backward (a FULL_SHARD root), shows the original Parameters again;
* before an unshard, a Parameter replaced in its module, or a new tensor assigned to its `.data`, is copied into the
  local shard (writeback); a changed shape raises torch's RuntimeError, and so does a gradient of another shape;
  changing a kept unsharded view between forward and backward raises torch's AssertionError.

FlatParamHandle mixes this in.
"""

import torch
import torch.distributed as dist
from torch import nn

from .flat_param import FlatParamLayout, ParamInfo, ShardPiece
from .storage import same_memory
from .tensor_parallel import local_tensor


class OrigParamViews:
    # The handle's state this part reads and keeps (set by FlatParamHandle.__init__).
    sharded: bool
    local_shard: torch.Tensor
    full_padded: torch.Tensor
    layout: FlatParamLayout
    replicate_group: dist.ProcessGroup | None
    unsynced_grad: torch.Tensor | None
    orig_params: dict[ParamInfo, nn.Parameter]
    _local_pieces: dict[ParamInfo, ShardPiece]
    _registered_views: dict[ParamInfo, torch.Tensor]  # the unsharded views the modules register (forward)

    def _local_view(self, flat: torch.Tensor, info: ParamInfo) -> torch.Tensor:
        raise NotImplementedError  # (OrigParamGrads)

    def _attributes(self):
        raise NotImplementedError  # (FlatParamHandle)

    def _register_views(self, views: dict[ParamInfo, torch.Tensor]) -> None:
        for module, name, info in self._attributes():
            if name in module._parameters:
                module._parameters[name] = views[info]
        self._registered_views = views

    def _register_orig_params(self) -> None:
        """The modules register the original Parameters again (after forward's views, or where a rank replaced one it
        holds no elements of, which torch ignores and undoes)."""
        self._registered_views = {}
        for module, name, info in self._attributes():
            param = self.orig_params[info]
            if module._parameters.get(name, param) is not param:
                module._parameters[name] = param

    def _check_registered_views(self) -> None:
        """A unit kept unsharded from forward to backward: its registered views must be the ones forward made."""
        storage = self.full_padded.untyped_storage().data_ptr()
        for module, name, info in self._attributes():
            current = module._parameters.get(name)
            view = self._registered_views[info]
            if current is not view or local_tensor(current).untyped_storage().data_ptr() != storage:
                strategy = "_HYBRID_SHARD_ZERO2" if self.replicate_group is not None else "SHARD_GRAD_OP"
                raise AssertionError(
                    "FSDP does not support changing the parameters between forward and backward for "
                    f"HandleShardingStrategy.{strategy}"
                )

    @torch.no_grad()
    def _writeback_orig_params(self) -> None:
        if self._registered_views:  # views from a forward whose backward is still to come: nothing to write back
            self._check_registered_views()
            return
        for info, param in list(self.orig_params.items()):
            if self.sharded and info not in self._local_pieces:
                continue  # as in torch: only the parameters with elements on this rank
            current = info.module._parameters.get(info.param_name)
            if current is None:
                continue  # deregistered meanwhile (torch skips it too)
            if current is not param:  # a new Parameter replaces the original (its gradient is not carried over)
                self.orig_params[info] = param = current
            expected = self._local_view(self.local_shard, info)
            if not same_memory(param.data, expected) and (param.numel() or expected.numel()):
                _check_writeback_shape(param, expected, "parameter", self.sharded)
                expected.copy_(param.data.reshape(expected.shape))
                param.data = expected
            if param.grad is not None and self.unsynced_grad is None:  # (under no_sync they are our full-shape ones)
                _check_writeback_shape(param.grad, expected, "gradient", self.sharded)
        for shared in self.layout.shared:
            primary = self.orig_params[shared.primary]
            if shared.module._parameters.get(shared.param_name, primary) is not primary:
                raise NotImplementedError("Changing shared parameters is not supported yet")


def _check_writeback_shape(tensor: torch.Tensor, expected: torch.Tensor, what: str, sharded: bool) -> None:
    """torch's check before a writeback: a sharded unit needs exactly this rank's 1-D piece, NO_SHARD the same numel
    (torch flattens it first)."""
    shape = tensor.shape if sharded else torch.Size([tensor.numel()])
    if shape != torch.Size([expected.numel()]):
        raise RuntimeError(
            f"Cannot writeback when the {what} shape changes\nExpects {torch.Size([expected.numel()])} but got {shape}"
        )
