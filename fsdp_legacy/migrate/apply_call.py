"""FSDP1's `apply` onto `apply_full` (runtime.py): `model.apply(fn)` on a name the file wraps, and
`FSDP.apply(model, fn)`. FSDP1's apply gathers the full parameters around `fn` and writes its in-place changes back;
nn.Module.apply on an FSDP2 model would run `fn` on the DTensor shards (other random draws, `.data` edits lost), so
leaving the call as it is would change the program without a word. Forms whose arguments cannot be read are left
and reported; `apply` on modules the file does not wrap is nn.Module's own and stays untouched."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

HELPER = "apply_full"
API = "FullyShardedDataParallel.apply"  # names.py's advice for the forms left in place

# What is reported (the why and fix come from names.advice(API)), or the call that replaces FSDP1's.
Mapped = cst.Call | str


def _star(args: Sequence[cst.Arg]) -> bool:
    return any(arg.star for arg in args)


def unbound(updated: cst.Call) -> Mapped:
    """`FSDP.apply(model, fn)`: FSDP1's apply named explicitly, so its first argument is an FSDP1 model."""
    args = updated.args
    if not args or args[0].keyword is not None or _star(args):
        return "`FSDP.apply(...)` with its arguments not written out (`*args`, `**kwargs`, `self=`)"
    return updated.with_changes(func=cst.Name(HELPER))


def bound(updated: cst.Call, model: cst.BaseExpression, written: str) -> Mapped:
    """`model.apply(fn)` on a name the file wraps with FSDP1."""
    if _star(updated.args):
        return f"`{written}.apply(*args/**kwargs)` on the FSDP1 model"
    return updated.with_changes(func=cst.Name(HELPER), args=[cst.Arg(model), *updated.args])


def on_wrapped_module(written: str) -> str:
    """`model.module.apply(fn)`: nn.Module.apply on the module FSDP1 wraps, where only the nested units gather."""
    return f"`{written}.apply(...)` on the module FSDP1 wraps (where FSDP1 gathered the nested units only)"


def as_value(written: str) -> str:
    """`model.apply` not called where it is written (handed on, stored): what it will be called with is unknown."""
    return f"`{written}.apply` used as a value on the FSDP1 model"
