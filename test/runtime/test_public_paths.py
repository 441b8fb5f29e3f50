"""The public import paths: each spelling the docs give works and names the code that lives in state/, and every
`fsdp_legacy...` path named in the README, docs/ and the package's docstrings resolves."""

import ast
import importlib
import re
from typing import Any

import fsdp_legacy.checkpoint
import fsdp_legacy.dcp_checkpoint
import fsdp_legacy.state.async_save
import fsdp_legacy.state.checkpoint
import fsdp_legacy.state.dcp_checkpoint
import fsdp_legacy.state.hf_checkpoint
import fsdp_legacy.state.rank_file
import repo_paths

ROOT = repo_paths.REPO


def test_dcp_checkpoint_spellings_are_one_api() -> None:
    from fsdp_legacy import dcp_checkpoint
    from fsdp_legacy.dcp_checkpoint import async_save, async_save_sharded, load, save
    from fsdp_legacy.state import async_save as background
    from fsdp_legacy.state import dcp_checkpoint as internal

    assert dcp_checkpoint is fsdp_legacy.dcp_checkpoint
    assert sorted(dcp_checkpoint.__all__) == ["AsyncSave", "async_save", "async_save_sharded", "load", "save"]
    for name, value in (("save", save), ("load", load)):
        assert value is getattr(dcp_checkpoint, name) is getattr(internal, name)
    for name, value in (("async_save", async_save), ("async_save_sharded", async_save_sharded)):
        assert value is getattr(dcp_checkpoint, name) is getattr(background, name)


def test_checkpoint_spellings_are_one_api() -> None:
    from fsdp_legacy import checkpoint

    assert checkpoint is fsdp_legacy.checkpoint
    for name in checkpoint.__all__:
        home = fsdp_legacy.state.hf_checkpoint if name.endswith("full_model") else fsdp_legacy.state.checkpoint
        if name in ("latest", "LatestCheckpoint", "SkippedCheckpoint"):
            home = fsdp_legacy.state.latest
        if name in ("AsyncSave", "save_full_model_async"):
            home = fsdp_legacy.state.async_save
        if name == "load_rank_state":
            home = fsdp_legacy.state.rank_file
        assert getattr(checkpoint, name) is getattr(home, name), name


def _documents() -> list[tuple[str, str]]:
    """(where, text): the README, docs/*.md, and every docstring of the package."""
    found = [
        (str(path.relative_to(ROOT)), path.read_text()) for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    ]
    for path in sorted((ROOT / "fsdp_legacy").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node)
                if docstring:
                    found.append((f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}", docstring))
    return found


def _resolve(dotted: str) -> Any:
    """The module or object `dotted` names: the longest importable prefix, then attributes."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[end:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(dotted)


def _named_paths() -> list[tuple[str, str]]:
    """(where, dotted path) for every `fsdp_legacy.x.y` and every `from fsdp_legacy... import a, b` in the documents."""
    named: set[tuple[str, str]] = set()
    for where, text in _documents():
        for match in re.finditer(r"(?<![\w/.])fsdp_legacy(?:\.\w+)+", text):
            named.add((where, match.group(0)))
        for match in re.finditer(r"^\s*from (fsdp_legacy[\w.]*) import ([\w ,]+)", text, re.MULTILINE):
            for name in match.group(2).split(","):
                if name.strip():
                    named.add((where, f"{match.group(1)}.{name.split()[0]}"))
    return sorted(named)


def test_documented_paths_resolve() -> None:
    named = _named_paths()
    assert ("docs/migration.md", "fsdp_legacy.dcp_checkpoint") in named  # the scan sees the spellings at issue
    broken = []
    for where, dotted in named:
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as error:
            broken.append(f"{where}: {dotted} ({error})")
    assert not broken, "\n".join(broken)
