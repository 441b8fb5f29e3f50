"""The LibCST transformer that rewrites one file's FSDP1 code (rewriter.py runs it, after the surveys): the
wrapper's construction (construction.py), its methods, `no_sync()`, and the state-dict API, which becomes
torch.distributed.checkpoint.state_dict's helpers."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, cast

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider

from . import (
    annotated,
    apply_call,
    configs,
    construction,
    foreign,
    methods,
    optim_loads,
    optim_state,
    partials,
    precision,
    run_time_blocks,
    summon,
    unwrap,
)
from .construction import FSDP2, NOTE, RUNTIME, STATE_DICT_HELPERS
from .facts import FileFacts
from .manual_wrap import ManualWrap
from .maybe_wrapped import FSDP_MODULE, guarded
from .methods import attribute as _fsdp1_attribute
from .methods import rewrite as _method
from .names import FSDP1_MAPPED_KWARGS, advice, fsdp1_name
from .narrowed import Narrowing
from .removal import bare as _bare
from .reorder import Placed, reorder
from .report import Finding
from .sharded_resume import LOADER, ShardedResume
from .state_dict_type import BLOCK, SetTypes, TypeOptions
from .survey import Survey, is_checkpointing
from .type_blocks import Plan
from .unwrap import with_leading as _with_leading

_FSDP = "FullyShardedDataParallel"


class Fsdp1ToFsdp2(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def __init__(
        self,
        module: cst.Module,
        survey: Survey,
        set_types: SetTypes,
        wraps: ManualWrap,
        plan: Plan,
        resume: ShardedResume,
        context: CodemodContext,
        facts: FileFacts,
    ) -> None:
        super().__init__()
        self.facts = facts  # what the program's other files say (program.py)
        self.migrated_calls: set[cst.Call] = set()  # the FSDP(...) calls that became fully_shard
        self.kept_policies: set[cst.Call] = set()  # the MixedPrecision(...) calls left FSDP1's
        self.plan = plan  # the state_dict_type blocks taken away, and their configs (type_blocks.py)
        self.resume = resume  # load_sharded_optimizer_state_dict's recipe (sharded_resume.py)
        self.resume_defs: dict[int, cst.SimpleStatementLine] = {}  # id(statement) -> as read, where it may go
        self.module = module
        self.survey = survey
        self.set_types = set_types  # set_state_dict_type followed through the file (state_dict_type.py)
        self.wraps = wraps.plan  # enable_wrap / wrap (manual_wrap.py)
        self.context = context
        self.findings: list[Finding] = [*set_types.findings, *self.wraps.findings]
        # original nodes a rewrite (or a specific finding) accounts for
        self.consumed: set[cst.CSTNode] = {*set_types.left, *self.wraps.consumed}
        self.reported: set[cst.CSTNode] = set(set_types.left)  # of those, the ones left as written
        for module_name, obj in self.wraps.imports if self.wraps.calls or self.wraps.headers else ():
            self.need(module_name, obj)
        # the state_dict_type blocks around the node: (model, options), None where FSDP2 has no such options
        self.blocks: list[tuple[str, TypeOptions | None]] = []
        self.removed_blocks: dict[cst.With, str] = {}  # the blocks taken away -> their model (type_blocks.Readers)
        self.kept_blocks: set[cst.With] = set()
        self.kept_calls: set[cst.Call] = set()  # wrapped models' state-dict calls left as written (methods.py)
        self.foreign_calls: set[cst.Call] = set()  # calls handing a wrapped model to another library's FSDP helper
        self.unwrap: dict[cst.With, str] = {}  # with-statements to replace by their body: "state_dict", no_sync's model
        self.removed: set[str] = set()  # code of dead policy assignments, taken out by a second pass
        self.dead_uses: Counter[str] = Counter()  # name -> its uses the rewrites consumed (_drop_if_dead)
        self.load_defs: dict[int, optim_loads.PendingLoad] = {}  # id(statement) -> the to-load call it assigns
        # id(`optim.load_state_dict(name)`) -> (optim, name, the call as read)
        self.load_uses: dict[int, tuple[str, str, cst.Call]] = {}
        self.dropped: dict[int, list[str]] = {}  # id(statement) -> the comments left where it is taken out
        self.constructions: dict[int, Placed] = {}  # id(first new statement) -> what it shards
        self.checkpointing: dict[int, str] = {}  # id(statement applying activation checkpointing) -> its model
        self.summons: dict[cst.With, cst.Call] = {}  # summon_full_params blocks that only read -> full_params(...)
        self.no_sync_items: set[cst.Call] = set()  # `with model.no_sync():` items, their blocks unwrapped
        self.function_models: dict[cst.CSTNode, frozenset[str]] = {}  # (methods.function_models)
        self._precision_uses: dict[cst.CSTNode, bool] | None = None
        self._run_time_keywords: frozenset[str] = frozenset()  # (set with _precision_uses)
        self._kept_precision: frozenset[cst.CSTNode] = frozenset()  # (set with _precision_uses: _kept_by_uses)
        self._alive: list[cst.CSTNode] = []  # every node whose id() keys one of the dicts above (see _key)
        # objects a test of the program shows are FSDP1 units (`assert isinstance(m, FSDP)`)
        self.narrowing = Narrowing(resume.bindings, lambda kind: self.fsdp1(kind) == _FSDP, self.code)

    # -- helpers -------------------------------------------------------------------------------------------------

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def fsdp1(self, node: cst.CSTNode) -> str | None:
        names = [fsdp1_name(q.name) for q in self.get_metadata(QualifiedNameProvider, node, set())]
        return next((n for n in names if n), None)

    def value_of(self, node: cst.BaseExpression) -> cst.BaseExpression:
        return self.survey.value_of(node)

    def line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def report(self, node: cst.CSTNode, what: str, why: str, fix: str) -> None:
        self.findings.append(Finding(self.line(node), what, why, fix))
        self.consumed.add(node)
        self.reported.add(node)

    def known_model(self, code: str, node: cst.CSTNode) -> bool:
        """Whether `code` at `node` is a model the file knows wrapped (methods.py)."""
        return methods.known(self, code, node) is not None

    def need(self, module: str, obj: str | None = None) -> None:
        AddImportsVisitor.add_needed_import(self.context, module, obj)

    def expr(self, code: str) -> cst.BaseExpression:
        return cst.parse_expression(code)

    # -- construction and statements -----------------------------------------------------------------------------

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        if len(original.body) != 1:
            return updated
        small = original.body[0]
        if original in self.resume.plans:
            self.resume_defs[self._key(updated)] = original
        config = self.plan.configs.get(original)
        if config is not None:  # a config of blocks taken away: out, or built as StateDictOptions at run time
            updated = self._config(updated, config)
        if original in self.set_types.followed:
            setter, options = self.set_types.followed[original]
            self.consumed.add(setter)
            for arg in setter.args[2:]:  # configs assigned to a name used only here
                if isinstance(arg.value, cst.Name):
                    self._drop_if_dead(arg.value.value)
            model, function = options.model, self.set_types.returned_to.get(original)
            calls = f"on what {function}() returns" if function else f"on {model} below"
            note = f"{NOTE} FSDP.set_state_dict_type({model}, ...) taken out: the state-dict calls {calls}"
            self.dropped[self._key(updated)] = [note + " take its options"]
        if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.value, cst.Call):
            target, call = small.targets[0].target, small.value
            if self.fsdp1(call.func) == _FSDP and call not in self.survey.builders.refused:  # (returned_model.py)
                return self._construction(original, updated, self.code(target), call)
            if optim_state.api_of(self.fsdp1(call.func)) in optim_state.LOADS and isinstance(target, cst.Name):
                at_once = optim_loads.load_def(self, original, updated, target.value, call)
                if at_once is not None:
                    return at_once
        if (returning := self.survey.builders.returning(small)) is not None:  # callers name it (returned_model.py)
            return self._construction(original, updated, *returning)
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            self._checkpointing(small.value, updated)
            now = updated.body[0]
            if isinstance(now, cst.Expr) and isinstance(now.value, cst.Call):
                func, args = now.value.func, now.value.args
                if isinstance(func, cst.Attribute) and func.attr.value == "load_state_dict" and len(args) == 1:
                    if isinstance(args[0].value, cst.Name) and not args[0].keyword:
                        loaded = small.value
                        self.load_uses[self._key(updated)] = (self.code(func.value), args[0].value.value, loaded)
        return updated

    def _config(self, updated: cst.SimpleStatementLine, config: configs.Config) -> cst.SimpleStatementLine:
        assign = cast(cst.Assign, updated.body[0])
        self.consumed.add(cast(cst.Assign, (config.drop or config.rewrite).statement.body[0]).value)  # type: ignore[union-attr]
        if config.drop is not None:
            self.dropped[self._key(updated)] = []
            return updated
        self.need(RUNTIME, config.helper)
        call = cast(cst.Call, assign.value).with_changes(func=cst.Name(config.helper))
        return updated.with_changes(body=[assign.with_changes(value=call)])

    def _carried(self, old: cst.BaseStatement, new: cst.BaseStatement) -> cst.BaseStatement:
        """`new` in place of `old` (a block's first statement given the block's comments), with what is noted of it:
        a loader the outer block's load is paired with later must still be found there."""
        tables: list[dict[int, Any]] = [
            self.resume_defs,
            self.load_defs,
            self.load_uses,
            self.dropped,
            self.constructions,
        ]
        for table in tables:
            if id(old) in table:
                table[self._key(new)] = table.pop(id(old))
        return new

    def _key(self, node: cst.CSTNode) -> int:
        """id(node) as a dict key, `node` kept alive for the rewrite: a freed node's id, given to a new node, made a
        stale entry match an unrelated statement (dropped or moved, at random)."""
        self._alive.append(node)
        return id(node)

    def _checkpointing(self, call: cst.Call, statement: cst.BaseStatement) -> None:
        """Note a statement that applies activation checkpointing to a model (reorder.py may move it)."""
        qualified = {q.name for q in self.get_metadata(QualifiedNameProvider, call.func, set())}
        local = isinstance(call.func, cst.Name) and call.func.value in self.survey.checkpointing_functions
        if (is_checkpointing(qualified) or local) and call.args and not call.args[0].keyword:
            self.checkpointing[self._key(statement)] = self.code(call.args[0].value)

    def leave_If(self, original: cst.If, updated: cst.If) -> cst.If:
        """An `if` doing nothing but apply activation checkpointing to one model moves as one statement."""
        if updated.orelse is None and isinstance(updated.body, cst.IndentedBlock):
            models = {self.checkpointing.get(id(s)) for s in updated.body.body}
            if len(models) == 1 and None not in models:
                self.checkpointing[self._key(updated)] = cast(str, models.pop())
        return updated

    def _construction(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine, target: str, call: cst.Call
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        built = self._build(target, call)
        self.consumed.add(call)
        self.migrated_calls.update(() if built.problems else (call,))
        if built.problems:
            for problem in built.problems:
                self.findings.append(Finding(self.line(problem.node), problem.what, problem.why, problem.fix))
            return original  # as written: a MixedPrecision(...) among its keywords stays FSDP1's too
        for module, obj in built.imports:
            self.need(module, obj)
        for arg in call.args:  # a policy assigned to a name used only here: its assignment is dead now
            if arg.keyword and arg.keyword.value == "auto_wrap_policy" and isinstance(arg.value, cst.Name):
                self._drop_if_dead(arg.value.value, "\n".join(self.code(s) for s in built.statements))
                if self.value_of(arg.value) is not arg.value:  # or it is handed to apply_fully_shard as it is
                    self.consumed.add(self.value_of(arg.value))
            if arg.keyword and arg.keyword.value == "auto_wrap_policy":
                self._policy_factory(self.value_of(arg.value))
        built.statements[0] = _with_leading(built.statements[0], construction.leading(built, original))
        wrapped = construction.module_first(call).args[0].value
        model = self.code(wrapped) if isinstance(wrapped, (cst.Name, cst.Attribute)) else target
        placed = Placed(model, target, len(built.statements), built.materializes, self.line(original))
        self.constructions[self._key(built.statements[0])] = placed
        if isinstance(original.body[0], cst.Return):  # `return FSDP(...)`: the sharded module, after (not moved)
            built.statements.append(cst.parse_statement(f"return {target}\n"))
        return cst.FlattenSentinel(built.statements)

    def _policy_factory(self, policy: cst.BaseExpression) -> None:
        """A policy built by a function of the file (`auto_wrap_policy=get_wrapping_policy(...)`, or a name assigned
        its result) goes to apply_fully_shard as it is, which evaluates it as FSDP1 does: the FSDP1 policies the
        function composes are accounted for, when that call is the function's only use in the file."""
        func = policy.func if isinstance(policy, cst.Call) else None
        if isinstance(func, cst.Name):
            defs, only = self.survey.functions.get(func.value, []), self.survey.name_count[func.value] == 2
        elif isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self":
            name = func.attr.value  # (OpenFIM's `self._get_wrap_policy(self.model)`, a method of the class)
            defs = self.survey.functions.get(name, [])
            only = self.survey.name_count[name] == 1 and self.survey.attribute_count[name] == 1
        else:
            return
        if len(defs) == 1 and only:  # the def and this call
            self.consumed.update(construction.policy_names(defs[0], self.fsdp1))

    def _drop_if_dead(self, name: str, rewritten: str = "") -> None:
        """Take out `name = ...` when the rewrites consumed every use (and do not name it in `rewritten`): a policy
        shared by two constructions goes with the second."""
        uses = self.survey.assigned.get(name, [])
        if re.search(rf"\b{name}\b", rewritten):
            return
        self.dead_uses[name] += 1
        if len(uses) == 1 and self.survey.name_count[name] == 1 + self.dead_uses[name]:
            self.removed.add(_bare(uses[0][0]))
            self.consumed.add(uses[0][0])
            RemoveImportsVisitor.remove_unused_import(self.context, "functools")

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        return updated.with_changes(body=self._block(list(updated.body)))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        return updated.with_changes(body=self._block(list(updated.body)))

    def _block(self, body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """A block's statements once its own have been rewritten: to-load calls paired with their loads, statements
        taken out (their comments kept), and the moves around constructions made."""
        optim_loads.pair_loads(self, body)
        body = [new for statement in body for new in self._resumed(statement)]
        kept: list[cst.BaseStatement] = []
        carried: list[cst.EmptyLine] = []
        for statement in body:
            notes = self.dropped.get(id(statement))
            if notes is not None:
                assert isinstance(statement, cst.SimpleStatementLine)
                carried += [*statement.leading_lines, *(cst.EmptyLine(comment=cst.Comment(n)) for n in notes)]
                continue
            kept.append(_with_leading(statement, carried) if carried else statement)
            carried = []
        if carried or (body and not kept):  # (a block emptied by the rewrite; an empty file stays empty)
            kept.append(cst.SimpleStatementLine([cst.Pass()], leading_lines=carried))
        return reorder(kept, self.constructions, self.checkpointing, self.code, self.findings.append)

    def _resumed(self, statement: cst.BaseStatement) -> list[cst.BaseStatement]:
        """A mapped load_sharded_optimizer_state_dict(...) as FSDP2's load (sharded_resume.py)."""
        original = self.resume_defs.get(id(statement))
        new = self.resume.statements(original) if original is not None else None
        if new is None or original is None:
            return [statement]
        self._need_helpers("get_optimizer_state_dict")
        self.need("torch.distributed.checkpoint")
        RemoveImportsVisitor.remove_unused_import(self.context, self.resume.plans[original].module, LOADER)
        return [_with_leading(new[0], cast(cst.SimpleStatementLine, statement).leading_lines), *new[1:]]

    # -- with-blocks: state_dict_type, no_sync and summon_full_params ---------------------------------------------

    def visit_With(self, node: cst.With) -> None:
        if len(node.items) != 1 or not isinstance(node.items[0].item, cst.Call) or node.items[0].asname:
            return
        call = node.items[0].item
        if self.fsdp1(call.func) == summon.SUMMON or self._summon_on_unit(call):
            plan = summon.plan(call, node.body, self._is_container, self.code)
            if plan.problem is not None:
                where, what, why, fix = plan.problem
                self.report(where, what + (f" at line {self.line(plan.writes[0])}" if plan.writes else ""), why, fix)
            elif plan.call is not None:
                self.summons[node] = plan.call
                self.consumed.add(call)
            return
        if self.fsdp1(call.func) == BLOCK:
            options = self.plan.removed.get(node)  # (type_blocks.py decides)
            if options is not None:
                self.blocks.append((options.model, options))
                self.removed_blocks[node], self.unwrap[node] = options.model, "state_dict"
                self.consumed.update((node.items[0], *options.data))
            else:  # the block stays, reported, and the state-dict calls in it with it
                model = self.code(call.args[0].value) if call.args and not call.args[0].keyword else ""
                self.blocks.append((model, None))
                self.kept_blocks.add(node)
                if node in self.plan.kept:
                    why = f"it stays: {self.plan.kept[node]}"
                    fix = "write that call onto get_/set_model_state_dict with StateDictOptions, then migrate again"
                    self.report(call, "`with FSDP.state_dict_type(...)`", why, fix)
            return
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == "no_sync" and not call.args:
            if self.code(func.value) in self.survey.models:
                self.unwrap[node] = self.code(func.value)
                self.consumed.add(node.items[0])
                self.no_sync_items.add(call)

    def _summon_on_unit(self, call: cst.Call) -> bool:
        """`unit.summon_full_params(unit, ...)` on a known FSDP1 object: FSDP1's static method, reached through it."""
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == "summon_full_params"):
            return False
        return methods.known(self, self.code(func.value), call) is not None

    def _is_container(self, name: str) -> bool:
        values = [value for _, value in self.survey.assigned.get(name, [])]
        return bool(values) and all(summon.is_container_value(v, self.code) for v in values)

    def leave_With(
        self, original: cst.With, updated: cst.With
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        if original in self.kept_blocks:
            self.blocks.pop()
        if original in self.wraps.headers:
            return unwrap.enable_wrap(updated, *self.wraps.headers[original])
        if original in self.summons:
            self.need(RUNTIME, summon.HELPER)
            note = cst.EmptyLine(comment=cst.Comment(f"{NOTE} summon_full_params (the block only reads)"))
            item = updated.items[0].with_changes(item=self.summons[original])
            return updated.with_changes(items=[item], leading_lines=[*updated.leading_lines, note])
        kind = self.unwrap.get(original)
        if kind is None:
            return updated
        statements = unwrap.body_of(updated)
        if kind == "state_dict":
            statements = run_time_blocks.started(self.blocks.pop()[1], statements, self.need)
        else:
            statements = unwrap.no_sync(kind, statements)
        statements[0] = self._carried(statements[0], _with_leading(statements[0], list(updated.leading_lines)))
        return cst.FlattenSentinel(statements)

    def _options(self, model: str, node: cst.Call, optim: bool = False) -> str | None:
        """The StateDictOptions code a state-dict call on `model` takes: its state_dict_type block's, else its
        followed set_state_dict_type's, else FSDP1's default (FULL on every rank); None where it is left as it is."""
        for block_model, options in reversed(self.blocks):
            if block_model == model:
                return None if options is None else options.optim_options if optim else options.model_options
        governed = self.set_types.governed.get(node)
        if governed is not None:
            return governed.optim_options if optim else governed.model_options
        return None if node in self.set_types.left else optim_loads.FULL

    # -- calls ---------------------------------------------------------------------------------------------------

    def leave_Annotation(self, original: cst.Annotation, updated: cst.Annotation) -> cst.Annotation:
        return annotated.annotation(self, original, updated)

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        """`model.module`, FSDP1's wrapped module, is the model itself under FSDP2."""
        _fsdp1_attribute(self, original)
        if original.attr.value == "module":
            code = self.code(original.value)
            wrapped = code in self.survey.models or self.narrowing.unit(original.value, original)
            wrapped = wrapped or code in methods.function_models(self, original)  # (a parameter handed the model)
            if wrapped:
                self.consumed.add(original)
                if not methods.maybe_plain(self, original.value, original):
                    return updated.value
            if wrapped or methods.maybe_handed(self, original.value, original):
                # FSDP1's wrapped module where it holds the wrapped model, DDP's or its own attribute elsewhere
                self.need(FSDP2, FSDP_MODULE)
                held = self.code(updated.value)
                return self.expr(guarded(held, held, self.module.code_for_node(updated)))
        no_sync = methods.no_sync_value(self, original, updated)
        if no_sync is not None:
            return no_sync
        if original.attr.value == "apply" and self.code(original.value) in self.survey.models:
            parent = self.get_metadata(ParentNodeProvider, original, None)
            if not (isinstance(parent, cst.Call) and parent.func is original):
                self.report(original, apply_call.as_value(self.code(original.value)), *advice(apply_call.API))
        return updated

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if original in self.wraps.kept:
            return original  # manual wrapping left to a person: its keywords stay FSDP1's
        names = self.get_metadata(QualifiedNameProvider, original.func, set())
        qualified = {q.name for q in names}
        helper = foreign.helper_of_another_library(original, names, self.facts.program_names)
        if helper is not None and self._hands_a_wrapped_model(original):
            self.report(original, f"`{self.code(original.func)}(...)`", foreign.WHY.format(helper=helper), foreign.FIX)
            self.foreign_calls.add(original)
        if f"{RUNTIME}.apply_fully_shard" in qualified and len(original.args) > 1:
            given = original.args[1].value  # an FSDP1 policy is what apply_fully_shard takes (a migrated file)
            self.consumed.update({given, self.value_of(given)})
            self._policy_factory(self.value_of(given))
        self.consumed.update(
            run_time_blocks.read_at_run_time(
                original, qualified, self.value_of, self.fsdp1, self.code, self.resume.bindings
            )
        )
        if original in self.survey.fsdp_partials:
            return partials.rewrite(self, original, updated)
        name = self.fsdp1(original.func)
        rewritten: cst.BaseExpression | None = None
        if name == "MixedPrecision":
            _, buffer_dtype, refused = construction.mixed_precision_policy(original, self.code)
            used = self._precision().get(original)  # None: no FSDP(...) of the program takes it
            if not refused and used is not True and "mixed_precision" in self._at_run_time:
                # it may be what fsdp1_options reads at run time (`mixed_precision=mp_policy()`): FSDP1's, as it is
                self.consumed.add(original)
                self.kept_policies.add(original)
                return updated
            if refused or used is False or (buffer_dtype is not None and used is None):
                self.report(original, f"MixedPrecision({', '.join(refused) or '...'})", *precision.kept(refused, used))
                self.kept_policies.add(original)
                return updated
            self.need(FSDP2, "MixedPrecisionPolicy")
            rewritten = precision.policy_call(updated)
        elif name == "CPUOffload" and not precision.offload_for_constructions(self, original):
            self.consumed.add(original)  # what takes it the text does not show: FSDP1's, which fsdp1_options reads too
        elif name == "CPUOffload" and construction.offload_policy(original, self.code):
            policy = cast(str, construction.offload_policy(original, self.code))
            self.need(FSDP2, policy)
            RemoveImportsVisitor.remove_unused_import(self.context, FSDP2, policy)  # unused if its FSDP(...) goes
            rewritten = self.expr(f"{policy}()")
        elif name == "CPUOffload" and "cpu_offload" in self._at_run_time:
            self.consumed.add(original)  # FSDP1's (not a literal), for fsdp1_options to read at run time
        elif optim_state.api_of(name) is not None:
            rewritten = optim_loads.optim_call(self, cast(str, optim_state.api_of(name)), original)
        elif name == apply_call.API:
            rewritten = self._apply(original, apply_call.unbound(updated))
        elif original in self.wraps.calls:  # wrap(module, ...) inside enable_wrap
            unit = updated.args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            extra = cast(cst.Call, self.expr(f"f({', '.join(self.wraps.calls[original])})")).args
            return updated.with_changes(func=cst.Name("fully_shard"), args=[unit, *extra])
        elif name == f"{_FSDP}.fsdp_modules" and len(original.args) == 1 and not original.args[0].keyword:
            self.need(FSDP2, "FSDPModule")
            module = self.code(original.args[0].value)
            rewritten = self.expr(f"[m for m in {module}.modules() if isinstance(m, FSDPModule)]")
        elif self.code(original.func) == "isinstance" and len(original.args) == 2:
            if self.fsdp1(original.args[1].value) == _FSDP:
                self.need(FSDP2, "FSDPModule")
                self.consumed.add(original.args[1].value)
                return updated.with_changes(
                    args=[updated.args[0], updated.args[1].with_changes(value=cst.Name("FSDPModule"))]
                )
        elif isinstance(original.func, cst.Attribute):
            rewritten = _method(self, original, updated)
        if rewritten is None:
            return updated
        self.consumed.add(original)
        return rewritten

    @property
    def _at_run_time(self) -> frozenset[str]:
        """The FSDP1 keywords some construction of the file, or of the program (facts), reads at run time."""
        return self.run_time_reads | self.facts.run_time_reads

    @property
    def run_time_reads(self) -> frozenset[str]:
        """The FSDP1 keywords some construction of this file hands fsdp1_options / apply_fully_shard at run time."""
        self._precision()
        return self._run_time_keywords

    def visit_Module(self, node: cst.Module) -> None:
        if "auto_wrap_policy" in self._at_run_time:  # the FSDP1 policies built here may be what it evaluates
            self.consumed.update(construction.policy_names(node, self.fsdp1))

    def _precision(self) -> dict[cst.CSTNode, bool]:
        """The MixedPrecision values FSDP(...) calls take -> whether all of those become fully_shard (a dry run)."""
        if self._precision_uses is None:
            builds = {
                call: self._build(self.survey.constructions[call], call, dry=True)
                for call in self.survey.fsdp_calls
                if call in self.survey.constructions
            }
            built = [  # (fully_shard_fsdp1's values stay FSDP1's, as FSDP1's calls' do)
                (call, call in builds and not builds[call].problems and not builds[call].fsdp1_values)
                for call in self.survey.fsdp_calls
            ]
            self._run_time_keywords = frozenset().union(*(b.at_run_time for b in builds.values() if not b.problems))
            self._run_time_keywords |= partials.run_time_keywords(self.survey.fsdp_partials, self.code)
            self._run_time_keywords |= FSDP1_MAPPED_KWARGS if self.survey.runs_fsdp1_calls else frozenset()
            survey = self.survey
            self._precision_uses = precision.uses(
                built, self.value_of, survey.assigned, survey.name_count, self.facts.policy_uses
            )
            self._kept_precision = kept = self._kept_by_uses(self._precision_uses)
            if any(migrated and precision.taken(call, kept, self.value_of) for call, migrated in built):
                self._run_time_keywords |= {"mixed_precision"}  # (FSDP1's policy, which fsdp1_options reads)
        return self._precision_uses

    def _hands_a_wrapped_model(self, call: cst.Call) -> bool:
        """Whether `call` hands a model the file knows wrapped among its arguments (not ahead of its wrapping)."""
        wrapped = {*self.survey.models, *methods.function_models(self, call)}
        return any(self.code(a.value) in wrapped and not methods.before_its_wrapping(self, a.value) for a in call.args)

    def _kept_by_uses(self, uses: dict[cst.CSTNode, bool]) -> frozenset[cst.CSTNode]:
        """The MixedPrecision(...) values that stay FSDP1's, because some use of them may reach a construction that
        stays FSDP1: the constructions that become fully_shard read them at run time (fsdp1_options)."""
        return frozenset(
            node
            for node, every in uses.items()
            if not every
            and isinstance(node, cst.Call)
            and self.fsdp1(node.func) == "MixedPrecision"
            and not construction.mixed_precision_policy(node, self.code)[2]  # (refused: the construction stays)
        )

    def _build(self, target: str, call: cst.Call, dry: bool = False) -> construction.Construction:
        if not dry:
            self._precision()  # (the dry run decides which policies stay FSDP1's)
        kept = () if dry else self._kept_precision
        return construction.build(
            target, call, self.code, self.fsdp1, self.value_of, self.survey.meta, self.facts.policies, kept
        )

    def _apply(
        self, original: cst.Call, mapped: apply_call.Mapped, left: cst.Call | None = None
    ) -> cst.BaseExpression | None:
        """FSDP1's apply as apply_full (apply_call.py), or reported and `left` (None: the call as updated)."""
        if isinstance(mapped, str):
            self.report(original, mapped, *advice(apply_call.API))
            return left
        self.need(RUNTIME, apply_call.HELPER)
        return mapped

    def _need_helpers(self, *names: str) -> None:
        for name in (*names, "StateDictOptions"):
            self.need(STATE_DICT_HELPERS, name)
