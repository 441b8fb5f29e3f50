"""One Python file's FSDP1 code rewritten onto FSDP2 with LibCST (comments and formatting kept): the surveys of the
whole file first, then the transformer (transformer.py: the wrapper's construction, its methods, `no_sync()`, the
state-dict API as torch.distributed.checkpoint.state_dict's helpers), rerun while state_dict_type blocks must stay.
What is not mapped stays as it was and is reported (leftovers.py, internals.py); a file whose FSDP1 objects must
stay FSDP1 as a whole (a subclass of FSDP1's class, a state-dict type it cannot follow) is left as it is, with why."""

from __future__ import annotations

from dataclasses import replace

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.metadata import MetadataWrapper, PositionProvider

from .bindings import Bindings
from .facts import FileFacts
from .foreign import kept_handovers
from .internals import Internals
from .leftovers import LeftoverFinder
from .manual_wrap import ManualWrap
from .partials import ClassValues
from .rehome import Rehome
from .removal import RemoveStatements as _RemoveStatements
from .report import MigrationResult
from .returned_model import exported_names
from .sharded_resume import ShardedResume
from .state_dict_type import SetTypes
from .subclasses import Subclasses, kept_constructions, kept_state_dict_calls, kept_type_blocks, refusals
from .survey import Survey
from .transformer import Fsdp1ToFsdp2
from .type_blocks import Readers, TypeBlocks


def migrate_source(source: str, facts: FileFacts | None = None) -> MigrationResult:
    """Rewrite one file's text (`facts`: what the program's other files say, program.py); the findings are what is
    left to a person, by line of `source`."""
    facts = facts or FileFacts()
    parsed = cst.parse_module(source)  # (a file that cannot be parsed is an error either way)
    if replace(facts, read_elsewhere={}, state_dict_setters=False) == FileFacts() and "fsdp" not in source.lower():
        # Every FSDP1 name reaches a file through an import path or attribute holding "fsdp", or through another file
        # of the program (facts; who imports this one brings none): nothing here to rewrite or report, and the dozen
        # passes below cost a second a file.
        return MigrationResult(source, source, [])
    wrapper = MetadataWrapper(parsed)
    subclasses = Subclasses(frozenset(facts.subclasses))
    wrapper.visit(subclasses)
    refused = refusals(subclasses, dict(facts.subclasses))
    if refused:  # the whole file stays FSDP1 (subclasses.py)
        return MigrationResult(source, source, refused)
    code = wrapper.module.code_for_node
    survey = Survey()
    wrapper.visit(survey)
    bindings = Bindings(wrapper)
    exported = {**exported_names(wrapper.module), **facts.read_elsewhere}  # callers elsewhere are not followed
    survey.follow_builders(bindings.parents, wrapper.module, exported)
    survey.models |= facts.imported_models
    set_types = SetTypes(code, bindings, {**exported, **facts.followed_elsewhere})
    wrapper.visit(set_types)
    if set_types.findings:  # a state-dict type it cannot follow: the whole file stays FSDP1 (state_dict_type.py)
        return MigrationResult(source, source, sorted(set_types.findings, key=lambda f: f.line))
    wraps = ManualWrap(code, survey.value_of)
    wrapper.visit(wraps)
    blocks = TypeBlocks(code, bindings)
    wrapper.visit(blocks)
    resume = ShardedResume(code, bindings)
    wrapper.visit(resume)
    keep: dict[cst.With, str] = {}
    while True:  # each round keeps the blocks whose calls the last one could not all rewrite
        context = CodemodContext()
        resume.done.clear()
        plan = blocks.plan(keep)
        transformer = Fsdp1ToFsdp2(wrapper.module, survey, set_types, wraps, plan, resume, context, facts)
        tree = wrapper.visit(transformer)
        readers = Readers(transformer.removed_blocks, transformer.consumed - transformer.reported, code, bindings)
        wrapper.visit(readers)
        if not readers.found:
            break
        keep.update(readers.found)
    if transformer.removed:
        tree = tree.visit(_RemoveStatements(transformer.removed))
    if tree.code != source:
        for module, name, asname in survey.fsdp1_imports:
            RemoveImportsVisitor.remove_unused_import(context, module, name, asname)
        tree = AddImportsVisitor(context).transform_module(tree)
        tree = RemoveImportsVisitor(context).transform_module(tree)
        tree = tree.visit(Rehome())  # the FSDP1 values it keeps, from fsdp_legacy (rehome.py)
    internals = Internals()
    wrapper.visit(internals)
    positions = wrapper.resolve(PositionProvider)
    reported = [*transformer.findings, *internals.findings(), *survey.builders.findings(positions)]
    finder = LeftoverFinder(transformer.consumed | set(survey.builders.refused), {f.line for f in reported})
    wrapper.visit(finder)
    findings = sorted(reported + finder.findings, key=lambda f: f.line)
    kept = frozenset(positions[c].start.line for c in survey.fsdp_calls if c not in transformer.migrated_calls)
    values = ClassValues(transformer.consumed)  # FSDP1's class handed on (`partial(FSDP, ...)`, `wrapper = FSDP`)
    wrapper.visit(values)  # and left: it builds FSDP1 models too
    kept |= {positions[v].start.line for v in values.found}
    policies = frozenset(n for n, v in survey.assigned.items() for _, value in v if value in transformer.kept_policies)
    stays = kept | {positions[c].start.line for c in wraps.plan.kept}  # (manual wrapping left FSDP1's too)
    if stays and tree.code != source:  # never a mix: the rest would be FSDP2's around an FSDP1 model
        findings = sorted([*findings, kept_constructions(sorted(stays))], key=lambda f: f.line)
        return MigrationResult(source, source, findings, kept, policies)
    kept_blocks = sorted(positions[b].start.line for b in transformer.kept_blocks)
    if kept_blocks and tree.code != source:  # nor FSDP1's state_dict_type (a no-op there) around an FSDP2 model
        findings = sorted([*findings, kept_type_blocks(kept_blocks)], key=lambda f: f.line)
        return MigrationResult(source, source, findings, kept, policies)
    handing = sorted(positions[c].start.line for c in transformer.foreign_calls)
    if handing and tree.code != source:  # nor another library's FSDP1 helper handed an FSDP2 model (foreign.py)
        findings = sorted([*findings, kept_handovers(handing)], key=lambda f: f.line)
        return MigrationResult(source, source, findings, kept, policies)
    kept_calls = sorted(positions[c].start.line for c in transformer.kept_calls)
    if kept_calls and tree.code != source:  # nor a model's call FSDP1's type decided, on an FSDP2 model
        findings = sorted([*findings, kept_state_dict_calls(kept_calls)], key=lambda f: f.line)
        return MigrationResult(source, source, findings, kept, policies)
    return MigrationResult(source, tree.code, findings, kept, policies, transformer.run_time_reads)


__all__ = ["migrate_source"]
