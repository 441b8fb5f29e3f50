"""nn.Module._apply on FSDP units: `.half()`, `.to(dtype or device)`, `.cuda()` ... convert the flat parameters, which
own the storage, as in torch's FSDP1.

With use_orig_params=True the original parameters are what nn.Module sees, and converting them would only give each
a detached copy (the next forward would copy it back into the unconverted flat parameter). So, as torch does, the
flat parameters stand in for them during the conversion, and the original parameters become views of the converted
shards afterwards. Either way the handle then adopts its flat parameter's new data (dtype, device) at once, not only
at the first forward; inside summon_full_params a sharded unit's converted data is the summoned unsharded copy, which
the summon keeps showing and writes back, its shard left as it was (summon.adopt_summoned_conversion).
"""

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .handle import FlatParamHandle
from .orig_param_grads import assign_grad
from .summon import adopt_summoned_conversion
from .unit import FSDPUnit, fsdp_modules

# Units whose flat parameters stand in for their original parameters now (nested units' _apply runs inside).
_CONVERTING: set[int] = set()


@contextlib.contextmanager
def converting(root: FSDPUnit, fn: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    units = [unit for unit in fsdp_modules(root) if id(unit) not in _CONVERTING]
    for unit in units:
        for handle in unit._handles:
            if handle.holds_gathered_copy:
                handle.reshard()  # (a forward's unsharded copy would go stale; backward re-gathers if it needs it)
    swapped = [unit for unit in units if unit._use_orig_params and unit._handles]
    restores = [_show_flat_params(unit) for unit in swapped]
    _CONVERTING.update(id(unit) for unit in units)
    try:
        yield
    finally:
        _CONVERTING.difference_update(id(unit) for unit in units)
        for restore in restores:
            restore()
        for unit in units:
            for handle in unit._handles:
                if not adopt_summoned_conversion(handle):
                    handle.adopt_replaced_flat_param()
        for unit in swapped:
            for handle in unit._handles:
                _convert_orig_grads(handle, fn)


def _show_flat_params(unit: FSDPUnit) -> Callable[[], None]:
    """Hide the unit's original parameters and register its flat parameters in their place; returns the undo, which
    keeps every module's parameter order (parameters FSDP does not manage are taken as the conversion left them)."""
    orders: dict[int, tuple[nn.Module, list[str]]] = {}
    hidden: dict[tuple[int, str], nn.Parameter | None] = {}
    attributes = [(module, name) for handle in unit._handles for module, name, _ in handle._attributes()]
    for module, _name in attributes:
        orders.setdefault(id(module), (module, list(module._parameters)))
    for module, name in attributes:
        if name in module._parameters:
            hidden[(id(module), name)] = module._parameters.pop(name)
    holder = unit.module
    for handle in unit._handles:
        holder._parameters[handle.flat_name] = handle.flat_param

    def restore() -> None:
        for handle in unit._handles:
            holder._parameters.pop(handle.flat_name, None)
        for key, (module, order) in orders.items():
            current = dict(module._parameters)
            module._parameters.clear()
            for name in order:
                if (key, name) in hidden:
                    module._parameters[name] = hidden[(key, name)]
                elif name in current:
                    module._parameters[name] = current[name]

    return restore


def _convert_orig_grads(handle: FlatParamHandle, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """The original parameters' sharded gradients get the conversion too (nn.Module._apply converts gradients);
    the handle takes converted ones in as the user's gradients."""
    for param in handle.orig_params.values():
        grad = param.grad
        if grad is None:
            continue
        with torch.no_grad():
            converted = fn(grad)
        if converted is not grad:
            assign_grad(param, converted)
