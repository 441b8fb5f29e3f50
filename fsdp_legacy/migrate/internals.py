"""FSDP1's private modules (`torch.distributed.fsdp._runtime_utils._lazy_init`, `_common_utils.TrainingState`, ...):
reported, one finding per name, as items a person must replace. They are FSDP1's implementation, not its API: under
FSDP2 they act on state that no longer exists (`_lazy_init` on a `fully_shard` module fails, a `TrainingState`
comparison never holds), and torch may move them in any release. The import and the uses stay as written; the rest
of the file migrates as usual. FSDP2's own private package (`torch.distributed.fsdp._fully_shard`) is not FSDP1's."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from .report import Finding

INTERNAL = "internal"  # Finding.kind
_PREFIX = "torch.distributed.fsdp._"
_FSDP2 = ("torch.distributed.fsdp._fully_shard",)

# name -> what to do instead under FSDP2
_FIXES = {
    "_lazy_init": "drop it: fully_shard modules initialize themselves at the first forward (or call `model.unshard()` "
    "to gather the parameters ahead of it)",
    "_reshard": "call `module.reshard()` on the fully_shard module",
    "_unshard": "call `module.unshard()` on the fully_shard module",
    "clean_tensor_name": "drop it: FSDP2 parameter names carry no FSDP prefixes (`_fsdp_wrapped_module.`)",
    "TrainingState": "FSDP2 does not expose its training state; test what the code needs instead "
    "(`torch.is_grad_enabled()`, hooks on the module)",
    "HandleTrainingState": "FSDP2 has no flat-parameter handles",
    "FlatParamHandle": "FSDP2 has no flat-parameter handles: use the module's DTensor parameters",
    "_get_module_fsdp_state": "use `isinstance(module, FSDPModule)` (torch.distributed.fsdp)",
    "_FSDPState": "use `FSDPModule` (torch.distributed.fsdp)",
}
_DEFAULT_FIX = "rewrite it onto FSDP2's public API (fully_shard, FSDPModule's methods, DTensor parameters)"


def _internal(qualified: str) -> str | None:
    """`_runtime_utils._lazy_init` for `torch.distributed.fsdp._runtime_utils._lazy_init`; None elsewhere."""
    if not qualified.startswith(_PREFIX) or qualified.startswith(_FSDP2):
        return None
    return qualified[len("torch.distributed.fsdp.") :]


class Internals(cst.CSTVisitor):
    """Visits the original tree: every name bound to or read from FSDP1's private modules, by qualified name, with
    the lines it is imported and used at."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider)

    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[str, list[int]] = {}  # `_runtime_utils._lazy_init` -> lines, in order

    def visit_Name(self, node: cst.Name) -> None:
        self._note(node)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        """`module.name` is noted as itself (`_runtime_utils._lazy_init`), `Class.member` as its class."""
        inner = self._names(node.value)
        if inner and "." in inner[0]:
            return True
        return not self._note(node)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        module = cst.Module([]).code_for_node(node.module) if node.module else ""
        line = self.get_metadata(PositionProvider, node).start.line
        names = (
            [] if isinstance(node.names, cst.ImportStar) else [cst.Module([]).code_for_node(a.name) for a in node.names]
        )
        for name in names or ["*"]:
            found = _internal(f"{module}.{name}") if not node.relative else None
            if found is not None:
                self.lines.setdefault(found, []).append(line)
        return False

    def visit_Import(self, node: cst.Import) -> bool:
        line = self.get_metadata(PositionProvider, node).start.line
        for alias in node.names:
            module = cst.Module([]).code_for_node(alias.name)
            found = _internal(module)
            if found is not None:
                self.lines.setdefault(found, []).append(line)
        return False

    def _names(self, node: cst.CSTNode) -> list[str]:
        return sorted(filter(None, (_internal(q.name) for q in self.get_metadata(QualifiedNameProvider, node, set()))))

    def _note(self, node: cst.CSTNode) -> bool:
        found = self._names(node)
        if not found:
            return False
        lines = self.lines.setdefault(found[0], [])
        line = self.get_metadata(PositionProvider, node).start.line
        if line not in lines:
            lines.append(line)
        return True

    def findings(self) -> list[Finding]:
        out = []
        for name, lines in self.lines.items():
            short = name.rsplit(".", 1)[-1]
            where = (
                f" (used at line{'s' if len(lines) > 2 else ''} {', '.join(map(str, lines[1:]))})" if lines[1:] else ""
            )
            why = (
                "a private module of FSDP1's implementation, not its API: FSDP2 has no such state (under fully_shard "
                f"it fails or matches nothing), and torch moves these between releases; it is left as written{where}"
            )
            fix = _FIXES.get(short, _DEFAULT_FIX)
            out.append(Finding(lines[0], f"FSDP1 internal `torch.distributed.fsdp.{name}`", why, fix, INTERNAL))
        return out
