"""The files of one program migrated together (`fsdp-legacy migrate src/`): what one file defines that another uses
is treated the same way in both, so the program ends up all FSDP2, or a file stays all FSDP1 with its reasons.

- FSDP1 subclasses (subclasses.py): a program that defines one keeps every file that uses FSDP1 as it is.
- MixedPrecision policies of one file taken by FSDP(...) in another (policies.py): the policy becomes FSDP2's only
  where every construction that takes it does."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import MetadataWrapper

from . import policies
from .facts import FileFacts
from .report import MigrationResult
from .rewriter import migrate_source
from .subclasses import REFUSED, Subclasses, program_refusal

_ROUNDS = 8  # a policy kept FSDP1 can keep a construction, which can keep another policy: a few rounds at most


@dataclass(frozen=True)
class Program:
    """Each file's migration by path, and the files that could not be parsed (path -> the parser's error)."""

    results: dict[str, MigrationResult]
    unparsable: dict[str, cst.ParserSyntaxError]


def _subclasses(wrappers: Mapping[str, MetadataWrapper]) -> dict[str, dict[str, str]]:
    """path -> the FSDP1 subclasses it defines (name -> `path:line`), followed across files (a subclass of a
    subclass defined elsewhere) until nothing new is found."""
    known: dict[str, str] = {}
    defined: dict[str, dict[str, str]] = {}
    while True:
        before = len(known)
        for path, wrapper in wrappers.items():
            found = Subclasses(frozenset(known))
            wrapper.visit(found)
            defined[path] = {s.name: f"{path}:{s.line}" for s in found.defined}
            known.update(defined[path])
        if len(known) == before:
            return defined


def migrate_program(sources: Mapping[str, str]) -> Program:
    """Rewrite every file of `sources` (path -> text) as one program."""
    wrappers: dict[str, MetadataWrapper] = {}
    unparsable: dict[str, cst.ParserSyntaxError] = {}
    for path, source in sources.items():
        try:
            wrappers[path] = MetadataWrapper(cst.parse_module(source))
        except cst.ParserSyntaxError as error:
            unparsable[path] = error
    defined = _subclasses(wrappers)
    every = {name: where for found in defined.values() for name, where in found.items()}
    shared = policies.Shared(wrappers)
    results: dict[str, MigrationResult] = {}
    for _ in range(_ROUNDS):
        for path in wrappers:
            others = {n: w for n, w in every.items() if n not in defined[path]}
            facts = FileFacts(others, shared.imported(path), shared.uses_of(path))
            result = migrate_source(sources[path], facts)
            if every and not any(f.kind == REFUSED for f in result.findings) and (result.changed or result.findings):
                result = MigrationResult(sources[path], sources[path], [program_refusal(every)])
            results[path] = result
        if not shared.update(results):  # every policy and construction decided the same way as the last round
            break
    return Program(results, unparsable)
