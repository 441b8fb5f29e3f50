"""Statements moved around a rewritten construction, in the block that holds it: FSDP2 wants some things before
`fully_shard` and some after, where FSDP1 took them in either order.

- An optimizer over `model.parameters()` built before the construction goes after it: fully_shard replaces the
  parameters with DTensors (FSDP1 with use_orig_params kept the same objects). Only a statement after the model's
  last binding that nothing in between depends on (or changes the inputs of) moves; a count (`sum(...)`, `len(...)`,
  `print(...)`) stays where it is, FSDP2's DTensors counting as many elements; any other is reported.
- Activation checkpointing applied to the wrapped model after the construction (`apply_activation_checkpointing`, or
  a function of the file that calls it) goes before it: FSDP2 composes with checkpoint wrappers put in first, and
  the units are then sharded inside their wrappers. It stays where it is when it uses a name bound in between, or when
  the construction materializes meta modules (a wrapper would change the modules FSDP1's initialization visits)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import libcst as cst

from .construction import NOTE
from .report import Finding


@dataclass(frozen=True)
class Placed:
    """The statements a construction became, as the block holding them sees them."""

    model: str  # the module sharded in place
    target: str  # the name FSDP(...) was assigned to
    count: int  # how many statements, from the first
    materializes: bool  # apply_fully_shard may initialize meta modules
    line: int = 0  # the construction's, in the file as it was read (for a finding)


def reorder(
    body: list[cst.BaseStatement],
    placed: dict[int, Placed],
    checkpointing: dict[int, str],
    code: Callable[[cst.CSTNode], str],
    report: Callable[[Finding], None] = lambda finding: None,
) -> list[cst.BaseStatement]:
    """`body` with the moves above made; `placed` and `checkpointing` (the model each activation-checkpointing
    statement wraps) are keyed by id() of the statements in `body`; `report` hears of each statement that reads the
    parameters before the construction and cannot move."""
    for statement in list(body):
        info = placed.get(id(statement))
        if info is None:
            continue
        _optimizer_after(body, statement, info, code, report)
        _checkpointing_before(body, statement, info, checkpointing, code)
    return body


def _note(statement: cst.BaseStatement, text: str) -> cst.BaseStatement:
    assert isinstance(statement, (cst.SimpleStatementLine, cst.BaseCompoundStatement))
    return statement.with_changes(leading_lines=[*statement.leading_lines, cst.EmptyLine(comment=cst.Comment(text))])


def _optimizer_after(
    body: list[cst.BaseStatement],
    first: cst.BaseStatement,
    info: Placed,
    code: Callable[[cst.CSTNode], str],
    report: Callable[[Finding], None],
) -> None:
    start = body.index(first)
    since = next((i + 1 for i in range(start - 1, -1, -1) if info.model.split(".")[0] in bound_names(body[i])), 0)
    early = [
        i
        for i in range(since, start)
        if isinstance(body[i], cst.SimpleStatementLine)
        and any(f"{info.model}.{m}()" in code(body[i]) for m in ("parameters", "named_parameters"))
        and not _counts(cast(cst.SimpleStatementLine, body[i]))
    ]
    moving = []
    for i in early:
        between = body[i + 1 : start]
        reads = set().union(*(names_in(s) for s in between)) if between else set()
        binds = set().union(*(bound_names(s) for s in between)) if between else set()
        if bound_names(body[i]) & reads or names_in(body[i]) & binds:
            report(_unmovable(info, code(body[i]).strip()))
        else:
            moving.append(body[i])
    for s in moving:
        body.remove(s)
    end = body.index(first) + info.count
    note = f"{NOTE} moved after fully_shard, which replaces the parameters"
    body[end:end] = [_note(s, note) for s in moving]


def _unmovable(info: Placed, statement: str) -> Finding:
    """The finding for a statement reading the parameters before a construction that cannot move after it."""
    why = (
        f"`{statement}` reads `{info.model}`'s parameters before fully_shard replaces them with DTensors, and the "
        "statements between use what it binds (or change what it reads), so it cannot move after it: an optimizer "
        "built there would hold the replaced parameters"
    )
    fix = "build what holds the parameters (the optimizer) after the fully_shard calls"
    return Finding(info.line, "a statement before the construction", why, fix)


_COUNTS = frozenset({"sum", "len", "print"})


def _counts(statement: cst.SimpleStatementLine) -> bool:
    """`n = sum(p.numel() for p in model.parameters())`, `print(...)`: a value read from the parameters, which holds
    none of them (FSDP2's DTensors give the same counts)."""
    for small in statement.body:
        value = small.value if isinstance(small, (cst.Assign, cst.AugAssign, cst.AnnAssign, cst.Expr)) else None
        if not (isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value in _COUNTS):
            return False
    return True


def _checkpointing_before(
    body: list[cst.BaseStatement],
    first: cst.BaseStatement,
    info: Placed,
    checkpointing: dict[int, str],
    code: Callable[[cst.CSTNode], str],
) -> None:
    if info.materializes or info.target != info.model:
        return
    start = body.index(first)
    end = start + info.count
    bound: set[str] = set()
    for index in range(end, len(body)):
        statement = body[index]
        if checkpointing.get(id(statement)) == info.model and not (names_in(statement) & bound):
            del body[index]
            note = f"{NOTE} activation checkpointing moved before fully_shard, the order FSDP2 composes with"
            body.insert(start, _note(statement, note))
            return
        bound |= bound_names(statement)


def names_in(node: cst.CSTNode) -> set[str]:
    found: set[str] = set()

    class _Names(cst.CSTVisitor):
        def visit_Name(self, name: cst.Name) -> None:
            found.add(name.value)

    node.visit(_Names())
    return found


def bound_names(node: cst.CSTNode) -> set[str]:
    """Names a statement binds (assignments, loops, with-as, imports, definitions)."""
    found: set[str] = set()

    class _Bound(cst.CSTVisitor):
        def visit_AssignTarget(self, target: cst.AssignTarget) -> None:
            found.update(names_in(target))

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            found.update(names_in(node.target))

        def visit_AugAssign(self, node: cst.AugAssign) -> None:
            found.update(names_in(node.target))

        def visit_For(self, node: cst.For) -> None:
            found.update(names_in(node.target))

        def visit_AsName(self, node: cst.AsName) -> None:
            found.update(names_in(node.name))

        def visit_ImportAlias(self, node: cst.ImportAlias) -> None:
            found.add(code_of(node.asname.name if node.asname else node.name).split(".")[0])

        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            found.add(node.name.value)

        def visit_ClassDef(self, node: cst.ClassDef) -> None:
            found.add(node.name.value)

    node.visit(_Bound())
    return found


def code_of(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)
