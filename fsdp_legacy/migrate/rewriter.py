"""One Python file's FSDP1 code rewritten onto FSDP2 with LibCST (comments and formatting kept): the wrapper's
construction (construction.py), its methods, `no_sync()`, and the state-dict API, which becomes
torch.distributed.checkpoint.state_dict's helpers. What is not mapped stays as it was and is reported
(leftovers.py)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider, QualifiedNameProvider

from . import construction, summon
from .construction import FSDP2, NOTE, RUNTIME, STATE_DICT_HELPERS
from .leftovers import LeftoverFinder
from .names import FSDP1_IMPORT_MODULES, fsdp1_name
from .reorder import Placed, reorder
from .report import Finding, MigrationResult

_FSDP = "FullyShardedDataParallel"
_FULL = "StateDictOptions(full_state_dict=True)"  # FSDP1's default state-dict type: FULL, on every rank
_AC = "apply_activation_checkpointing"


def _is_checkpointing(qualified: set[str]) -> bool:
    return any(q == _AC or q.endswith("." + _AC) for q in qualified)


@dataclass(frozen=True)
class _StateDictBlock:
    """An active `with FSDP.state_dict_type(model, ...)`: the StateDictOptions code for the model and the optimizer."""

    model: str
    model_options: str
    optim_options: str


class _Survey(cst.CSTVisitor):
    """What the rewrite needs to know about the whole file first: the wrapped models' names, single assignments
    (to read a policy or a config assigned to a name), how often each name occurs, the FSDP1 imports, the functions
    that apply activation checkpointing, and whether the file names the meta device."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider,)

    def __init__(self) -> None:
        super().__init__()
        self.models: set[str] = set()
        self.assigned: dict[str, list[tuple[cst.SimpleStatementLine, cst.BaseExpression]]] = {}
        self.name_count: Counter[str] = Counter()
        self.fsdp1_imports: list[tuple[str, str, str | None]] = []
        self.checkpointing_functions: set[str] = set()
        self.meta = False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        """A function that only applies activation checkpointing (besides local names, prints and its docstring)
        can move with its call; one that does more cannot."""
        body = node.body.body if isinstance(node.body, cst.IndentedBlock) else ()
        if all(isinstance(statement, cst.SimpleStatementLine) for statement in body):
            kinds = [self._kind(small) for st in cast(Sequence[cst.SimpleStatementLine], body) for small in st.body]
            if "checkpointing" in kinds and "other" not in kinds:
                self.checkpointing_functions.add(node.name.value)

    def _kind(self, small: cst.BaseSmallStatement) -> str:
        if isinstance(small, cst.Assign) and all(isinstance(t.target, cst.Name) for t in small.targets):
            return "local"
        if isinstance(small, cst.Expr) and isinstance(small.value, (cst.SimpleString, cst.ConcatenatedString)):
            return "docstring"
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            func = small.value.func
            if _is_checkpointing(self._qualified(func)):
                return "checkpointing"
            if isinstance(func, cst.Name) and func.value == "print":
                return "print"
        return "other"

    def _qualified(self, node: cst.CSTNode) -> set[str]:
        return {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        self.meta |= node.evaluated_value == "meta"

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        for small in node.body:
            if isinstance(small, cst.Assign) and len(small.targets) == 1:
                target = small.targets[0].target
                if isinstance(target, cst.Name):
                    self.assigned.setdefault(target.value, []).append((node, small.value))
                if isinstance(small.value, cst.Call) and self._is_fsdp(small.value.func):
                    self.models.add(cst.Module([]).code_for_node(target))

    def visit_Name(self, node: cst.Name) -> None:
        self.name_count[node.value] += 1

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        module = cst.Module([]).code_for_node(node.module) if node.module else ""
        if module in FSDP1_IMPORT_MODULES and not isinstance(node.names, cst.ImportStar):
            for alias in node.names:
                asname = alias.asname.name.value if alias.asname and isinstance(alias.asname.name, cst.Name) else None
                self.fsdp1_imports.append((module, cst.Module([]).code_for_node(alias.name), asname))

    def _is_fsdp(self, node: cst.CSTNode) -> bool:
        return any(fsdp1_name(q.name) == _FSDP for q in self.get_metadata(QualifiedNameProvider, node, set()))


class Fsdp1ToFsdp2(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def __init__(self, module: cst.Module, survey: _Survey, context: CodemodContext) -> None:
        super().__init__()
        self.module = module
        self.survey = survey
        self.context = context
        self.findings: list[Finding] = []
        self.consumed: set[cst.CSTNode] = set()  # original nodes a rewrite (or a specific finding) accounts for
        self.blocks: list[_StateDictBlock] = []
        self.unwrap: dict[
            cst.With, str
        ] = {}  # with-statements to replace by their body: "state_dict" or no_sync's model
        self.removed: set[str] = set()  # code of dead policy assignments, taken out by a second pass
        self.pending_loads: dict[str, str] = {}  # name of an optim_state_dict_to_load result -> its optimizer's code
        self.constructions: dict[int, Placed] = {}  # id(first new statement) -> what it shards
        self.checkpointing: dict[int, str] = {}  # id(statement applying activation checkpointing) -> its model
        self.summons: dict[cst.With, cst.Call] = {}  # summon_full_params blocks that only read -> full_params(...)

    # -- helpers -------------------------------------------------------------------------------------------------

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def fsdp1(self, node: cst.CSTNode) -> str | None:
        names = [fsdp1_name(q.name) for q in self.get_metadata(QualifiedNameProvider, node, set())]
        return next((n for n in names if n), None)

    def value_of(self, node: cst.BaseExpression) -> cst.BaseExpression:
        """A name the file assigns exactly once, as its value; anything else as it is."""
        if isinstance(node, cst.Name) and len(self.survey.assigned.get(node.value, [])) == 1:
            return self.survey.assigned[node.value][0][1]
        return node

    def line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def report(self, node: cst.CSTNode, what: str, why: str, fix: str) -> None:
        self.findings.append(Finding(self.line(node), what, why, fix))
        self.consumed.add(node)

    def need(self, module: str, obj: str | None = None) -> None:
        AddImportsVisitor.add_needed_import(self.context, module, obj)

    def expr(self, code: str) -> cst.BaseExpression:
        return cst.parse_expression(code)

    # -- construction and statements -----------------------------------------------------------------------------

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement] | cst.RemovalSentinel:
        if len(original.body) != 1:
            return updated
        small = original.body[0]
        if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.value, cst.Call):
            target, call = small.targets[0].target, small.value
            if self.fsdp1(call.func) == _FSDP:
                return self._construction(original, updated, self.code(target), call)
            if self.fsdp1(call.func) == f"{_FSDP}.optim_state_dict_to_load" and isinstance(target, cst.Name):
                rewritten = self._optim_load(call)
                if rewritten is not None:
                    self.pending_loads[target.value] = self.code(call.args[1].value)
                    return updated.with_changes(body=[cst.Expr(rewritten)])
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            call = small.value
            if (
                isinstance(call.func, cst.Attribute)
                and call.func.attr.value == "load_state_dict"
                and len(call.args) == 1
                and isinstance(call.args[0].value, cst.Name)
                and self.pending_loads.get(call.args[0].value.value) == self.code(call.func.value)
            ):
                del self.pending_loads[call.args[0].value.value]
                return cst.RemovalSentinel.REMOVE  # set_optimizer_state_dict above loaded it
            self._checkpointing(call, updated)
        return updated

    def _checkpointing(self, call: cst.Call, statement: cst.BaseStatement) -> None:
        """Note a statement that applies activation checkpointing to a model (reorder.py may move it)."""
        qualified = {q.name for q in self.get_metadata(QualifiedNameProvider, call.func, set())}
        local = isinstance(call.func, cst.Name) and call.func.value in self.survey.checkpointing_functions
        if (_is_checkpointing(qualified) or local) and call.args and not call.args[0].keyword:
            self.checkpointing[id(statement)] = self.code(call.args[0].value)

    def leave_If(self, original: cst.If, updated: cst.If) -> cst.If:
        """An `if` doing nothing but apply activation checkpointing to one model moves as one statement."""
        if updated.orelse is None and isinstance(updated.body, cst.IndentedBlock):
            models = {self.checkpointing.get(id(s)) for s in updated.body.body}
            if len(models) == 1 and None not in models:
                self.checkpointing[id(updated)] = cast(str, models.pop())
        return updated

    def _construction(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine, target: str, call: cst.Call
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        built = construction.build(target, call, self.code, self.fsdp1, self.value_of, self.survey.meta)
        self.consumed.add(call)
        if built.problems:
            for problem in built.problems:
                self.findings.append(Finding(self.line(problem.node), problem.what, problem.why, problem.fix))
            return updated
        for module, obj in built.imports:
            self.need(module, obj)
        for arg in call.args:  # a policy assigned to a name used only here: its assignment is dead now
            if arg.keyword and arg.keyword.value == "auto_wrap_policy" and isinstance(arg.value, cst.Name):
                self._drop_if_dead(arg.value.value, "\n".join(self.code(s) for s in built.statements))
                if self.value_of(arg.value) is not arg.value:  # or it is handed to apply_fully_shard as it is
                    self.consumed.add(self.value_of(arg.value))
        notes = [cst.EmptyLine(comment=cst.Comment(note)) for note in built.notes]
        built.statements[0] = _with_leading(built.statements[0], [*original.leading_lines, *notes])
        model = self.code(call.args[0].value) if isinstance(call.args[0].value, (cst.Name, cst.Attribute)) else target
        self.constructions[id(built.statements[0])] = Placed(model, target, len(built.statements), built.materializes)
        return cst.FlattenSentinel(built.statements)

    def _drop_if_dead(self, name: str, rewritten: str = "") -> None:
        """Take out `name = ...` when the rewrite consumed its only use (and does not name it in `rewritten`)."""
        uses = self.survey.assigned.get(name, [])
        if len(uses) == 1 and self.survey.name_count[name] == 2 and not re.search(rf"\b{name}\b", rewritten):
            self.removed.add(_bare(uses[0][0]))
            self.consumed.add(uses[0][0])
            RemoveImportsVisitor.remove_unused_import(self.context, "functools")

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        return updated.with_changes(body=reorder(list(updated.body), self.constructions, self.checkpointing, self.code))

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        return updated.with_changes(body=reorder(list(updated.body), self.constructions, self.checkpointing, self.code))

    # -- with-blocks: state_dict_type, no_sync and summon_full_params ---------------------------------------------

    def visit_With(self, node: cst.With) -> None:
        if len(node.items) != 1 or not isinstance(node.items[0].item, cst.Call) or node.items[0].asname:
            return
        call = node.items[0].item
        if self.fsdp1(call.func) == summon.SUMMON:
            plan = summon.plan(call, node.body, self._is_container, self.code)
            if plan.problem is not None:
                where, what, why, fix = plan.problem
                self.report(where, what + (f" at line {self.line(plan.writes[0])}" if plan.writes else ""), why, fix)
            elif plan.call is not None:
                self.summons[node] = plan.call
                self.consumed.add(call)
            return
        if self.fsdp1(call.func) == f"{_FSDP}.state_dict_type":
            block = self._state_dict_block(call)
            if block is not None:
                for arg in call.args[2:]:  # configs assigned to a name used only here
                    if isinstance(arg.value, cst.Name):
                        self._drop_if_dead(arg.value.value)
                self.blocks.append(block)
                self.unwrap[node] = "state_dict"
                self.consumed.add(node.items[0])
            return
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == "no_sync" and not call.args:
            if self.code(func.value) in self.survey.models:
                self.unwrap[node] = self.code(func.value)
                self.consumed.add(node.items[0])

    def _is_container(self, name: str) -> bool:
        values = [value for _, value in self.survey.assigned.get(name, [])]
        return bool(values) and all(summon.is_container_value(v, self.code) for v in values)

    def leave_With(
        self, original: cst.With, updated: cst.With
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        if original in self.summons:
            self.need(RUNTIME, summon.HELPER)
            note = cst.EmptyLine(comment=cst.Comment(f"{NOTE} summon_full_params (the block only reads)"))
            item = updated.items[0].with_changes(item=self.summons[original])
            return updated.with_changes(items=[item], leading_lines=[*updated.leading_lines, note])
        kind = self.unwrap.get(original)
        if kind is None:
            return updated
        body = updated.body
        statements: list[cst.BaseStatement] = (
            list(body.body)
            if isinstance(body, cst.IndentedBlock)
            else [cst.SimpleStatementLine(body=cast(Sequence[cst.BaseSmallStatement], body.body))]
        )
        if kind == "state_dict":
            self.blocks.pop()
        else:  # no_sync: FSDP2 accumulates unreduced gradients while gradient sync is off
            off = cst.parse_statement(f"{kind}.set_requires_gradient_sync(False)  # was: with {kind}.no_sync():\n")
            on = cst.parse_statement(f"{kind}.set_requires_gradient_sync(True)\n")
            exits = (cst.Return, cst.Break, cst.Continue, cst.Raise)
            if any(self._contains(s, exits) for s in statements):
                trying = cst.Try(
                    body=cst.IndentedBlock(body=statements), finalbody=cst.Finally(body=cst.IndentedBlock(body=[on]))
                )
                statements = [off, trying]
            else:
                statements = [off, *statements, on]
        statements[0] = _with_leading(statements[0], list(updated.leading_lines))
        return cst.FlattenSentinel(statements)

    @staticmethod
    def _contains(node: cst.CSTNode, kinds: tuple[type, ...]) -> bool:
        found: list[bool] = []

        class _Find(cst.CSTVisitor):
            def on_visit(self, n: cst.CSTNode) -> bool:
                if isinstance(n, kinds):
                    found.append(True)
                return not isinstance(n, (cst.FunctionDef, cst.ClassDef))

        node.visit(_Find())
        return bool(found)

    def _state_dict_block(self, call: cst.Call) -> _StateDictBlock | None:
        """The options of `FSDP.state_dict_type(model, type, config, optim_config)` when FSDP2 has them (FULL with
        rank0_only and offload_to_cpu alike, SHARDED); None otherwise, which leaves the block to the report."""
        params = ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config")
        args: dict[str, cst.BaseExpression] = {}
        for index, arg in enumerate(call.args):
            if arg.star:
                return None
            key = arg.keyword.value if arg.keyword else params[index] if index < len(params) else ""
            args[key] = arg.value
        kind = self.fsdp1(args["state_dict_type"]) if "state_dict_type" in args else None
        if "module" not in args or kind not in ("StateDictType.FULL_STATE_DICT", "StateDictType.SHARDED_STATE_DICT"):
            return None
        full = kind == "StateDictType.FULL_STATE_DICT"
        options = []
        # FSDP1's default offload_to_cpu: off for the model's configs, on for the optimizer's.
        for key, cls, offload_default in (
            ("state_dict_config", "FullStateDictConfig" if full else "ShardedStateDictConfig", False),
            ("optim_state_dict_config", "FullOptimStateDictConfig" if full else "ShardedOptimStateDictConfig", True),
        ):
            flags = self._config(args.get(key), cls)
            if flags is None:
                return None
            # DSD's full + cpu_offload is FSDP1's rank0_only (on the CPU); its full alone is every rank's copy on the
            # device, where FSDP1's offload_to_cpu put it on the CPU: the same values either way.
            offload = flags.get("rank0_only", False) if full else flags.get("offload_to_cpu", offload_default)
            settings = (["full_state_dict=True"] if full else []) + (["cpu_offload=True"] if offload else [])
            options.append(f"StateDictOptions({', '.join(settings)})")
        return _StateDictBlock(self.code(args["module"]), options[0], options[1])

    def _config(self, node: cst.BaseExpression | None, cls: str) -> dict[str, bool] | None:
        if node is None or (isinstance(node, cst.Name) and node.value == "None"):
            return {}
        node = self.value_of(node)
        if not isinstance(node, cst.Call) or self.fsdp1(node.func) != cls:
            return None
        flags: dict[str, bool] = {}
        for arg in node.args:
            value = {"True": True, "False": False}.get(arg.value.value) if isinstance(arg.value, cst.Name) else None
            if arg.keyword is None or value is None or arg.keyword.value not in ("offload_to_cpu", "rank0_only"):
                return None
            flags[arg.keyword.value] = value
        return flags

    def _options(self, model: str, optim: bool = False) -> str:
        for block in reversed(self.blocks):
            if block.model == model:
                return block.optim_options if optim else block.model_options
        return _FULL

    # -- calls ---------------------------------------------------------------------------------------------------

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        """`model.module`, FSDP1's wrapped module, is the model itself under FSDP2."""
        if original.attr.value == "module" and self.code(original.value) in self.survey.models:
            self.consumed.add(original)
            return updated.value
        return updated

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        qualified = {q.name for q in self.get_metadata(QualifiedNameProvider, original.func, set())}
        if f"{RUNTIME}.apply_fully_shard" in qualified and len(original.args) > 1:
            given = original.args[1].value  # an FSDP1 policy is what apply_fully_shard takes (a migrated file)
            self.consumed.update({given, self.value_of(given)})
        name = self.fsdp1(original.func)
        rewritten: cst.BaseExpression | None = None
        if name == "MixedPrecision":
            policy, _, refused = construction.mixed_precision_policy(original, self.code)
            if refused:
                self.report(original, f"MixedPrecision({', '.join(refused)})", *_NO_COUNTERPART)
                return updated
            self.need(FSDP2, "MixedPrecisionPolicy")
            rewritten = self.expr(policy)
        elif name == "CPUOffload":
            rewritten = self._cpu_offload(original)
        elif name == f"{_FSDP}.optim_state_dict":
            rewritten = self._optim_state_dict(original)
        elif name == f"{_FSDP}.optim_state_dict_to_load":
            return updated  # rewritten with the statement or the load_state_dict call around it
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
            rewritten = self._method(original, updated)
        if rewritten is None:
            return updated
        self.consumed.add(original)
        return rewritten

    def _cpu_offload(self, call: cst.Call) -> cst.BaseExpression | None:
        flags = [(a.keyword.value if a.keyword else "offload_params", self.code(a.value)) for a in call.args]
        if len(flags) > 1 or any(k != "offload_params" or v not in ("True", "False") for k, v in flags):
            return None
        offload = bool(flags) and flags[0][1] == "True"
        self.need(FSDP2, "CPUOffloadPolicy" if offload else "OffloadPolicy")
        return self.expr("CPUOffloadPolicy()" if offload else "OffloadPolicy()")

    def _optim_state_dict(self, call: cst.Call) -> cst.BaseExpression | None:
        if len(call.args) != 2 or any(a.keyword or a.star for a in call.args):
            return None
        model, optim = (self.code(a.value) for a in call.args)
        self._need_helpers("get_optimizer_state_dict")
        return self.expr(f"get_optimizer_state_dict({model}, {optim}, options={self._options(model, optim=True)})")

    def _optim_load(self, call: cst.Call) -> cst.BaseExpression | None:
        """`FSDP.optim_state_dict_to_load(model, optim, osd)` as set_optimizer_state_dict, which loads as well."""
        if len(call.args) != 3 or any(a.keyword or a.star for a in call.args):
            return None
        model, optim, osd = (self.code(a.value) for a in call.args)
        self._need_helpers("set_optimizer_state_dict")
        self.consumed.add(call)
        options = self._options(model, optim=True)
        return self.expr(f"set_optimizer_state_dict({model}, {optim}, {osd}, options={options})")

    def _need_helpers(self, *names: str) -> None:
        for name in (*names, "StateDictOptions"):
            self.need(STATE_DICT_HELPERS, name)

    def _method(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression | None:
        func = original.func
        assert isinstance(func, cst.Attribute)
        receiver, method = self.code(func.value), func.attr.value
        args = [self.module.code_for_node(a) for a in updated.args]
        if method == "load_state_dict" and len(original.args) == 1:
            inner = original.args[0].value
            if isinstance(inner, cst.Call) and self.fsdp1(inner.func) == f"{_FSDP}.optim_state_dict_to_load":
                return self._optim_load(inner)
        if receiver not in self.survey.models:
            return None
        if method == "clip_grad_norm_":
            self.need("torch")
            return self.expr(f"torch.nn.utils.clip_grad_norm_({receiver}.parameters(), {', '.join(args)})")
        if method == "state_dict" and not args:
            self._need_helpers("get_model_state_dict")
            return self.expr(f"get_model_state_dict({receiver}, options={self._options(receiver)})")
        if method == "load_state_dict" and len(original.args) == 1 and not original.args[0].keyword:
            self._need_helpers("set_model_state_dict")
            return self.expr(f"set_model_state_dict({receiver}, {args[0]}, options={self._options(receiver)})")
        return None


def _with_leading(statement: cst.BaseStatement, lines: list[cst.EmptyLine]) -> cst.BaseStatement:
    """`statement` with `lines` (comments, blank lines) above its own."""
    assert isinstance(statement, (cst.SimpleStatementLine, cst.BaseCompoundStatement))
    return statement.with_changes(leading_lines=[*lines, *statement.leading_lines])


def _bare(statement: cst.SimpleStatementLine) -> str:
    return cst.Module([]).code_for_node(statement.with_changes(leading_lines=[])).strip()


class _RemoveStatements(cst.CSTTransformer):
    """Takes out the statements with the given code: a policy assignment is left before the construction that
    makes it dead is reached."""

    def __init__(self, codes: set[str]) -> None:
        super().__init__()
        self.codes = codes

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
        return cst.RemovalSentinel.REMOVE if _bare(updated) in self.codes else updated


_NO_COUNTERPART = ("FSDP2's MixedPrecisionPolicy has no counterpart", "set it per module by hand, or drop it")


def migrate_source(source: str) -> MigrationResult:
    """Rewrite one file's text; the findings are what is left to a person, by line of `source`."""
    wrapper = MetadataWrapper(cst.parse_module(source))
    survey = _Survey()
    wrapper.visit(survey)
    context = CodemodContext()
    transformer = Fsdp1ToFsdp2(wrapper.module, survey, context)
    tree = wrapper.visit(transformer)
    if transformer.removed:
        tree = tree.visit(_RemoveStatements(transformer.removed))
    if tree.code != source:
        for module, name, asname in survey.fsdp1_imports:
            RemoveImportsVisitor.remove_unused_import(context, module, name, asname)
        tree = AddImportsVisitor(context).transform_module(tree)
        tree = RemoveImportsVisitor(context).transform_module(tree)
    finder = LeftoverFinder(transformer.consumed, {f.line for f in transformer.findings})
    wrapper.visit(finder)
    findings = sorted(transformer.findings + finder.findings, key=lambda f: f.line)
    return MigrationResult(source, tree.code, findings)


__all__ = ["migrate_source"]
