"""A unit's gradient through backward: autograd accumulates the unsharded gradient into the flat parameter; it is
then reduced (reduce-scattered when sharded, all-reduced under NO_SHARD), or under no_sync() kept unreduced and added
to the next synchronised backward's, and at the end of backward the reduced shard joins the sharded gradient.

Where the sharded gradient lives:
  use_orig_params=False -> `flat_param.grad`. When backward reaches the unit it is set aside in `saved_grad` (autograd
               accumulates the unsharded gradient into `.grad`) and put back at the end of backward. Only then, as
               torch FSDP1 does, so that a zero_grad() between forward and backward still counts.
  use_orig_params=True  -> only on the original parameters, as views of one compact buffer that holds just this
               rank's pieces of trainable parameters: frozen parameters and alignment padding cost no gradient memory
               (torch FSDP1 keeps a shard-sized flat gradient). `flat_param.grad` then stays None while sharded.
               NO_SHARD in full precision on the compute device, where autograd writes the flat gradient in place,
               keeps the first scheme with the original gradients as views of it (orig_param_grads.py).

FlatParamHandle mixes this in; the runtime decides when each step runs (runtime.py), and may reduce several units'
gradients in one collective (buckets.py).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import collectives as comm
from .flat_param import FlatParameter, FlatParamLayout, ParamInfo
from .orig_param_grads import assign_grad
from .storage import free_storage


@dataclass
class PendingReduction:
    """An issued gradient reduce-scatter (or all-reduce) whose result is not yet folded into the gradient."""

    handle: "FlatParamGrads"
    work: comm.Waitable
    output: torch.Tensor
    input: torch.Tensor | None  # held until the collective completes where it is read back (comm.input_read_at_wait)
    post_divide: float


class FlatParamGrads:
    # The handle's state this part reads and keeps (set by FlatParamHandle.__init__).
    group: dist.ProcessGroup
    world_size: int
    replicate_group: dist.ProcessGroup | None
    pre_divide: float
    post_divide: float
    comm_hook: Callable | None
    comm_hook_state: object
    sharded: bool
    use_orig_params: bool
    uses_buffer: bool
    grads_on_orig_params: bool
    reduce_dtype: torch.dtype
    grad_dtype: torch.dtype
    compute_device: torch.device
    layout: FlatParamLayout
    local_shard: torch.Tensor
    flat_param: FlatParameter
    orig_params: dict[ParamInfo, nn.Parameter]
    saved_grad: torch.Tensor | None
    new_grad: torch.Tensor | None
    unsynced_grad: torch.Tensor | None
    unsynced_in_grad: bool
    backward_prepared: bool
    _orig_grad_views: dict[ParamInfo, torch.Tensor]
    _registered_views: dict[ParamInfo, torch.Tensor]

    def _check_registered_views(self) -> None:
        raise NotImplementedError  # (OrigParamViews)

    def sync_grad_from_orig_params(self) -> None:
        raise NotImplementedError  # (OrigParamGrads)

    def _use_orig_grad_views(self) -> None:
        raise NotImplementedError  # (OrigParamGrads)

    def _accumulate_compact(self, shard_grad: torch.Tensor) -> None:
        raise NotImplementedError  # (OrigParamGrads)

    def local_sharded_grad(self) -> torch.Tensor | None:
        raise NotImplementedError  # (OrigParamGrads)

    def prepare_gradient_for_backward(self) -> None:
        """Backward has reached the unit, and autograd is about to accumulate into the flat parameter: adopt the
        user's gradients as they are now, and set the sharded flat gradient aside (use_orig_params=False)."""
        if self.backward_prepared:
            return
        self.backward_prepared = True
        if self._registered_views:
            self._check_registered_views()
        self.sync_grad_from_orig_params()
        if self.uses_buffer and not self.grads_on_orig_params:
            grad, self.flat_param.grad = self.flat_param.grad, None
            if self.unsynced_grad is None:  # under no_sync, `.grad` only shows the unsynced gradient
                self.saved_grad = grad

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """This backward's gradient, taken off the flat parameter (when it has a separate unsharded buffer) so it
        can reshard first."""
        grad = self.flat_param.grad
        if self.uses_buffer:
            self.flat_param.grad = None
        return grad

    def accumulate_unsynced(self, grad: torch.Tensor | None) -> None:
        """no_sync(): keep the unsharded gradient, unreduced, adding it to those of earlier no_sync backwards."""
        if grad is None:
            return
        if self.unsynced_grad is None:
            self.unsynced_grad = grad
        else:
            self.unsynced_grad.add_(grad)

    def take_unsynced_into(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The first synchronised backward after no_sync() reduces the no_sync gradients together with its own."""
        unsynced, self.unsynced_grad = self.unsynced_grad, None
        if unsynced is None:
            return grad
        return unsynced if grad is None else grad.add_(unsynced)

    def take_grad_left_by_code(self) -> torch.Tensor | None:
        """The unsharded gradient code leaves on the flat parameter for torch's `_reduce_grad` (Galvatron's copy of
        torch's post-backward hook): the no_sync() gradient shown there, as the code changed it in place or cast it to
        the reduce dtype. It replaces the one kept aside, padded to the world size for the reduce-scatter."""
        grad = self.flat_param.grad
        if grad is None:
            return None
        if not self.uses_buffer:  # NO_SHARD in full precision: reduced in place in `.grad`, in the parameter's dtype
            if grad.dtype != self.flat_param.dtype:
                assign_grad(self.flat_param, grad.to(self.flat_param.dtype))
            self.prepare_gradient_for_backward()
            return self.flat_param.grad
        if self.unsynced_grad is None or grad.numel() != self.layout.numel:
            raise RuntimeError(
                "FSDP's `_reduce_grad` reduces the unsharded gradient that no_sync() accumulated on the flat "
                f"parameter, but this unit's `flat_param.grad` is not one (its {grad.numel()} elements are the "
                "reduced sharded gradient of a synchronised backward): call it only after backwards run under "
                "no_sync(), once per unit."
            )
        self.flat_param.grad = None
        self.prepare_gradient_for_backward()  # (the sharded gradient from before no_sync() stays aside)
        unsynced, self.unsynced_grad = self.unsynced_grad, None
        if grad.dtype == unsynced.dtype and grad.data_ptr() == unsynced.data_ptr():
            return unsynced  # shown as a view of the padded buffer: nothing to copy
        padded = grad.new_zeros(self.layout.padded_numel)
        padded[: grad.numel()].copy_(grad)
        return padded

    def _expose_unsynced_grads(self) -> None:
        """As torch FSDP1 shows them under no_sync(): the flat gradient unsharded and unpadded (use_orig_params=False),
        or full-shape gradients on the original parameters (True), while the parameters themselves stay sharded."""
        flat = self.unsynced_grad
        assert flat is not None, "called only while no_sync() accumulates"
        if not self.use_orig_params:
            assign_grad(self.flat_param, flat[: self.layout.numel])
            return
        for info, param in self.orig_params.items():
            if param.requires_grad:
                assign_grad(param, info.view_in(flat))
        self._orig_grad_views = {}

    def reduce_grad(self, grad: torch.Tensor | None) -> PendingReduction | None:
        """Issue the reduction of the unsharded gradient, in the reduce dtype: sharded strategies reduce-scatter it,
        NO_SHARD all-reduces it."""
        if grad is None:
            return None
        if grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
        if self.comm_hook is not None:  # the hook communicates (synchronously) and divides by itself
            output = grad
            if self.sharded:
                output = torch.empty(self.layout.shard_numel, dtype=grad.dtype, device=grad.device)
                self.comm_hook(self.comm_hook_state, grad, output)
            else:
                self.comm_hook(self.comm_hook_state, grad)
            return PendingReduction(self, comm.DONE, output, grad, 1.0)
        pre, post = self.pre_divide, self.post_divide
        if pre > 1:
            grad.div_(pre)
        if self.sharded:
            output = torch.empty(self.layout.shard_numel, dtype=grad.dtype, device=grad.device)
            work = comm.reduce_scatter(output, grad, self.group)
            held = grad if comm.input_read_at_wait(self.group) else None
            return PendingReduction(self, work, output, held, post)
        if self.world_size == 1:
            return PendingReduction(self, comm.DONE, grad, grad, post)
        return PendingReduction(self, comm.all_reduce(grad, self.group), grad, grad, post)

    def finish_reduction(self, pending: PendingReduction) -> None:
        pending.work.wait()
        if pending.input is not None and pending.input is not pending.output and pending.input.device.type == "cpu":
            # The unsharded gradient is dead now; free it at once rather than whenever the backend's work object
            # (which keeps its inputs) is released.
            free_storage(pending.input)
        if self.replicate_group is not None:
            comm.all_reduce(pending.output, self.replicate_group).wait()
        if pending.post_divide > 1:
            pending.output.div_(pending.post_divide)
        if self.uses_buffer:  # reduced in the reduce dtype; the gradient lives with the shard, in the grad dtype
            # (A blocking copy when offloading: the optimizer reads it on the CPU right after backward.)
            output = pending.output[: self.local_shard.numel()]
            output = output.to(device=self.local_shard.device, dtype=self.grad_dtype)
            if self.grads_on_orig_params:  # folded in at once, so no shard-sized gradient outlives its reduction
                self._accumulate_compact(output)
                if self.sharded and pending.output.device.type == "cpu":  # (ours: the backend's work may outlive it)
                    free_storage(pending.output)
            else:
                self.new_grad = output
        elif pending.output is not self.flat_param.grad:  # NO_SHARD reduced in another dtype: back into .grad
            assert self.flat_param.grad is not None
            if pending.output.dtype == self.grad_dtype != self.flat_param.grad.dtype:  # keep_low_precision_grads
                assign_grad(self.flat_param, pending.output)
            else:
                self.flat_param.grad.copy_(pending.output)

    def _settle_grads(self) -> None:
        """End of backward, the unit resharded: this backward's reduced gradient added to the sharded gradient, which
        is shown where the user reads it (under no_sync(), the unsynced gradient is shown instead)."""
        if not self.backward_prepared:  # backward never reached the unit: a zero_grad() after forward still counts
            self.sync_grad_from_orig_params()
        if self.saved_grad is not None and self.unsynced_grad is None:
            assign_grad(self.flat_param, self.saved_grad)
            self.saved_grad = None
        if self.new_grad is not None:
            if self.flat_param.grad is None:
                assign_grad(self.flat_param, self.new_grad)
            else:
                self.flat_param.grad.add_(self.new_grad)
            self.new_grad = None
        if self.uses_buffer and self.unsynced_grad is not None:
            self._expose_unsynced_grads()
        elif self.use_orig_params:
            self._use_orig_grad_views()

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole flat tensor (padded) of which every rank holds `shard` (the tensor itself under NO_SHARD)."""
        if not self.sharded:
            return shard
        shard = shard.to(self.compute_device)  # an offloaded shard travels to the compute device for the collective
        full = torch.empty(self.layout.padded_numel, dtype=shard.dtype, device=shard.device)
        comm.all_gather(full, shard.contiguous(), self.group).wait()
        return full

    def gather_full_grad(self) -> torch.Tensor | None:
        """The whole flat gradient, or None if no rank has one. With use_orig_params=True a rank holding only frozen
        parameters has none of its own, so the ranks agree first, and such a rank contributes zeros."""
        grad = self.local_sharded_grad()
        if self.sharded:
            anyone = torch.tensor([float(grad is not None)], device=self.compute_device)
            dist.all_reduce(anyone, op=dist.ReduceOp.MAX, group=self.group)
            if not anyone.item():
                return None
            if grad is None:
                grad = torch.zeros_like(self.local_shard, dtype=self.grad_dtype)
        return None if grad is None else self.gather_full(grad)

    def _step_optimizers_in_backward(self) -> None:
        """Optimizers applied in backward (torch.distributed.optim._apply_optimizer_in_backward, use_orig_params=True)
        step on each original parameter once its sharded gradient is final, then drop it, as torch's FSDP1 does."""
        for param in self.orig_params.values():
            optimizers = getattr(param, "_in_backward_optimizers", ())
            if param.grad is None or not optimizers:
                continue
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
