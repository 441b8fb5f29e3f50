"""A name that holds the wrapped model on some runs only. open_lm wraps with `model = FSDP(model, ...)` under
`if args.fsdp:` and `model = DDP(model)` under its `else:`; llama-recipes keeps the plain module beside its FSDP
branch. After the branches, FSDP1's `model.state_dict()` is its state-dict type's dict (FULL by default) on one run
and the DDP wrapper's (keys under `module.`) or the plain module's on the other, and `model.module` is the module
inside either wrapper. The migration keeps both: FSDP2's form where the model is an FSDPModule at run time, the call
as written elsewhere. A read ahead of the statement that wraps the name (open_lm's `load_model(args, model)` before
`model = FSDP(model)`) is the plain module's: not the wrapped model at all."""

from __future__ import annotations

from collections.abc import Collection

import libcst as cst
from libcst.metadata import Assignment

from .bindings import Bindings

FSDP_MODULE = "FSDPModule"  # what `isinstance(model, ...)` asks at run time (torch.distributed.fsdp's)


def _assignments(bindings: Bindings, read: cst.Name) -> list[tuple[Assignment, cst.SimpleStatementLine | None]]:
    scope = bindings.scopes.get(read)
    found = [a for a in (scope[read.value] if scope is not None else ()) if isinstance(a, Assignment)]
    return [(a, bindings.enclosing(a.node, cst.SimpleStatementLine)) for a in found]


def _runs_before(bindings: Bindings, statement: cst.SimpleStatementLine, read: cst.CSTNode) -> bool:
    """Whether `statement`, earlier in the text, runs whenever `read` does: it is one of the statements of a block
    holding `read` in the same function (early exits aside, which only skip `read`)."""
    block = bindings.parents.get(statement)
    current: cst.CSTNode | None = bindings.parents.get(read)
    while current is not None:
        if current is block:
            return True
        if isinstance(current, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return False
        current = bindings.parents.get(current)
    return False


def before_wrapping(bindings: Bindings, read: cst.Name, wrapping: Collection[cst.SimpleStatementLine]) -> bool:
    """Whether `read` comes before a statement of its scope that wraps the module the name holds, binding it or
    another name to the wrapped model (`model = FSDP(model)`, `model = build(model)`, mistral-finetune's
    `wrapped_model = FSDP(model, ...)`), where no earlier statement of the scope wrapped it: the module the program is
    about to wrap. A loop around both reads it again after the wrapping: not before it."""
    at = bindings.order(read)
    bound = [(bindings.order(a.node), statement) for a, statement in _assignments(bindings, read) if statement]
    bound += [(bindings.order(statement), statement) for statement in _wrapping_the_module(bindings, read, wrapping)]
    before = [statement for start, statement in bound if start < at]
    wraps_after = [statement for start, statement in bound if start > at and statement in wrapping]
    if not wraps_after or any(statement in wrapping for statement in before):
        return False  # (the plain module may be moved or loaded first: `model = model.to(dtype)` in between)
    return not any(bindings.in_loop_around(read, statement) for statement in wraps_after)


def _wrapping_the_module(
    bindings: Bindings, read: cst.Name, wrapping: Collection[cst.SimpleStatementLine]
) -> list[cst.SimpleStatementLine]:
    """The wrapping statements of `read`'s scope whose call is handed the name as its module (the first argument)."""
    found = []
    for statement in wrapping:
        line = statement.body[0]
        call = line.value if isinstance(line, cst.Assign) else None
        first = call.args[0].value if isinstance(call, cst.Call) and call.args else None
        if isinstance(first, cst.Name) and first.value == read.value:
            if bindings.scopes.get(first) is bindings.scopes.get(read):
                found.append(statement)
    return found


def surely_wrapped(bindings: Bindings, read: cst.Name, wrapping: Collection[cst.SimpleStatementLine]) -> bool:
    """Whether the name at `read` holds the wrapped model on every run reaching it: each other binding of its scope
    ahead of it either runs only after a wrapping (`model = torch.compile(model)` on the wrapped model) or is
    followed by a wrapping that runs whenever `read` does (the plain module the wrapping replaces). A name its scope
    never wraps (a global, a parameter, an attribute) is not this module's to doubt: True."""
    bound = _assignments(bindings, read)
    if not any(statement in wrapping for _, statement in bound):
        return True
    at = bindings.order(read)
    wraps = [
        (bindings.order(a.node), statement)
        for a, statement in bound
        if statement is not None and statement in wrapping and bindings.order(a.node) < at
    ]
    ahead = [start for start, statement in wraps if _runs_before(bindings, statement, read)]
    ahead += [bindings.order(branch) for branch in _branches_ahead(bindings, read, wrapping)]
    for a, statement in bound:
        start = bindings.order(a.node)
        if start >= at or statement in wrapping:
            continue
        after_a_wrapping = statement is not None and any(
            w < start and _runs_before(bindings, w_statement, statement) for w, w_statement in wraps
        )
        replaced = any(start < w for w in ahead)
        if not (after_a_wrapping or replaced):
            return False  # (open_lm's `model = DDP(model)` beside the FSDP branch; the plain module it may keep)
    return True


def _always_wraps(node: cst.CSTNode, wrapping: Collection[cst.SimpleStatementLine]) -> bool:
    """An `if` whose every branch (an `else` too) wraps the model at its own level, or in such an `if`."""
    if not isinstance(node, cst.If) or node.orelse is None:
        return False
    branches: list[cst.BaseSuite] = [node.body]
    rest: cst.If | cst.Else = node.orelse
    if isinstance(rest, cst.If):
        return _holds_a_wrapping(node.body, wrapping) and _always_wraps(rest, wrapping)
    branches.append(rest.body)
    return all(_holds_a_wrapping(branch, wrapping) for branch in branches)


def _holds_a_wrapping(suite: cst.BaseSuite, wrapping: Collection[cst.SimpleStatementLine]) -> bool:
    body = suite.body if isinstance(suite, cst.IndentedBlock) else ()
    return any(s in wrapping or _always_wraps(s, wrapping) for s in body)


def _branches_ahead(bindings: Bindings, read: cst.Name, wrapping: Collection[cst.SimpleStatementLine]) -> list[cst.If]:
    """The `if` statements ahead of `read`, in the blocks holding it, that wrap the model on every branch."""
    found: list[cst.If] = []
    child: cst.CSTNode = read
    current = bindings.parents.get(read)
    while current is not None and not isinstance(current, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
        if isinstance(current, (cst.IndentedBlock, cst.Module)):
            body: list[cst.CSTNode] = list(current.body)
            before = body[: body.index(child)] if child in body else []
            found += [s for s in before if isinstance(s, cst.If) and _always_wraps(s, wrapping)]
        child, current = current, bindings.parents.get(current)
    return found


def guarded(model: str, fsdp2: str, as_written: str) -> str:
    """FSDP2's form where `model` is an FSDPModule at run time, the code as written elsewhere."""
    return f"({fsdp2} if isinstance({model}, {FSDP_MODULE}) else {as_written})"
