"""What one FSDP unit will manage, found in a single walk over its modules.

The walk visits the unit's modules in pre-order (torch FSDP1's `named_modules(remove_duplicate=False)` order), not
entering nested units or ignored modules, and records every reference to a parameter the unit takes over: the order
the flat parameters lay them out in, their grouping by dtype (one flat parameter per dtype), each reference's place
among its module's parameters, and the tensors `sync_module_states` broadcasts. Every parameter the unit cannot
take is refused here, before anything is flattened.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .flat_param import ParamRef, iter_unit_modules
from .tensor_parallel import check_param


@dataclass(frozen=True)
class UnitPlan:
    # Every reference to a managed parameter, in nn.Module order; a tied parameter appears once per reference.
    references: tuple[ParamRef, ...]
    # The references grouped by dtype, groups in the order their first parameter appears: a flat parameter each.
    dtype_groups: tuple[tuple[ParamRef, ...], ...]
    # The unit's managed parameters and its buffers, in walk order: what sync_module_states broadcasts from rank 0.
    module_states: tuple[torch.Tensor, ...]

    @property
    def registration_order(self) -> dict[str, int]:
        """Clean FQN (relative to the unit's module) of each reference -> its rank in nn.Module order (a unit with
        several flat parameters shows its parameters again in this order)."""
        order: dict[str, int] = {}
        for ref in self.references:
            order.setdefault(ref.fqn, len(order))
        return order


def plan_unit(
    module: nn.Module,
    is_boundary: Callable[[nn.Module], bool],
    ignored_params: set[nn.Parameter],
    flattened: Mapping[nn.Parameter, str],
    device_mesh: DeviceMesh | None,
    hybrid: bool,
) -> UnitPlan:
    """Walk the unit's modules once. `flattened` maps the parameters other units already own to a description of
    their owner (a parameter can live in only one unit)."""
    references: list[ParamRef] = []
    states: list[torch.Tensor] = []
    by_dtype: dict[torch.dtype, list[ParamRef]] = {}
    for module_name, sub in iter_unit_modules(module, is_boundary):
        for param_name, param in sub._parameters.items():
            if param is None or param in ignored_params:
                continue
            ref = ParamRef(module_name, sub, param_name, param)
            _check_param(ref, flattened, device_mesh, hybrid)
            references.append(ref)
            by_dtype.setdefault(param.dtype, []).append(ref)
            states.append(param)
        states.extend(buffer for buffer in sub._buffers.values() if buffer is not None)
    return UnitPlan(tuple(references), tuple(map(tuple, by_dtype.values())), tuple(states))


def _check_param(
    ref: ParamRef, flattened: Mapping[nn.Parameter, str], device_mesh: DeviceMesh | None, hybrid: bool
) -> None:
    param, owner = ref.param, type(ref.module).__name__
    if param in flattened:
        raise ValueError(
            f"Parameter '{ref.fqn}' of {owner} is tied to {flattened[param]}, which already flattened it. A "
            "parameter can live in only one FSDP unit, so the modules sharing it must be wrapped together: change the "
            "auto_wrap_policy so they belong to the same unit (e.g. do not wrap one of them separately), or pass the "
            "parameter in ignored_states."
        )
    if isinstance(param, DTensor):  # tensor parallelism: tensor_parallel.py
        problem = check_param(ref.fqn, owner, param, device_mesh, hybrid)
        if problem:
            raise ValueError(problem)
    elif is_traceable_wrapper_subclass(param.data):
        raise ValueError(
            f"Parameter '{ref.fqn}' of {owner} holds a {type(param.data).__name__}, a tensor subclass with its own "
            "inner tensors, which a flat parameter cannot hold: FSDP1 shards the plain bytes of each parameter. Store "
            "the plain data in the parameter (an nn.Parameter subclass carrying its extra state as attributes is "
            "kept, as bitsandbytes' Params4bit does), or pass the parameter in ignored_states (it then stays whole "
            "on every rank)."
        )
    if param.dim() == 0:
        raise ValueError(
            f"FSDP doesn't support scalar parameters. Change {ref.fqn} to a 1D tensor with numel equal to 1."
        )
