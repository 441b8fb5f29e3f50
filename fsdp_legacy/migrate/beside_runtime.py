"""FSDP1's state-dict calls on another object inside a `state_dict_type` block on one model (imported by migrated
programs through runtime.py). Infinity saves its EMA model with `self.gpt_ema.state_dict()` inside the block on its
main model `self.gpt`: FSDP1 sets the type on the block's model and the FSDP units inside it, so another model's call
gives what it gives outside the block (FSDP1's default, the full dict on every rank), unless that model is inside
the block's. Which it is the source cannot show; these helpers decide where the objects are known."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule

__all__ = ["load_state_dict_beside", "state_dict_beside"]

# objects whose state dicts no FSDP1 type touches
_OWN_STATE = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)


def _options(obj: Any, block_model: nn.Module, options: StateDictOptions) -> StateDictOptions | None:
    """The options FSDP1's type gives `obj`'s state-dict call inside a block on `block_model`; None where it is the
    object's own call (a plain module, an optimizer, a scheduler, a gradient scaler, an object that holds no module
    among its attributes)."""
    if isinstance(obj, _OWN_STATE):
        return None
    what = type(obj).__name__
    if not isinstance(obj, nn.Module) and not _holds_a_module(obj):
        return None  # (switti's run configuration: no model its state-dict method could reach)
    if not isinstance(obj, nn.Module):
        raise TypeError(
            f"{what}.state_dict() inside FSDP1's state_dict_type block on another model: it may call a model's "
            "state-dict methods itself, under the type the block set, which FSDP2 has no counterpart for; call "
            "get_/set_model_state_dict with StateDictOptions for the models it holds"
        )
    if any(module is obj for module in block_model.modules()):
        return options  # inside the block's model: FSDP1 gave its units the block's type
    if any(module is block_model for module in obj.modules()):
        raise NotImplementedError(
            f"{what} holds the model of the state_dict_type block around it: FSDP1 gave that model's units the "
            "block's type and the others their own; call get_/set_model_state_dict on each model"
        )
    if not any(isinstance(module, FSDPModule) for module in obj.modules()):
        return None
    return StateDictOptions(full_state_dict=True)  # FSDP1's default type: the full dict on every rank


def _holds_a_module(obj: Any, depth: int = 4) -> bool:
    """Whether a module is among `obj`'s attributes, or in the containers among them, `depth` levels down."""
    seen: set[int] = set()

    def holds(value: Any, depth: int) -> bool:
        if isinstance(value, nn.Module):
            return True
        if depth == 0 or id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None))):
            return False
        seen.add(id(value))
        if isinstance(value, dict):
            items: list[Any] = list(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)
        else:
            items = list(getattr(value, "__dict__", {}).values())
            items += [getattr(value, slot, None) for slot in getattr(type(value), "__slots__", ())]
        return any(holds(item, depth - 1) for item in items)

    return holds(obj, depth)


def state_dict_beside(obj: Any, block_model: nn.Module, options: StateDictOptions) -> dict[str, Any]:
    """FSDP1's `obj.state_dict()` inside `with FSDP.state_dict_type(block_model, ...)`, the block's type being
    `options` (StateDictOptions)."""
    chosen = _options(obj, block_model, options)
    return obj.state_dict() if chosen is None else get_model_state_dict(obj, options=chosen)


def load_state_dict_beside(
    obj: Any, state_dict: dict[str, Any], block_model: nn.Module, options: StateDictOptions, strict: bool | None = None
) -> Any:
    """FSDP1's `obj.load_state_dict(state_dict[, strict=strict])` inside such a block (None: `strict` not given)."""
    chosen = _options(obj, block_model, options)
    if chosen is None:
        return obj.load_state_dict(state_dict) if strict is None else obj.load_state_dict(state_dict, strict=strict)
    if strict is not None:
        chosen = dataclasses.replace(chosen, strict=strict)
    return set_model_state_dict(obj, state_dict, options=chosen)
