"""A model whose state-dict type is set in the function that builds and returns it (`def build(): model = FSDP(...);
FSDP.set_state_dict_type(model, ...); return model`), with the state-dict calls in its callers (`model = build();
model.state_dict()`): the type travels with the returned model, so state_dict_type.py follows it to each call site.

Followed only where the text shows every path: a module-level function without decorators, whose one `return` is
`return model` at the end of its body, after the setter; called only as `name = build(...)` statements of this file
(any other use of the function, or no call here at all, and its callers' calls may be anywhere)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import libcst as cst


@dataclass(frozen=True)
class Sites:
    """The statements `target = build(...)` that receive the model, and the function's name."""

    function: str
    statements: tuple[cst.SimpleStatementLine, ...]

    def target(self, statement: cst.SimpleStatementLine) -> str:
        assign = statement.body[0]
        assert isinstance(assign, cst.Assign) and isinstance(assign.targets[0].target, cst.Name)
        return assign.targets[0].target.value


class _Returns(cst.CSTVisitor):
    """The returns and yields of one function, not those of the functions, classes and lambdas inside it."""

    def __init__(self, root: cst.FunctionDef) -> None:
        super().__init__()
        self.root = root
        self.returns: list[cst.Return] = []
        self.yields = False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return node is self.root

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_Return(self, node: cst.Return) -> None:
        self.returns.append(node)

    def visit_Yield(self, node: cst.Yield) -> None:
        self.yields = True


class _Mentions(cst.CSTVisitor):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.found: list[cst.Name] = []

    def visit_Name(self, node: cst.Name) -> None:
        if node.value == self.name:
            self.found.append(node)


def returned(
    statement: cst.SimpleStatementLine, model: str, parents: Mapping[cst.CSTNode, cst.CSTNode], module: cst.Module
) -> Sites | str | None:
    """The call sites the model set by `statement` is returned to; None where the function holding the setter does
    not return it (nothing to follow); a reason where it does and the text does not show where it goes."""
    owner = parents.get(statement)
    function = parents.get(owner) if isinstance(owner, cst.IndentedBlock) else None
    if not isinstance(function, cst.FunctionDef):
        return None
    returns = _Returns(function)
    function.visit(returns)
    values = [r.value for r in returns.returns]
    if not any(isinstance(v, cst.Name) and v.value == model for v in values):
        return None
    name = function.name.value
    body = list(function.body.body) if isinstance(function.body, cst.IndentedBlock) else []
    last = body[-1] if body else None
    if parents.get(function) is not module or function.decorators or returns.yields:
        return f"`{name}` returns `{model}` but is not a plain module-level function"
    if len(values) != 1 or not (isinstance(last, cst.SimpleStatementLine) and last.body[0] is returns.returns[0]):
        return f"`{name}` returns in more than one place, or not at the end of its body"
    mentions = _Mentions(name)
    module.visit(mentions)
    sites = []
    for found in mentions.found:
        if found is function.name:
            continue
        call = parents.get(found)
        assign = parents.get(call) if isinstance(call, cst.Call) and call.func is found else None
        line = parents.get(assign) if isinstance(assign, cst.Assign) else None
        if not (
            isinstance(assign, cst.Assign)
            and len(assign.targets) == 1
            and isinstance(assign.targets[0].target, cst.Name)
            and isinstance(line, cst.SimpleStatementLine)
            and len(line.body) == 1
            and isinstance(parents.get(line), (cst.IndentedBlock, cst.Module))
        ):
            return f"`{name}`, which returns `{model}`, is used other than as `name = {name}(...)`"
        sites.append(line)
    if not sites:
        return f"`{name}` returns `{model}` and is not called in this file: its callers' state-dict calls are elsewhere"
    return Sites(name, tuple(sites))
