"""FSDP1's class handed on as a value rather than called: `functools.partial(FSDP, sharding_strategy=..., ...)` (a
wrapper factory's result, dinov2's `get_fsdp_wrapper`) becomes `partial(fully_shard_fsdp1, ...)` with the same
keywords (runtime.py: every value mapped at run time as FSDP1 applies it, the module sharded in place and returned).

Any other use of the class as a value (`wrapper = FSDP`, `isinstance(x, (FSDP, DDP))`, `type(m) is FSDP`, a partial
with a keyword FSDP2 has no counterpart for) stays FSDP1's, and the file is then left as it is, as a whole (the
rewriter's "never a mix": its models would be FSDP1's, the calls on them rewritten for FSDP2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import libcst as cst
from libcst.metadata import QualifiedNameProvider

from .construction import RUNTIME
from .names import FSDP1_DROPPED_KWARGS, FSDP1_MAPPED_KWARGS, fsdp1_name

_FSDP = "FullyShardedDataParallel"
HELPER = "fully_shard_fsdp1"
_PARTIAL = frozenset({"functools.partial", "partial"})

Qualified = Callable[[cst.CSTNode], set[str]]


def names_fsdp(node: cst.CSTNode, qualified: Qualified) -> bool:
    """Whether `node` (a Name or Attribute) is FSDP1's class itself."""
    return isinstance(node, (cst.Name, cst.Attribute)) and any(fsdp1_name(q) == _FSDP for q in qualified(node))


def is_fsdp_partial(call: cst.Call, qualified: Qualified) -> bool:
    """`partial(FSDP, ...)` (functools'), or `partial(fully_shard_fsdp1, ...)` in a file migrated already."""
    if not call.args or call.args[0].keyword is not None or call.args[0].star or not qualified(call.func) & _PARTIAL:
        return False
    first = call.args[0].value
    return names_fsdp(first, qualified) or f"{RUNTIME}.{HELPER}" in qualified(first)


def problems(call: cst.Call, code: Callable[[cst.CSTNode], str]) -> list[tuple[cst.CSTNode, str, str, str]]:
    """Why `partial(FSDP, ...)` cannot become `partial(fully_shard_fsdp1, ...)`: (node, what, why, fix) each."""
    found: list[tuple[cst.CSTNode, str, str, str]] = []
    for arg in call.args[1:]:
        name = arg.keyword.value if arg.keyword else None
        if arg.star or name is None:
            what = f"partial(FSDP, {code(arg)})"
            why = "an argument by position or unpacked: which FSDP1 keyword it gives cannot be read from the text"
            found.append((arg, what, why, "pass FSDP1's keywords by name, then migrate again"))
        elif name not in FSDP1_MAPPED_KWARGS | FSDP1_DROPPED_KWARGS:
            why = "FSDP2 has no such argument and this tool does not map it yet"
            fix = "write the fully_shard calls by hand (docs/migration.md has the mapping)"
            found.append((arg, f"partial(FSDP, {name}=...)", why, fix))
    return found


class ClassValues(cst.CSTVisitor):
    """Every place FSDP1's class is used as a value: not called (`FSDP(...)`: constructions), not an attribute's
    owner (`FSDP.state_dict_type`: its static methods), not imported, not in an annotation (no effect at run time)."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider,)

    def __init__(self, consumed: set[cst.CSTNode]) -> None:
        super().__init__()
        self.consumed = consumed  # what the rewrites accounted for (`enable_wrap(wrapper_cls=FSDP)`, a partial)
        self.found: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        return node not in self.consumed and super().on_visit(node)

    def _qualified(self, node: cst.CSTNode) -> set[str]:
        return {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_Annotation(self, node: cst.Annotation) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        node.body.visit(self)  # bases: subclasses.py refuses a subclass of FSDP1's class first
        return False

    def visit_Call(self, node: cst.Call) -> bool:
        if names_fsdp(node.func, self._qualified):
            for arg in node.args:
                arg.visit(self)
            return False
        return True

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        if names_fsdp(node, self._qualified):
            self.found.append(node)
            return False
        return not names_fsdp(node.value, self._qualified)  # FSDP.<method>: not the class as a value

    def visit_Name(self, node: cst.Name) -> None:
        if names_fsdp(node, self._qualified):
            self.found.append(node)


def run_time_keywords(calls: list[cst.Call], code: Callable[[cst.CSTNode], str]) -> frozenset[str]:
    """The FSDP1 keywords the partials that become fully_shard_fsdp1's hand it (their values stay FSDP1's objects,
    a MixedPrecision or CPUOffload that fsdp1_options reads at run time)."""
    return frozenset(
        cast(cst.Name, arg.keyword).value for call in calls if not problems(call, code) for arg in call.args[1:]
    )


def rewrite(transformer: Any, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
    """`partial(FSDP, ...)` as `partial(fully_shard_fsdp1, ...)`, or reported and left (the file then stays)."""
    found = problems(original, transformer.code)
    for node, what, why, fix in found:
        transformer.report(node, what, why, fix)
    if found:
        return updated
    transformer.consumed.update({original, original.args[0].value})
    for arg in original.args[1:]:
        if cast(cst.Name, arg.keyword).value == "auto_wrap_policy":  # FSDP1's policy, evaluated at run time
            policy = transformer.value_of(arg.value)
            transformer.consumed.update({arg.value, policy})
            transformer._policy_factory(policy)
    transformer.need(RUNTIME, HELPER)

    def qualified(node: cst.CSTNode) -> set[str]:
        return {q.name for q in transformer.get_metadata(QualifiedNameProvider, node, set())}

    if not names_fsdp(original.args[0].value, qualified):
        return updated  # fully_shard_fsdp1's already
    return updated.with_changes(args=[updated.args[0].with_changes(value=cst.Name(HELPER)), *updated.args[1:]])
