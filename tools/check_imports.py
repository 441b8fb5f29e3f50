"""Fail when the package's modules import each other in a cycle.

    python3 tools/check_imports.py [PACKAGE_DIR]

Every `import` and `from ... import` of a package module counts, at module level or inside a function, except those
under `if TYPE_CHECKING:` (annotations only, never executed). A package's own `__init__` is counted only where it is
named, not as the implicit parent of each submodule import. Prints each cycle and exits 1, or prints the module count.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def imported_modules(path: Path, root: Path, known: set[str]) -> set[str]:
    """The package modules that `path` imports at run time."""
    this = module_name(path, root)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    targets: set[str] = set()
    for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
            continue
        base = package
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        if node.level:
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module or ""
        for alias in node.names:  # `from pkg import submodule` names the submodule; otherwise the module itself
            submodule = f"{base}.{alias.name}"
            targets.add(submodule if submodule in known else base)
    return {t for t in targets if t in known and t != this}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return cycles


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent / "fsdp_legacy").resolve()
    files = sorted(root.rglob("*.py"))
    known = {module_name(f, root) for f in files}
    graph = {module_name(f, root): imported_modules(f, root, known) for f in files}
    cycles = find_cycles(graph)
    for cycle in cycles:
        edges = [f"{a} -> {b}" for a in cycle for b in sorted(graph[a]) if b in cycle]
        print(f"import cycle among {', '.join(cycle)}:\n  " + "\n  ".join(edges))
    if cycles:
        return 1
    print(f"no import cycles among {len(known)} modules of {root.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
