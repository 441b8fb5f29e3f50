"""With-statements the rewrite replaces by their bodies: a state_dict_type block taken away, `no_sync()` as
FSDP2's gradient-sync switch around the body, `enable_wrap(...)` as the statements that set up its keywords."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import libcst as cst


def with_leading(statement: cst.BaseStatement, lines: Sequence[cst.EmptyLine]) -> cst.BaseStatement:
    """`statement` with `lines` (comments, blank lines) above its own."""
    assert isinstance(statement, (cst.SimpleStatementLine, cst.BaseCompoundStatement))
    return statement.with_changes(leading_lines=[*lines, *statement.leading_lines])


def body_of(node: cst.With) -> list[cst.BaseStatement]:
    body = node.body
    if isinstance(body, cst.IndentedBlock):
        return list(body.body)
    return [cst.SimpleStatementLine(body=cast(Sequence[cst.BaseSmallStatement], body.body))]


def contains(node: cst.CSTNode, kinds: tuple[type, ...]) -> bool:
    """Whether `node` holds one of `kinds` outside the functions and classes it defines."""
    found: list[bool] = []

    class _Find(cst.CSTVisitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            if isinstance(n, kinds):
                found.append(True)
            return not isinstance(n, (cst.FunctionDef, cst.ClassDef))

    node.visit(_Find())
    return bool(found)


def no_sync(model: str, statements: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """FSDP2 accumulates unreduced gradients while gradient sync is off; a body that may leave early switches it
    back on in a `finally`."""
    off = cst.parse_statement(f"{model}.set_requires_gradient_sync(False)  # was: with {model}.no_sync():\n")
    on = cst.parse_statement(f"{model}.set_requires_gradient_sync(True)\n")
    if any(contains(s, (cst.Return, cst.Break, cst.Continue, cst.Raise)) for s in statements):
        finally_ = cst.Finally(body=cst.IndentedBlock(body=[on]))
        return [off, cst.Try(body=cst.IndentedBlock(body=statements), finalbody=finally_)]
    return [off, *statements, on]


def enable_wrap(updated: cst.With, notes: list[str], header: list[str]) -> cst.FlattenSentinel[cst.BaseStatement]:
    """`with enable_wrap(...):` as `wrap_kwargs = {...}` (and a mesh) followed by its body."""
    statements = [*(cst.parse_module("\n".join(header) + "\n").body if header else ()), *body_of(updated)]
    comments = [cst.EmptyLine(comment=cst.Comment(note)) for note in notes]
    statements[0] = with_leading(statements[0], [*updated.leading_lines, *comments])
    return cst.FlattenSentinel(statements)
