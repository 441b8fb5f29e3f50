"""The files of one program migrated together (`fsdp-legacy migrate src/`): what one file defines that another uses
is treated the same way in both, so the program ends up all FSDP2, or a file stays all FSDP1 with its reasons.

- FSDP1 subclasses (subclasses.py): a program that defines one keeps every file that uses FSDP1 as it is.
- MixedPrecision policies of one file taken by FSDP(...) in another (policies.py): the policy becomes FSDP2's only
  where every construction that takes it does.
- A file that stays FSDP1 (refused as a whole, or with FSDP(...) calls left FSDP1) keeps every file importing from
  it as it is too: what they get from it is FSDP1's.
- A function of one file that returns the wrapped model to callers in others (cross_file.py), or that they hand
  their wrapped model (handed_models.py): where they are followed, a caller's file left FSDP1 keeps the function's
  file FSDP1 too, since the model is the same on both sides.
- A file that stays FSDP1 keeps the files it imports from as they are too, where they would change: their functions
  may be handed its FSDP1 models in ways the handovers above do not follow (switti passes `trainer.switti`, an
  attribute of another object, to its checkpoint helpers)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import MetadataWrapper

from . import policies
from .cross_file import Caller, follow_across
from .facts import FileFacts
from .handed_models import Handover, follow_handed
from .report import Finding, MigrationResult
from .rewriter import migrate_source
from .subclasses import REFUSED, Subclasses, program_refusal

_ROUNDS = 8  # a policy kept FSDP1 can keep a construction, which can keep another policy: a few rounds at most


@dataclass(frozen=True)
class ImportedBy:
    """A file whose functions `importer`, a file that stays FSDP1, imports."""

    importer: str


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
    cross = follow_across(wrappers, sources, shared)
    handed = follow_handed(wrappers, sources, shared, cross)
    callers = cross.callers | handed.callers
    results: dict[str, MigrationResult] = {}
    forced: dict[str, str] = {}  # files left FSDP1 because they import from one that stays FSDP1 -> that file
    held: dict[str, Caller | Handover | ImportedBy] = {}  # files left FSDP1 with a file their model meets
    last: dict[str, tuple[FileFacts, MigrationResult]] = {}  # each file's facts and rewrite in the round before
    setters = any("set_state_dict_type" in source for source in sources.values())  # (methods.py; any mention)
    reads: frozenset[str] = frozenset()  # what the program's migrated constructions read at run time
    for _ in range(_ROUNDS):
        for path in wrappers:
            others = {n: w for n, w in every.items() if n not in defined[path]}
            facts = FileFacts(
                others,
                shared.imported(path),
                shared.uses_of(path),
                cross.read_elsewhere[path],
                setters,
                reads,
                cross.models.get(path, frozenset()),
                cross.followed.get(path, {}),
                handed.params.get(path, {}),
                path in handed.receiving,
                handed.sometimes.get(path, {}),
                handed.maybe_plain.get(path, {}),
                handed.plain.get(path, {}),
                handed.classes.get(path, frozenset()),
                frozenset(local for _, _, local in shared.named_imports(path)) | set(shared.imported_modules(path)),
            )
            if path in last and last[path][0] == facts:  # (the same facts give the same rewrite)
                result = last[path][1]
            else:
                result = migrate_source(sources[path], facts)
                last[path] = (facts, result)
            if every and not any(f.kind == REFUSED for f in result.findings) and (result.changed or result.findings):
                result = MigrationResult(sources[path], sources[path], [program_refusal(every)])
            results[path] = result if path not in forced else _importing(result, forced[path])
            if path in held:
                results[path] = _held(results[path], held[path])
        grew = _propagate(results, shared, forced, callers, held, handed.handovers)
        before, reads = reads, frozenset().union(*(r.run_time_reads for r in results.values()))
        if not shared.update(results) and not grew and reads == before:  # every file decided as the last round
            break
    return Program(results, unparsable)


def _stays_fsdp1(result: MigrationResult) -> bool:
    """A file whose FSDP1 objects stay FSDP1's: refused as a whole, or with FSDP(...) calls left FSDP1."""
    return bool(result.fsdp1_constructions) or any(f.kind == REFUSED for f in result.findings)


def _importing(result: MigrationResult, source: str) -> MigrationResult:
    """A file left as it is because it imports from `source`, which stays FSDP1."""
    if not result.changed:
        return result
    why = (
        f"it imports from {source}, which stays FSDP1 (reported there): the models, functions and policies it gets "
        "from there are FSDP1's, and this file's calls rewritten for FSDP2 would not fit them; the file is left as it "
        "is, as a whole"
    )
    finding = Finding(1, f"imports from {source}, which stays FSDP1", why, "migrate that file first", REFUSED)
    return MigrationResult(result.source, result.source, [finding, *result.findings])


def _held(result: MigrationResult, caller: Caller | Handover | ImportedBy) -> MigrationResult:
    """A file left as it is because its model goes to (or comes from) a file that stays FSDP1."""
    if isinstance(caller, ImportedBy):
        what = f"{caller.importer} imports from it and stays FSDP1"
        why = (
            f"{what} (reported there): its FSDP1 models may reach this file's functions, whose calls rewritten for "
            "FSDP2 would not fit them; the file is left as it is, as a whole"
        )
        finding = Finding(1, what, why, f"migrate {caller.importer} first", REFUSED)
        return MigrationResult(result.source, result.source, [finding, *result.findings], result.fsdp1_constructions)
    if isinstance(caller, Handover):
        what = f"its wrapped model is handed to `{caller.function}` of {caller.callee}, which stays FSDP1"
        why = f"{what} (reported there): FSDP1's calls there would meet an FSDP2 model"
        why += "; the file is left as it is, as a whole"
        return MigrationResult(
            result.source, result.source, [Finding(1, what, why, f"migrate {caller.callee} first", REFUSED),
                                           *result.findings], result.fsdp1_constructions,
        )  # fmt: skip
    if caller.handed:
        what = f"`{caller.function}` is handed its model by {caller.caller}, which stays FSDP1"
        why = f"{what} (reported there): FSDP2's calls here would meet an FSDP1 model"
    else:
        what = f"`{caller.function}`'s model goes to {caller.caller}, which stays FSDP1"
        why = (
            f"`{caller.function}` returns its wrapped model to {caller.caller}, which stays FSDP1 (reported there): "
            "FSDP1's calls there would meet an FSDP2 model"
        )
    why += "; the file is left as it is, as a whole"
    finding = Finding(1, what, why, f"migrate {caller.caller} first", REFUSED)
    return MigrationResult(result.source, result.source, [finding, *result.findings], result.fsdp1_constructions)


def _left_fsdp1(result: MigrationResult) -> bool:
    """A file that keeps FSDP1 code: it stays FSDP1, or it is left unchanged with something reported."""
    return _stays_fsdp1(result) or (not result.changed and bool(result.findings))


def _propagate(
    results: dict[str, MigrationResult],
    shared: policies.Shared,
    forced: dict[str, str],
    callers: frozenset[Caller],
    held: dict[str, Caller | Handover | ImportedBy],
    handovers: frozenset[Handover] = frozenset(),
) -> bool:
    """Files that would change while importing from a file that stays FSDP1 are left as they are too, and so are
    files whose returned model a file left FSDP1 binds, following both until nothing new stays; True when a file
    was added."""
    grew = False
    while True:
        added = {
            path: source
            for path, result in results.items()
            if path not in forced and result.changed
            for source in sorted(shared.imports_from(path))
            if _stays_fsdp1(results[source])
        }
        # (a builder's file that stays FSDP1 already holds its model)
        holding: dict[str, Caller | Handover | ImportedBy] = {
            c.builder: c
            for c in sorted(callers, key=str)
            if c.builder not in held and not _stays_fsdp1(results[c.builder]) and _left_fsdp1(results[c.caller])
        }
        holding.update({  # a file handing its model to one that stays FSDP1
            h.caller: h
            for h in sorted(handovers, key=str)
            if h.caller not in held and h.caller not in holding and results[h.caller].changed
            and _left_fsdp1(results[h.callee])
        })  # fmt: skip
        holding.update(
            {  # a file that a file staying FSDP1 imports from
                path: ImportedBy(importer)
                for importer, result in sorted(results.items())
                if _stays_fsdp1(result)
                for path in sorted(shared.imports_from(importer))
                if path not in held and path not in holding and path not in forced and results[path].changed
            }
        )
        if not added and not holding:
            return grew
        for path, source in added.items():
            forced[path] = source
            results[path] = _importing(results[path], source)
        for path, caller in holding.items():
            held[path] = caller
            results[path] = _held(results[path], caller)
        grew = True
