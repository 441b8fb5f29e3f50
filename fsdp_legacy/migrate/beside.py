"""A state-dict call on another object inside a `state_dict_type` block taken away (Infinity's
`self.gpt_ema.state_dict()` in the block on `self.gpt`): `state_dict_beside(obj, block_model, options)` /
`load_state_dict_beside(...)` (beside_runtime.py) give what FSDP1 gave there, decided at run time: the block's
type where the object is inside the block's model, FSDP1's default for another FSDP model, the object's own call
for a plain module, an optimizer, a scheduler or a scaler. Where the text shows the object holds the block's model
(`self`, for `self.model`) the call still keeps the block: it may read the type for that model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst

from . import optim_state
from .construction import RUNTIME
from .names import attribute_chain
from .type_blocks import related, torch_optimizer

if TYPE_CHECKING:
    from .transformer import Fsdp1ToFsdp2

SAVE, LOAD = "state_dict_beside", "load_state_dict_beside"


def rewrite(t: Fsdp1ToFsdp2, original: cst.Call, updated: cst.Call, args: list[str]) -> cst.BaseExpression | None:
    """`obj.state_dict()` / `obj.load_state_dict(sd[, strict=...])` inside one block taken away, on an object the
    file does not know wrapped; None where the call is left to the block's other rules."""
    func, new_func = original.func, updated.func
    assert isinstance(func, cst.Attribute) and isinstance(new_func, cst.Attribute)
    if len(t.blocks) != 1 or t.blocks[0][1] is None:
        return None  # (nested blocks: the object may be inside either model)
    model, options = t.blocks[0][0], t.blocks[0][1].model_options
    receiver = attribute_chain(func.value)
    if t.blocks[0][1].reads_nothing or receiver is None or related(receiver, model):  # (SHARDED's options read
        # `StateDictOptions()` too: awsome-distributed-training's `scheduler.state_dict()` in its SHARDED block)
        return None
    if torch_optimizer(t, t.resume.bindings, func.value):
        return None  # its own call, which reads no type
    obj = t.code(new_func.value)
    if func.attr.value == "state_dict" and not original.args:
        t.need(RUNTIME, SAVE)
        return t.expr(f"{SAVE}({obj}, {model}, {options})")
    keywords = [a.keyword.value for a in original.args if a.keyword]
    loads = len(original.args) - len(keywords) == 1 and not original.args[0].keyword and set(keywords) <= {"strict"}
    if func.attr.value != "load_state_dict" or not loads or any(a.star for a in original.args):
        return None
    loaded = original.args[0].value
    if isinstance(loaded, cst.Name) and _converted(t, loaded.value):
        # an optimizer loading FSDP1's converted dict: optim_loads.py pairs the two, or its own dict after
        # loaded_optim_state_dict loaded at once; no state-dict type reaches an optimizer's own load
        t.consumed.add(original)
        return None
    strict = [f", strict={t.code(a.value)}" for a in updated.args if a.keyword and a.keyword.value == "strict"]
    t.need(RUNTIME, LOAD)
    return t.expr(f"{LOAD}({obj}, {args[0]}, {model}, {options}{''.join(strict)})")


def _converted(t: Fsdp1ToFsdp2, name: str) -> bool:
    """Whether the file binds `name` to one of FSDP1's optimizer-state to-load calls."""
    values = [value for _, value in t.survey.assigned.get(name, [])]
    return any(isinstance(v, cst.Call) and optim_state.api_of(t.fsdp1(v.func)) in optim_state.LOADS for v in values)
