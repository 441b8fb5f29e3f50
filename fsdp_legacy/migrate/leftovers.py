"""The safety net behind "never a silent wrong rewrite": every FSDP1 name, FSDP1-only method and FSDP1 private
attribute in the file as it was read that no rewrite consumed becomes a finding."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from .names import FSDP1_METHODS, PRIVATE_ATTRIBUTES, advice, fsdp1_name
from .report import Finding

# FSDP1's enums, which a migrated file may keep as data: its members equal torch's (rehome.py moves the import).
DATA_ENUMS = frozenset({"ShardingStrategy", "StateDictType", "BackwardPrefetch"})


def _accelerate(node: cst.Attribute) -> bool:
    """Accelerate's own `accelerator.clip_grad_norm_(...)` (an Accelerator held as `accelerator` or
    `self.accelerator`), which is no FSDP1 method."""
    receiver = node.value
    name = receiver.attr.value if isinstance(receiver, cst.Attribute) else getattr(receiver, "value", None)
    return node.attr.value == "clip_grad_norm_" and name == "accelerator"


class LeftoverFinder(cst.CSTVisitor):
    """Visits the original tree (through the rewriter's MetadataWrapper) skipping the nodes rewrites consumed."""

    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)

    def __init__(self, consumed: set[cst.CSTNode], reported_lines: set[int]) -> None:
        super().__init__()
        self.consumed = consumed
        self.reported_lines = reported_lines  # lines the rewriter reported already, with a better reason
        self.findings: list[Finding] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if node in self.consumed or isinstance(node, (cst.Import, cst.ImportFrom)):
            return False
        if isinstance(node, (cst.Name, cst.Attribute)):
            qualified = {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}
            names = sorted(filter(None, (fsdp1_name(q) for q in qualified)))
            if names and names[0].split(".")[0] in DATA_ENUMS:
                return False  # a plain enum value (a config's default, a comparison): kept, from fsdp_legacy
            if names:
                self._add(node, f"FSDP1 API `{names[0]}` left in place", *advice(names[0]))
                return False
            if isinstance(node, cst.Attribute):
                self._attribute(node, qualified)
        return True

    def _attribute(self, node: cst.Attribute, qualified: set[str]) -> None:
        attr = node.attr.value
        if attr in PRIVATE_ATTRIBUTES:
            why = "FSDP1's private internals (flat parameters, handles, the wrapped module) do not exist in FSDP2"
            fix = "use the module itself: its parameters are DTensors (`to_local()`, `full_tensor()`)"
            self._add(node, f"private FSDP1 attribute `{attr}`", why, fix)
        elif attr in FSDP1_METHODS and not any(q.startswith("torch.") for q in qualified) and not _accelerate(node):
            why = "called on an object this tool cannot tell is the FSDP-wrapped model (a parameter, an attribute)"
            fix = "rewrite by hand as for the wrapped model (docs/migration.md), or name it as the wrapped model is"
            self._add(node, f"`.{attr}(...)` on an object not known to be FSDP-wrapped", why, fix)

    def _add(self, node: cst.CSTNode, what: str, why: str, fix: str) -> None:
        line = self.get_metadata(PositionProvider, node).start.line
        if line not in self.reported_lines:
            self.findings.append(Finding(line, what, why, fix))
