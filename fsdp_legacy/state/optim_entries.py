"""What each parameter an optimizer of an FSDP model holds stands for: the original parameters (FQNs, layout
infos) of a flat parameter (use_orig_params=False), or one original parameter's piece (True), or a parameter outside
every unit. Saving (optim_state.py) and loading (optim_state_loading.py) optimizer state dicts both key by it.
"""

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..flat_param import ParamInfo
from ..handle import FlatParamHandle
from ..unit import FSDPUnit
from .state_dict import clean_key


class ParamGroups(Protocol):
    """An optimizer, as far as loading needs one: its parameter groups (`ParamOrder` stands in for the older API)."""

    param_groups: list[dict[str, Any]]


@dataclass(frozen=True)
class ParamOrder:
    """What the older API needs of an optimizer it is not given: the parameters in the order the optimizer was (or
    will be) built with, which numbers them, from `optim_input` (parameters, or param-group dicts) or the model."""

    param_groups: list[dict[str, Any]]

    @classmethod
    def of(cls, model: nn.Module, optim_input: Any) -> "ParamOrder":
        if optim_input is None:
            return cls([{"params": list(model.parameters())}])
        try:
            items = list(optim_input)
        except TypeError as error:  # torch's errors, word for word
            raise TypeError(
                f"Optimizer input should be an iterable of Tensors or dicts, but got {optim_input}"
            ) from error
        if not items:
            raise ValueError("Optimizer input should not be empty")
        if all(isinstance(item, dict) for item in items):
            return cls([{"params": list(group["params"])} for group in items])
        if not all(isinstance(item, torch.Tensor) for item in items):
            raise TypeError("Optimizer input should be an iterable of Tensors or dicts")
        return cls([{"params": items}])


@dataclass(frozen=True)
class Entry:
    """One parameter the optimizer steps on and the original parameters (FQN, layout info) it stands for."""

    fqns: tuple[str, ...]
    infos: tuple[ParamInfo, ...]  # empty for a parameter outside every FSDP unit
    unit: FSDPUnit | None = None
    handle: FlatParamHandle | None = None  # the unit's flat parameter that holds them


def entries_by_param(model: nn.Module) -> dict[nn.Parameter, Entry]:
    """Every parameter an optimizer of `model` can hold (flat or original) -> the original FQNs it stands for."""
    by_param: dict[nn.Parameter, Entry] = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPUnit):
            continue
        prefix = clean_key(f"{name}." if name else "")
        for handle in module._handles:
            if handle.use_orig_params:
                for info, param in handle.orig_params.items():
                    by_param[param] = Entry((prefix + info.fqn,), (info,), module, handle)
            else:
                infos = handle.layout.params
                by_param[handle.flat_param] = Entry(tuple(prefix + i.fqn for i in infos), infos, module, handle)
    for name, param in model.named_parameters():  # ignored parameters, or ones outside every unit
        by_param.setdefault(param, Entry((clean_key(name),), ()))
    return by_param


def param_entries(model: nn.Module, optim: ParamGroups) -> list[tuple[int, Entry]]:
    """(optimizer group index, entry) of every optimizer parameter, in `optim.state_dict()` id order."""
    by_param = entries_by_param(model)
    result = []
    for index, group in enumerate(optim.param_groups):
        for param in group["params"]:
            if param not in by_param:
                raise ValueError(
                    f"The optimizer holds a parameter of shape {tuple(param.shape)} that is not in the model: build "
                    "the optimizer from the FSDP-wrapped model's parameters (after wrapping)."
                )
            result.append((index, by_param[param]))
    return result


def is_scalar(value: Any) -> bool:
    """States that are copied, not sharded: non-tensors and 0-d tensors such as Adam's `step`."""
    return not isinstance(value, torch.Tensor) or value.dim() == 0


def copy_scalar(value: Any) -> Any:
    # A copy: optimizers update `step` in place, which would otherwise change a saved dict.
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
