"""What a live storage is for: the categories and phases of the tracker, and how FSDP state maps onto them.

A storage's role is found by identity (the storage object) from the objects that own it: an FSDP unit's handle
(local shard, unsharded buffer, gradients, in-flight reductions), the model's buffers, the optimizers' state. What
no owner claims is an activation when it was allocated in forward and a temporary otherwise.
"""

from collections.abc import Iterable, Iterator
from enum import Enum

import torch
from torch import nn

from ..handle import FlatParamHandle
from ..unit import FSDPUnit, clean_fqn


class Category(Enum):
    SHARDED_PARAM = "sharded params"
    UNSHARDED_PARAM = "unsharded params"
    SHARDED_GRAD = "sharded grads"
    UNSHARDED_GRAD = "unsharded grads"
    OPTIMIZER_STATE = "optimizer state"
    BUFFER = "buffers"
    INPUT = "inputs"
    ACTIVATION = "activations"
    TEMPORARY = "temporaries"


class Phase(Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer step"
    OTHER = "other"  # construction, zero_grad, anything between steps


Role = tuple[torch.Tensor, Category, str]  # (a tensor of the storage, its category, the module it belongs to)


def module_names(model: nn.Module) -> dict[nn.Module, str]:
    """Module -> user-facing FQN (FSDP wrappers named like the module they wrap)."""
    return {module: clean(name) for name, module in model.named_modules()}


def clean(name: str) -> str:
    return clean_fqn(name)


def units_of(model: nn.Module) -> list[str]:
    """FQNs of the FSDP units in `model`, the root being ""."""
    return [clean(name) for name, module in model.named_modules() if isinstance(module, FSDPUnit)]


def grad_hooks(model: nn.Module) -> Iterator[tuple[torch.Tensor, tuple[str, Category]]]:
    """(leaf tensor, the key of the gradients autograd produces for it): FSDP units' flat parameters (unsharded
    gradients when the unit computes on a separate unsharded buffer) and plain parameters (whole gradients)."""
    flat = set()
    for name, unit in model.named_modules():
        for handle in unit._handles if isinstance(unit, FSDPUnit) else ():
            flat |= {handle.flat_param, *handle.orig_params.values()}
            if handle.flat_param.requires_grad:
                category = Category.UNSHARDED_GRAD if handle.uses_buffer else Category.SHARDED_GRAD
                yield handle.flat_param, (clean(name), category)
    for name, module in model.named_modules():
        for param in module._parameters.values():
            if param is not None and param.requires_grad and param not in flat:
                flat.add(param)
                yield param, (clean(name), Category.UNSHARDED_GRAD)


def roles(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[Role]:
    """Every storage whose role the model and the optimizers know now. Later roles override earlier ones."""
    owner: dict[torch.Tensor, str] = {}  # parameter -> module FQN, for the optimizer state
    for name, module in model.named_modules():
        for param in module._parameters.values():
            if param is not None and param not in owner:
                owner[param] = clean(name)
                # Plain (non-FSDP) parameters are whole: "unsharded"; FSDP's are re-labelled by their unit below.
                yield param, Category.UNSHARDED_PARAM, clean(name)
                if param.grad is not None:
                    yield param.grad, Category.UNSHARDED_GRAD, clean(name)
        for buffer in module._buffers.values():
            if buffer is not None:
                yield buffer, Category.BUFFER, clean(name)
    for name, unit in model.named_modules():
        for handle in unit._handles if isinstance(unit, FSDPUnit) else ():
            yield from _handle_roles(handle, clean(name))
            for param in handle.orig_params.values():  # use_orig_params=True: views of the shard
                owner[param] = clean(name)
    runtime = getattr(model, "_runtime", None)
    for reductions in runtime.pending if runtime is not None else ():  # gradient reductions in flight
        for pending in reductions:
            name = owner.get(pending.handle.flat_param, "")
            yield pending.input, Category.UNSHARDED_GRAD, name
            yield pending.output, Category.SHARDED_GRAD, name
    for handle, grad in runtime.reduce_bucket.waiting() if runtime is not None else ():  # waiting to be reduced
        yield grad, Category.UNSHARDED_GRAD, owner.get(handle.flat_param, "")
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value, Category.OPTIMIZER_STATE, owner.get(param, "")


def _handle_roles(handle: FlatParamHandle, name: str) -> Iterator[Role]:
    yield handle.flat_param, Category.SHARDED_PARAM, name
    for buffer in getattr(handle, "_unsharded_buffers", {handle.compute_dtype: handle.full_padded}).values():
        if handle.uses_buffer:  # otherwise (NO_SHARD, full precision) it is the local shard itself
            yield buffer, Category.UNSHARDED_PARAM, name
    yield handle.local_shard, Category.SHARDED_PARAM, name
    for param in handle.orig_params.values():  # use_orig_params=True: the sharded gradient may live here
        if param.grad is not None:
            yield param.grad, Category.SHARDED_GRAD, name
    grad = handle.flat_param.grad
    unsharded = handle.uses_buffer and handle.is_unsharded  # then .grad is this backward's unsharded gradient
    for tensor, category in (
        (grad, Category.UNSHARDED_GRAD if unsharded else Category.SHARDED_GRAD),
        (handle.saved_grad, Category.SHARDED_GRAD),
        (handle.new_grad, Category.SHARDED_GRAD),
        (handle.unsynced_grad, Category.UNSHARDED_GRAD),
    ):
        if tensor is not None:
            yield tensor, category, name
