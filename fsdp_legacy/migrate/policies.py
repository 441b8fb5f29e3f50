"""MixedPrecision policies shared between files of a program (`policies/mixed_precision.py` defines `bfSixteen`, the
trainer imports it and passes `mixed_precision=bfSixteen`): both sides decided the same way.

A policy becomes FSDP2's `MixedPrecisionPolicy` only where every use the program makes of it is FSDP(...)'s
`mixed_precision=` in a construction that becomes fully_shard; any other use (an FSDP(...) that stays FSDP1, the
policy returned, stored or passed on, read as `module.name`) keeps it FSDP1's, and then every construction taking it
stays FSDP1 too, reported: FSDP1 given FSDP2's policy fails, FSDP2 given FSDP1's as well. Imports are followed by
path: `from pkg.policies import x`, relative imports, and re-exports through a package's `__init__.py` (`*` too)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath

import libcst as cst
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider, QualifiedNameProvider

from .construction import mixed_precision_policy
from .facts import ImportedPolicy
from .names import fsdp1_name
from .report import MigrationResult

Origin = tuple[str, str]  # (path of the file assigning it, its name there)


@dataclass(frozen=True)
class _Import:
    module: str  # dotted, as written
    level: int  # leading dots
    name: str | None  # None: `import module [as local]`; "*": a star import
    local: str


@dataclass(frozen=True)
class _Reference:
    """A name read (not imported, not assigned) in a file, and the FSDP(...) construction it is the
    `mixed_precision=` of, by the line of the call (None: any other use)."""

    name: str
    line: int
    construction: int | None
    attribute_of: str | None = None  # `module.name`: the local name of the module


class _Read(cst.CSTVisitor):
    """One file: its module-level MixedPrecision assignments, its imports, and the names it reads."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider, ParentNodeProvider, PositionProvider)

    def __init__(self) -> None:
        super().__init__()
        self.policies: dict[str, tuple[int, str | None, tuple[str, ...]]] = {}  # name -> line, buffer_dtype, refused
        self.imports: list[_Import] = []
        self.references: list[_Reference] = []
        self.assigned: set[str] = set()

    def _fsdp1(self, node: cst.CSTNode) -> str | None:
        return next(
            filter(None, (fsdp1_name(q.name) for q in self.get_metadata(QualifiedNameProvider, node, set()))), None
        )

    def visit_Module(self, node: cst.Module) -> None:
        for statement in node.body:
            small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
            if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.value, cst.Call):
                target = small.targets[0].target
                if isinstance(target, cst.Name) and self._fsdp1(small.value.func) == "MixedPrecision":
                    _, buffer_dtype, refused = mixed_precision_policy(small.value, cst.Module([]).code_for_node)
                    line = self.get_metadata(PositionProvider, statement).start.line
                    self.policies[target.value] = (line, buffer_dtype, tuple(refused))

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        module = cst.Module([]).code_for_node(node.module) if node.module else ""
        if isinstance(node.names, cst.ImportStar):
            self.imports.append(_Import(module, len(node.relative), "*", "*"))
            return False
        for alias in node.names:
            name = cst.Module([]).code_for_node(alias.name)
            local = cst.Module([]).code_for_node(alias.asname.name) if alias.asname else name
            self.imports.append(_Import(module, len(node.relative), name, local))
        return False

    def visit_Import(self, node: cst.Import) -> bool:
        for alias in node.names:
            module = cst.Module([]).code_for_node(alias.name)
            local = cst.Module([]).code_for_node(alias.asname.name) if alias.asname else module
            self.imports.append(_Import(module, 0, None, local))
        return False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        if isinstance(node.target, cst.Name):
            self.assigned.add(node.target.value)

    def visit_Name(self, node: cst.Name) -> None:
        parent = self.get_metadata(ParentNodeProvider, node, None)
        if isinstance(parent, cst.AssignTarget) or (isinstance(parent, cst.Attribute) and parent.attr is node):
            return
        if isinstance(parent, (cst.Param, cst.FunctionDef, cst.ClassDef)) or (
            isinstance(parent, cst.Arg) and parent.keyword is node
        ):
            return
        construction = None
        if isinstance(parent, cst.Arg) and parent.keyword is not None and parent.keyword.value == "mixed_precision":
            call = self.get_metadata(ParentNodeProvider, parent, None)
            if (
                parent.value is node
                and isinstance(call, cst.Call)
                and self._fsdp1(call.func) == "FullyShardedDataParallel"
            ):
                construction = self.get_metadata(PositionProvider, call).start.line
        line = self.get_metadata(PositionProvider, node).start.line
        self.references.append(_Reference(node.value, line, construction))

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if isinstance(node.value, cst.Name):
            line = self.get_metadata(PositionProvider, node).start.line
            self.references.append(_Reference(node.attr.value, line, None, node.value.value))


def _module_names(path: str) -> list[str]:
    """The dotted names a file may be imported as: every tail of its path (`b.c`, `a.b.c` for a/b/c.py)."""
    parts = list(PurePath(path).with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return [".".join(parts[i:]) for i in range(len(parts)) if parts[i:] and parts[i] not in ("/", "")]


class Shared:
    """The policies of the program's files, who imports them, and (after each round of migrations) which must stay
    FSDP1's."""

    def __init__(self, wrappers: Mapping[str, MetadataWrapper]) -> None:
        self.files: dict[str, _Read] = {}
        for path, wrapper in wrappers.items():
            self.files[path] = _Read()
            wrapper.visit(self.files[path])
        self.by_module: dict[str, list[str]] = {}
        for path in self.files:
            for name in _module_names(path):
                self.by_module.setdefault(name, []).append(path)
        self.exports = self._exports()  # path -> name it offers -> origin
        self.kept: dict[Origin, str] = {
            (path, name): "FSDP2's MixedPrecisionPolicy has no counterpart for " + ", ".join(refused)
            for path, read in self.files.items()
            for name, (_, _, refused) in read.policies.items()
            if refused
        }

    def _resolve(self, importer: str, imp: _Import) -> list[str]:
        """The program's files an import names (several where the dotted name is ambiguous)."""
        if imp.level:
            base = PurePath(importer).parent
            for _ in range(imp.level - 1):
                base = base.parent
            target = base.joinpath(*imp.module.split(".")) if imp.module else base
            candidates = [str(target) + ".py", str(target / "__init__.py")]
            return [c for c in candidates if c in self.files]
        return list(self.by_module.get(imp.module, []))

    def _exports(self) -> dict[str, dict[str, Origin]]:
        exports = {path: {name: (path, name) for name in read.policies} for path, read in self.files.items()}
        changed = True
        while changed:  # re-exports of re-exports
            changed = False
            for path, read in self.files.items():
                for imp in read.imports:
                    if imp.name is None:
                        continue
                    for source in self._resolve(path, imp):
                        offered = exports[source] if imp.name == "*" else {}
                        if imp.name != "*" and imp.name in exports[source]:
                            offered = {imp.local: exports[source][imp.name]}
                        for local, origin in offered.items():
                            if exports[path].get(local) != origin and local not in read.policies:
                                exports[path][local] = origin
                                changed = True
        return exports

    def _bound(self, path: str) -> dict[str, Origin]:
        """The names a file reads that are another file's policies (not its own, not assigned there)."""
        read = self.files[path]
        return {n: o for n, o in self.exports[path].items() if o[0] != path and n not in read.assigned}

    def _modules(self, path: str) -> dict[str, str]:
        """`import m as local` (or `from pkg import m as local`) of a program file: local -> that file; and a
        package's submodules the file reads as its attributes (Lumina-mGPT's `import xllmx.util as util`, then
        `util.ckpt.save(...)`): `util.ckpt` -> xllmx/util/ckpt.py, the package's own file given or not."""
        found = {}
        read = self.files[path]
        for imp in read.imports:
            if imp.name == "*":
                continue
            if imp.name is not None:  # `from pkg import module`
                imp = _Import(f"{imp.module}.{imp.name}" if imp.module else imp.name, imp.level, None, imp.local)
            for source in self._resolve(path, imp):
                found[imp.local] = source
            for sub in sorted({r.name for r in read.references if r.attribute_of == imp.local}):
                for source in self._resolve(path, _Import(f"{imp.module}.{sub}", imp.level, None, imp.local)):
                    found[f"{imp.local}.{sub}"] = source
        return found

    def imported_modules(self, path: str) -> dict[str, str]:
        """`import m as local` of the program's files in `path`: local -> that file."""
        return self._modules(path)

    def imports_from(self, path: str) -> set[str]:
        """The program's files that `path` imports anything from (names, modules, submodules, also a package's
        submodules it reads as attributes: Lumina-mGPT's `import xllmx.util as util`, then `util.ckpt.save(...)`)."""
        found = set(self._modules(path).values())
        for imp in self.files[path].imports:
            if imp.name is not None:
                found.update(self._resolve(path, imp))
        return found - {path}

    def read_from(self, path: str) -> dict[str, str]:
        """The names of `path` other files import (`from m import name`, `m.name`; `*` for a star import) -> where."""
        found: dict[str, str] = {}
        for other, read in self.files.items():
            if other == path:
                continue
            for imp in read.imports:
                if imp.name is not None and path in self._resolve(other, imp):
                    found.setdefault(imp.name, f"imported by {other}")
            modules = self._modules(other)
            for ref in read.references:
                if ref.attribute_of is not None and modules.get(ref.attribute_of) == path:
                    found.setdefault(ref.name, f"used by {other}:{ref.line}")
        return found

    def named_imports(self, path: str) -> list[tuple[str, str, str]]:
        """The `from m import name [as local]` of `path` that name another program file: (that file, name, local)."""
        return [
            (source, imp.name, imp.local)
            for imp in self.files[path].imports
            if imp.name not in (None, "*")
            for source in self._resolve(path, imp)
            if source != path
        ]

    def read_otherwise(self, path: str) -> set[str]:
        """The names of `path` that other files read other than through `from m import name`: as `m.name`, and
        `*` where one star-imports it."""
        found: set[str] = set()
        for other, read in self.files.items():
            if other == path:
                continue
            if any(imp.name == "*" and path in self._resolve(other, imp) for imp in read.imports):
                found.add("*")
            modules = self._modules(other)
            found |= {
                r.name for r in read.references if r.attribute_of is not None and modules.get(r.attribute_of) == path
            }
        return found

    def imported(self, path: str) -> dict[str, ImportedPolicy]:
        out = {}
        for local, origin in self._bound(path).items():
            line, buffer_dtype, refused = self.files[origin[0]].policies[origin[1]]
            reason = self.kept.get(origin)
            out[local] = ImportedPolicy(f"{origin[0]}:{line}", buffer_dtype, refused, reason)
        return out

    def uses_of(self, path: str) -> dict[str, bool]:
        """This file's policies that other files read (a re-export is no use) -> whether they may become FSDP2's."""
        used = {o[1] for p in self.files if p != path for _, o in self._origins(p) if o[0] == path}
        return {name: (path, name) not in self.kept for name in used}

    def _origins(self, path: str) -> list[tuple[_Reference, Origin]]:
        """The references of a file to other files' policies, each with the policy it reads."""
        bound, modules = self._bound(path), self._modules(path)
        found = []
        for ref in self.files[path].references:
            origin = bound.get(ref.name) if ref.attribute_of is None else None
            if ref.attribute_of is not None and ref.attribute_of in modules:
                origin = self.exports[modules[ref.attribute_of]].get(ref.name)
            if origin is not None:
                found.append((ref, origin))
        return found

    def update(self, results: Mapping[str, MigrationResult]) -> bool:
        """After a round: the policies that must stay FSDP1's (kept in their own file, or used where FSDP2 cannot
        take them); True when that grew, so another round must run."""
        before = dict(self.kept)
        for path, read in self.files.items():
            result = results[path]
            for name in read.policies:
                if not result.changed or name in result.fsdp1_policies:
                    self.kept.setdefault((path, name), f"it stays FSDP1's in {path} (reported there)")
            for ref, origin in self._origins(path):
                migrated = result.changed and ref.construction is not None
                if not migrated or ref.construction in result.fsdp1_constructions:
                    why = (
                        "an FSDP(...) there stays FSDP1" if ref.construction else "not as FSDP(...)'s mixed_precision="
                    )
                    self.kept.setdefault(origin, f"it is used at {path}:{ref.line}, {why}")
        return self.kept != before
