"""A name followed to the one statement that binds it, as Python resolves it: in the function that uses it, else
in the module (LibCST's scopes). Only `name = value` bound once counts; any other binding (a parameter, a loop, a
second assignment, `global` in another function) leaves the name unresolved."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import Assignment, MetadataWrapper, ParentNodeProvider, Scope, ScopeProvider


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

    def count_in_scope(self, name: str, node: cst.CSTNode) -> int:
        """How often `name` occurs in the function (or module) holding `node`, functions inside it included."""
        scope: cst.CSTNode | None = node
        while scope is not None and not isinstance(scope, (cst.FunctionDef, cst.Module)):
            scope = self.parents.get(scope)
        found = Counter[str]()

        class _Count(cst.CSTVisitor):
            def visit_Name(self, n: cst.Name) -> None:
                found[n.value] += 1

        (scope or node).visit(_Count())
        return found[name]
