"""Statements taken out after the rewrite, by their text: a policy or config assignment is left before the
construction that makes it dead is reached, so a second pass removes it."""

from __future__ import annotations

import libcst as cst


def bare(statement: cst.SimpleStatementLine) -> str:
    return cst.Module([]).code_for_node(statement.with_changes(leading_lines=[])).strip()


class RemoveStatements(cst.CSTTransformer):
    """Takes out the statements with the given code: a policy assignment is left before the construction that
    makes it dead is reached."""

    def __init__(self, codes: set[str]) -> None:
        super().__init__()
        self.codes = codes

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
        return cst.RemovalSentinel.REMOVE if bare(updated) in self.codes else updated
