"""FSDP1's class in an annotation (`def setup_fsdp_sync(model) -> FSDP:`, `Optional[FSDP]`) as FSDP2's FSDPModule,
which every fully_shard module is (evaluated where the function is defined: the name must be). `-> MixedPrecision`
stays as written where the file's constructions read their precision at run time: the policies stay FSDP1's."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import libcst as cst

from .construction import FSDP2

if TYPE_CHECKING:
    from .transformer import Fsdp1ToFsdp2

_FSDP = "FullyShardedDataParallel"
# FSDP1 classes whose objects stay FSDP1's where a construction reads that keyword at run time (fsdp1_options)
_KEPT_CLASSES = {"MixedPrecision": "mixed_precision", "CPUOffload": "cpu_offload"}


def annotation(t: Fsdp1ToFsdp2, original: cst.Annotation, updated: cst.Annotation) -> cst.Annotation:
    """FSDP1's class in an annotation (`def setup_fsdp_sync(model) -> FSDP:`, `Optional[FSDP]`) is FSDP2's
    FSDPModule, which every fully_shard module is (evaluated where the function is defined: the name must be)."""
    kept = [name for name, keyword in _KEPT_CLASSES.items() if keyword in t._at_run_time]
    if kept:  # (the values a construction reads at run time stay FSDP1's objects: so does their annotation)
        classes = _FsdpNames(t, frozenset(kept))
        original.visit(classes)
        t.consumed.update(classes.nodes)
    found = _FsdpNames(t)
    original.visit(found)
    if not found.codes:
        return updated
    t.consumed.update(found.nodes)
    t.need(FSDP2, "FSDPModule")
    return cast(cst.Annotation, updated.visit(_Renamed(found.codes, "FSDPModule")))


class _FsdpNames(cst.CSTVisitor):
    """The names of FSDP1's class under a node of the file as read (their code, and the nodes)."""

    def __init__(self, t: Fsdp1ToFsdp2, classes: frozenset[str] = frozenset({_FSDP})) -> None:
        super().__init__()
        self.t, self.classes, self.codes, self.nodes = t, classes, set[str](), list[cst.CSTNode]()

    def _see(self, node: cst.Name | cst.Attribute) -> bool:
        if self.t.fsdp1(node) in self.classes:
            self.codes.add(self.t.code(node))
            self.nodes.append(node)
            return False
        return True

    def visit_Name(self, node: cst.Name) -> bool:
        return self._see(node)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        return self._see(node)


class _Renamed(cst.CSTTransformer):
    """Each Name or Attribute whose code is one of `codes` as `name`."""

    def __init__(self, codes: set[str], name: str) -> None:
        super().__init__()
        self.codes, self.name = codes, name

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
        return cst.Name(self.name) if original.value in self.codes else updated

    def leave_Attribute(self, original: cst.Attribute, updated: cst.BaseExpression) -> cst.BaseExpression:
        return cst.Name(self.name) if cst.Module([]).code_for_node(original) in self.codes else updated
