"""The optimizer-state loads of FSDP1 (`optim.load_state_dict(FSDP.optim_state_dict_to_load(...))`, the legacy
to-load calls, and `osd = FSDP.<to-load API>(...)` paired with a later `optim.load_state_dict(osd)` in its block)
as set_optimizer_state_dict, and the optimizer-state saves and re-keyings in expressions (optim_state.py holds the
calls' own mapping; these functions place it in the file, for the transformer)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import libcst as cst
from libcst.metadata import ParentNodeProvider

from . import optim_state
from .construction import RUNTIME
from .reorder import bound_names, names_in

if TYPE_CHECKING:
    from .transformer import Fsdp1ToFsdp2

LOADED = "loaded_optim_state_dict"  # runtime's optim_state_dict_to_load that loads at once
FULL = "StateDictOptions(full_state_dict=True)"  # FSDP1's default state-dict type: FULL, on every rank


@dataclass(frozen=True)
class PendingLoad:
    """`name = FSDP.<to-load API>(...)`, waiting in its block for the `optim.load_state_dict(name)` it feeds."""

    name: str
    call: cst.Call
    loading: optim_state.Load
    options: str
    names: set[str]  # the names its arguments use


def _is_model(t: Fsdp1ToFsdp2, call: cst.Call) -> Callable[[str], bool]:
    return lambda code: t.known_model(code, call)


def _loaded_later(t: Fsdp1ToFsdp2, statement: cst.SimpleStatementLine, name: str, optim: str | None) -> str | None:
    """The optimizer whose `.load_state_dict(name)` the function (or module) holding `statement` calls after it:
    `optim`, or where the call names none (StableCascade's `scatter_full_optim_state_dict(osd, model)`) the one
    object so loaded; None where there is no such load."""
    scope = t.resume.bindings.enclosing(statement, cst.FunctionDef) or t.module
    after = t.resume.bindings.positions[statement].end.line
    found: set[str] = set()

    class _Loads(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if _loads(t, node, name) and t.resume.bindings.positions[node].start.line > after:
                found.add(t.code(cast(cst.Attribute, node.func).value))

    scope.visit(_Loads())
    if optim is not None:
        return optim if optim in found else None
    return next(iter(found)) if len(found) == 1 else None


def _loaded_in_an_enclosing_block(t: Fsdp1ToFsdp2, statement: cst.SimpleStatementLine, name: str) -> bool:
    """Whether `X.load_state_dict(name)` is a later statement of a block enclosing `statement`'s own, in the same
    function: awsome-distributed-training converts under `with warnings.catch_warnings():` and loads after it. That
    load runs whenever the conversion did (FSDP1 loaded there what it converted)."""
    parents, function = t.resume.bindings.parents, t.resume.bindings.enclosing(statement, cst.FunctionDef)
    node: cst.CSTNode | None = parents.get(statement)  # (its own block)
    held: cst.CSTNode = statement
    while node is not None and node is not function:
        if isinstance(node, cst.IndentedBlock) and held is not statement:
            body = list(node.body)
            for later in body[body.index(cast(cst.BaseStatement, held)) + 1 :]:
                small = later.body[0] if isinstance(later, cst.SimpleStatementLine) else None
                call = small.value if isinstance(small, cst.Expr) else None
                if isinstance(call, cst.Call) and _loads(t, call, name):
                    return True
        if isinstance(node, cst.BaseStatement):
            held = node
        node = parents.get(node)
    return False


def _loads(t: Fsdp1ToFsdp2, call: cst.Call, name: str) -> bool:
    """Whether `call` is `X.load_state_dict(name)`."""
    func, args = call.func, call.args
    loading = isinstance(func, cst.Attribute) and func.attr.value == "load_state_dict" and len(args) == 1
    return loading and t.code(args[0].value) == name


def load_def(
    t: Fsdp1ToFsdp2, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine, name: str, call: cst.Call
) -> cst.SimpleStatementLine | None:
    """Note `name = FSDP.<to-load API>(...)`; the block pairs it with its load_state_dict (pair_loads). Where
    `name` is used beyond that load, the call names its optimizer and a later `optim.load_state_dict(name)` takes
    it (open_lm converts under a flag, then loads either form), it loads at once instead (LOADED)."""
    api = cast(str, optim_state.api_of(t.fsdp1(call.func)))
    loading = optim_state.load(api, call, t.code, _is_model(t, call))
    if isinstance(loading, optim_state.Refusal):
        t.report(call, loading.what, loading.why, loading.fix)
        return None
    options = optim_state.load_options(api) or t._options(loading.model, call, optim=True)
    if options is None:
        return None  # the model's state-dict type is left to a person (reported)
    options = t.resume.options(call, options)
    uses = t.resume.bindings.count_in_scope(name, original)
    later = uses > 2 or (uses == 2 and _loaded_in_an_enclosing_block(t, original, name))
    optim = _loaded_later(t, original, name, loading.optim) if later else None
    if optim is not None and not t.resume.check(call, options):
        t.resume.loaded(call, loading.model, optim, options)
        t.consumed.add(call)
        t.need(RUNTIME, LOADED)
        t._need_helpers()
        code = f"{LOADED}({loading.model}, {optim}, {loading.osd}, options={options})"
        assign = cast(cst.Assign, updated.body[0])
        return updated.with_changes(body=[assign.with_changes(value=t.expr(code))])
    if uses != 2:  # the assignment and the load
        why = (
            f"`{name}` is never used: FSDP1 converted the dict there and loaded nothing (the optimizer kept its state)"
            if uses < 2
            else f"`{name}` is used elsewhere too, where only `optimizer.load_state_dict({name})` has an FSDP2 form"
        )
        t.report(call, f"`{name} = FSDP.{api}(...)`", why, optim_state.Refusal("", "").fix)
        return None
    names = set().union(*(names_in(a.value) for a in call.args))
    t.load_defs[t._key(updated)] = PendingLoad(name, call, loading, options, names)
    return None


def pair_loads(t: Fsdp1ToFsdp2, body: list[cst.BaseStatement]) -> None:
    """`name = FSDP.<to-load API>(...)` and, later in the block, `optim.load_state_dict(name)` become one
    set_optimizer_state_dict where the load was (the names the call reads not rebound in between)."""
    for index, statement in enumerate(body):
        pending = t.load_defs.pop(id(statement), None)
        if pending is None:
            continue
        for later in range(index + 1, len(body)):
            use = t.load_uses.get(id(body[later]))
            if use is not None and use[1] == pending.name:
                if _pair(t, pending, use[0], body, index, later):
                    t.consumed.add(use[2])
                break
            if pending.names & bound_names(body[later]):
                break
        if pending.call not in t.consumed:
            why = f"`{pending.name}` is not loaded by `optimizer.load_state_dict({pending.name})` later in its block"
            what = f"`{pending.name} = FSDP.{pending.loading.api}(...)`"
            t.report(pending.call, what, why, optim_state.Refusal("", "").fix)


def _pair(
    t: Fsdp1ToFsdp2, pending: PendingLoad, optimizer: str, body: list[cst.BaseStatement], at: int, load: int
) -> bool:
    refused = t.resume.check(pending.call, pending.options)
    code = refused or optim_state.load_code(pending.loading, optimizer, pending.options)
    if isinstance(code, optim_state.Refusal):
        t.report(pending.call, code.what, code.why, code.fix)
        return False
    t.resume.loaded(pending.call, pending.loading.model, optimizer, pending.options)
    need_load(t, code)
    old = cast(cst.SimpleStatementLine, body[load])
    new = cast(cst.SimpleStatementLine, cst.parse_statement(code + "\n"))
    body[load] = new.with_changes(leading_lines=old.leading_lines, trailing_whitespace=old.trailing_whitespace)
    t.dropped[t._key(body[at])] = []
    t.consumed.add(pending.call)
    return True


def optim_call(t: Fsdp1ToFsdp2, api: str, call: cst.Call) -> cst.BaseExpression | None:
    """An optimizer-state call in an expression (optim_state.py): a save or a re-keying; the to-load calls are
    rewritten with the load_state_dict call that takes their result."""
    if api in optim_state.LOADS:
        direct = api == "optim_state_dict_to_load" and _loads_directly(t, call)
        return optim_load(t, call, direct, directly=True) if direct else None
    if api == optim_state.REKEY:
        code = optim_state.rekey(call, t.code, t.fsdp1)
        if not isinstance(code, optim_state.Refusal):
            t.need(RUNTIME, "rekey_optim_state_dict")
    else:
        model = next((t.code(a.value) for a in call.args if a.keyword and a.keyword.value == "model"), "")
        model = t.code(call.args[0].value) if call.args and not call.args[0].keyword else model  # (or by keyword)
        options = t._options(model, call, optim=True) if api == "optim_state_dict" else FULL
        if options is None:
            return None
        code = optim_state.save(api, call, t.code, options, lambda given, optim: _own_state(t, call, given, optim))
        if not isinstance(code, optim_state.Refusal):
            t._need_helpers("get_optimizer_state_dict")
    if isinstance(code, optim_state.Refusal):
        t.report(call, code.what, code.why, code.fix)
        return None
    return t.expr(code)


def _own_state(t: Fsdp1ToFsdp2, call: cst.Call, given: cst.BaseExpression, optim: str) -> bool:
    """Whether `given` is `optim.state_dict()`, written there or bound once to a name by an earlier statement of
    the call's block with nothing between naming the optimizer (it could step or load)."""
    own = f"{optim}.state_dict()"
    if t.code(given) == own:
        return True
    binding = t.resume.bindings.single(given) if isinstance(given, cst.Name) else None
    if binding is None or t.code(binding.value) != own or len(binding.uses) != 1:
        return False
    bindings = t.resume.bindings
    statement = bindings.enclosing(call, cst.SimpleStatementLine)
    block = bindings.parents.get(binding.statement)
    if statement is None or bindings.parents.get(statement) is not block or not isinstance(block, cst.IndentedBlock):
        return False
    body = list(block.body)
    between = body[body.index(binding.statement) + 1 : body.index(statement)]
    return all(not re.search(rf"\b{re.escape(optim)}\b", t.code(s)) for s in between)


def _loads_directly(t: Fsdp1ToFsdp2, call: cst.Call) -> str:
    """The optimizer of `FSDP.optim_state_dict_to_load(model, optim, osd, load_directly=True)` written as a
    statement (the distributed-training-guide's resume), which FSDP1 loads into it; "" for any other form."""
    statement = t.get_metadata(ParentNodeProvider, call, None)
    given = {a.keyword.value: a.value for a in call.args if a.keyword}
    if not isinstance(statement, cst.Expr) or t.code(given.get("load_directly", cst.Name("False"))) != "True":
        return ""
    loading = optim_state.load("optim_state_dict_to_load", call, t.code, _is_model(t, call), directly=True)
    return loading.optim or "" if isinstance(loading, optim_state.Load) else ""


def optim_load(t: Fsdp1ToFsdp2, call: cst.Call, optimizer: str, directly: bool = False) -> cst.BaseExpression | None:
    """`optimizer.load_state_dict(FSDP.<to-load API>(...))` as set_optimizer_state_dict, which loads (`directly`:
    the to-load call alone, `load_directly=True`, loading into its own `optim`)."""
    api = cast(str, optim_state.api_of(t.fsdp1(call.func)))
    loading = optim_state.load(api, call, t.code, _is_model(t, call), directly)
    code: str | optim_state.Refusal = loading if isinstance(loading, optim_state.Refusal) else ""
    if isinstance(loading, optim_state.Load):
        options = optim_state.load_options(api) or t._options(loading.model, call, optim=True)
        if options is None:
            return None  # the model's state-dict type is left to a person (reported)
        options = t.resume.options(call, options)
        code = t.resume.check(call, options) or optim_state.load_code(loading, optimizer, options)
    if isinstance(code, optim_state.Refusal):
        t.report(call, code.what, code.why, code.fix)
        return None
    t.resume.loaded(call, cast(optim_state.Load, loading).model, optimizer, cast(str, options))
    t.consumed.add(call)
    need_load(t, code)
    return t.expr(code)


def need_load(t: Fsdp1ToFsdp2, code: str) -> None:
    t._need_helpers("set_optimizer_state_dict")
    if "unshared_optim_state(" in code:
        t.need(RUNTIME, "unshared_optim_state")
