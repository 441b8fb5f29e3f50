"""A name followed to the one statement that binds it, as Python resolves it: in the function that uses it, else
in the module (LibCST's scopes). Only `name = value` bound once counts; any other binding (a parameter, a loop, a
second assignment, `global` in another function) leaves the name unresolved."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import libcst as cst
from libcst.metadata import (
    Assignment,
    CodeRange,
    MetadataWrapper,
    ParentNodeProvider,
    PositionProvider,
    Scope,
    ScopeProvider,
)

N = TypeVar("N", bound=cst.CSTNode)


@dataclass(frozen=True)
class Binding:
    """`name = value`, the statement holding it alone, and every place the name is read with this value."""

    statement: cst.SimpleStatementLine
    value: cst.BaseExpression
    uses: tuple[cst.CSTNode, ...]


class Bindings:
    def __init__(self, wrapper: MetadataWrapper) -> None:
        self.scopes: Mapping[cst.CSTNode, Scope | None] = wrapper.resolve(ScopeProvider)
        self.parents: Mapping[cst.CSTNode, cst.CSTNode] = wrapper.resolve(ParentNodeProvider)
        self.positions: Mapping[cst.CSTNode, CodeRange] = wrapper.resolve(PositionProvider)

    def single(self, name: cst.Name) -> Binding | None:
        scope = self.scopes.get(name)
        found = scope[name.value] if scope is not None else set()
        if len(found) != 1:
            return None
        (assignment,) = found
        if not isinstance(assignment, Assignment):
            return None
        target = self.parents.get(assignment.node)
        assign = self.parents.get(target) if isinstance(target, cst.AssignTarget) else None
        statement = self.parents.get(assign) if isinstance(assign, cst.Assign) else None
        if not (
            isinstance(assign, cst.Assign) and len(assign.targets) == 1 and assign.targets[0].target is assignment.node
        ):
            return None
        if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1):
            return None
        return Binding(statement, assign.value, tuple(access.node for access in assignment.references))

    def reaching(self, name: cst.Name) -> Binding | None:
        """For a name assigned more than once in its scope (DPO's `save_policy = FullStateDictConfig(...)`, a block,
        then `save_policy = FullOptimStateDictConfig(...)` and another): the `name = value` that the read at `name`
        sees, where the text shows it plainly: a statement of its own earlier in the same block as the statement
        holding the read, with no other binding of the name between them and none in a loop around the read. Its uses
        are the reads after it, before the name's next binding."""
        scope = self.scopes.get(name)
        every = scope[name.value] if scope is not None else set()
        found = [a for a in every if isinstance(a, Assignment)]
        if len(found) < 2 or len(found) != len(every):
            return None
        positions = {id(a.node): self.order(a.node) for a in found}
        at = self.order(name)
        earlier = [a for a in found if positions[id(a.node)] < at]
        if not earlier or any(self.in_loop_around(name, a.node) for a in found if positions[id(a.node)] > at):
            return None
        nearest = max(earlier, key=lambda a: positions[id(a.node)])
        target = self.parents.get(nearest.node)
        assign = self.parents.get(target) if isinstance(target, cst.AssignTarget) else None
        statement = self.parents.get(assign) if isinstance(assign, cst.Assign) else None
        if not (
            isinstance(assign, cst.Assign)
            and len(assign.targets) == 1
            and assign.targets[0].target is nearest.node
            and isinstance(statement, cst.SimpleStatementLine)
            and len(statement.body) == 1
        ):
            return None
        block = self.parents.get(statement)
        holder: cst.CSTNode | None = name
        while holder is not None and self.parents.get(holder) is not block:
            holder = self.parents.get(holder)
        if holder is None:
            return None  # the read is not in the assignment's block (a branch, another function)
        later = [positions[id(a.node)] for a in found if positions[id(a.node)] > positions[id(nearest.node)]]
        end = min(later, default=(1 << 62, 0))
        uses = tuple(
            access.node for access in nearest.references if positions[id(nearest.node)] < self.order(access.node) < end
        )
        return Binding(statement, assign.value, uses)

    def order(self, node: cst.CSTNode) -> tuple[int, int]:
        """Where `node` starts in the text, (line, column): earlier reads sort first."""
        start = self.positions[node].start
        return start.line, start.column

    def enclosing(self, node: cst.CSTNode, kind: type[N]) -> N | None:
        """The nearest node of `kind` holding `node` (itself included)."""
        current: cst.CSTNode | None = node
        while current is not None and not isinstance(current, kind):
            current = self.parents.get(current)
        return current

    def in_loop_around(self, node: cst.CSTNode, other: cst.CSTNode) -> bool:
        """Whether a loop of the function (or module) holding `node` holds `other` too: run again, `node` comes
        after `other` as well."""
        loop: cst.CSTNode | None = self.parents.get(node)
        while loop is not None and not isinstance(loop, (cst.FunctionDef, cst.Module)):
            if isinstance(loop, (cst.For, cst.While)) and self._holds(loop, other):
                return True
            loop = self.parents.get(loop)
        return False

    def _holds(self, outer: cst.CSTNode, node: cst.CSTNode) -> bool:
        current: cst.CSTNode | None = node
        while current is not None and current is not outer:
            current = self.parents.get(current)
        return current is outer

    def count_in_scope(self, name: str, node: cst.CSTNode) -> int:
        """How often the variable `name` occurs in the function (or module) holding `node`, functions inside it
        included."""
        scope: cst.CSTNode | None = node
        while scope is not None and not isinstance(scope, (cst.FunctionDef, cst.Module)):
            scope = self.parents.get(scope)
        found = Counter[str]()

        class _Count(cst.CSTVisitor):  # variables only: not `x.name`'s attribute, nor `f(name=...)`'s keyword
            def visit_Name(self, n: cst.Name) -> None:
                found[n.value] += 1

            def visit_Attribute(self, n: cst.Attribute) -> bool:
                n.value.visit(self)
                return False

            def visit_Arg(self, n: cst.Arg) -> bool:
                n.value.visit(self)
                return False

        (scope or node).visit(_Count())
        return found[name]
