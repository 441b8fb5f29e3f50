"""`with enable_wrap(wrapper_cls=FSDP, **kwargs): ... wrap(module, **overrides) ...` as fully_shard calls.

Inside the context FSDP1's `wrap(m)` is `FSDP(m, **{**kwargs, **overrides})`; outside it, `m` unchanged. FSDP2
shards a module in place and `fully_shard` returns it, so each `wrap(m)` becomes `fully_shard(m, **wrap_kwargs)`
where it stands (the same modules, in the same order: arguments first) and the with-statement becomes its body after
`wrap_kwargs = {...}` (FSDP1's keywords as fully_shard's, construction.unit_keywords). An override is merged with the
context's keywords as FSDP1 merges them, before mapping. Whether a wrap() runs inside the context is known only from
the text, so every wrap() of the file must be written inside an enable_wrap block (not in a function, class or
lambda defined there), and wrap/enable_wrap used only so; otherwise nothing of theirs is rewritten."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from .construction import FSDP2, NOTE, Problem, Resolve, unit_keywords
from .names import fsdp1_name
from .report import Finding

WRAP, ENABLE = "wrap", "enable_wrap"
KWARGS, MESH = "wrap_kwargs", "wrap_mesh"  # the names the rewrite binds
_FIX = "call `fully_shard(module, ...)` (FSDP2's keywords) on each module wrap() wrapped, children first"


@dataclass
class WrapPlan:
    """What the rewriter does: each enable_wrap block's header statements (they replace the with line, its body
    follows), each wrap() call's new keyword arguments, and the imports; or, with findings, nothing."""

    headers: dict[cst.With, tuple[list[str], list[str]]] = field(default_factory=dict)  # (comments, statements)
    calls: dict[cst.Call, list[str]] = field(default_factory=dict)
    imports: list[tuple[str, str | None]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    consumed: set[cst.CSTNode] = field(default_factory=set)
    kept: set[cst.Call] = field(default_factory=set)  # calls to leave exactly as written (their arguments too)


class ManualWrap(cst.CSTVisitor):
    """Visits the original tree and makes the plan (`plan`) once it has seen the whole file."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider)

    def __init__(self, code: Callable[[cst.CSTNode], str], resolve: Resolve) -> None:
        super().__init__()
        self.code = code
        self.value_of = resolve
        self.plan = WrapPlan()
        self.context: list[cst.With | None] = []  # enable_wrap blocks around the node; None: a function between
        self.blocks: list[cst.With] = []
        self.enable_funcs: set[cst.CSTNode] = set()
        self.calls: list[tuple[cst.Call, cst.With | None]] = []
        self.references: list[cst.CSTNode] = []  # every name of wrap / enable_wrap
        self.modules: set[cst.CSTNode] = set()  # the values of attributes read (a module imported as a name)
        self.problems: list[Problem] = []
        self.overrides: list[Problem] = []  # FSDP1's per-module overrides of wrap()'s keywords

    def fsdp1(self, node: cst.CSTNode) -> str | None:
        names = [fsdp1_name(q.name) for q in self.get_metadata(QualifiedNameProvider, node, set())]
        return next((n for n in names if n), None)

    # -- the survey ----------------------------------------------------------------------------------------------

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            self.context.append(None)
        if (
            isinstance(node, (cst.Name, cst.Attribute))
            and node not in self.modules
            and self.fsdp1(node) in (WRAP, ENABLE)
        ):
            self.references.append(node)
            return False
        if isinstance(node, cst.Attribute):  # `torch_wrap.lambda_auto_wrap_policy`: the module wrap.py, not wrap()
            self.modules.add(node.value)
        if isinstance(node, cst.Attribute) and node.attr.value == "_wrap_overrides":
            why = "a module's _wrap_overrides win over wrap()'s keywords at run time, which the text does not show"
            self.overrides.append(Problem(node, "`_wrap_overrides`", why, ""))
        return super().on_visit(node)

    def on_leave(self, original_node: cst.CSTNode) -> None:
        if isinstance(original_node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            self.context.pop()
        super().on_leave(original_node)

    def visit_With(self, node: cst.With) -> None:
        calls = [i.item for i in node.items if isinstance(i.item, cst.Call) and self.fsdp1(i.item.func) == ENABLE]
        if not calls:
            return
        self.enable_funcs.update(call.func for call in calls)
        if len(node.items) != 1 or node.items[0].asname is not None:
            self.problems.append(Problem(node, "enable_wrap(...) beside other context managers or with `as`", "", ""))
        elif any(self.context):
            self.problems.append(Problem(node, "nested enable_wrap(...)", "FSDP1 raises NotImplementedError", ""))
        self.blocks.append(node)
        self.context.append(node)

    def leave_With(self, original_node: cst.With) -> None:
        if self.context and self.context[-1] is original_node:
            self.context.pop()

    def visit_Call(self, node: cst.Call) -> None:
        if self.fsdp1(node.func) == WRAP:
            self.calls.append((node, self.context[-1] if self.context else None))

    def leave_Module(self, original_node: cst.Module) -> None:
        if self.blocks or self.calls or self.references:
            self.problems += self.overrides
            self._decide()

    # -- the plan ------------------------------------------------------------------------------------------------

    def _decide(self) -> None:
        headers = {block: self._header(block) for block in self.blocks}
        calls = {}
        for call, block in self.calls:
            if block is None or block not in headers:
                why = "it is not written inside an enable_wrap block, and whether it runs inside one is not known"
                self.problems.append(Problem(call, "wrap() outside an enable_wrap block", why, ""))
                continue
            context, kwargs, pre, _ = headers[block]
            calls[call] = self._call(call, context, kwargs, pre)
        handled = {call.func for call, _ in self.calls} | self.enable_funcs
        for node in self.references:
            if node not in handled:
                why = "used other than by calling it, so the modules it wraps are not known"
                self.problems.append(Problem(node, f"`{self.code(node)}` passed or bound", why, ""))
        if self.problems:
            for problem in self.problems:
                line = self.get_metadata(PositionProvider, problem.node).start.line
                why = problem.why or "not mapped by fsdp-legacy migrate"
                self.plan.findings.append(Finding(line, problem.what, why, problem.fix or _FIX))
                self.plan.consumed.add(problem.node)
            # a MixedPrecision(...) among their arguments stays FSDP1's as well
            items = [item.item for block in self.blocks for item in block.items]
            self.plan.kept = {call for call, _ in self.calls} | {i for i in items if isinstance(i, cst.Call)}
            return
        for block, (_, kwargs, pre, notes) in headers.items():
            self.plan.headers[block] = (notes, [*pre] + ([KWARGS + " = {" + _items(kwargs) + "}"] if kwargs else []))
            self.plan.consumed.add(block.items[0])
        for call, keywords in calls.items():
            self.plan.calls[call] = keywords
            self.plan.consumed.update([call.func, *(a for a in call.args[1:])])
        self.plan.imports.append((FSDP2, "fully_shard"))

    def _header(self, block: cst.With) -> tuple[dict[str, cst.Arg], dict[str, str], list[str], list[str]]:
        """The context's keywords (FSDP1's, by name), the fully_shard keywords they map to, the statements that
        build them (a mesh) and the comments."""
        item = block.items[0].item
        if len(block.items) != 1 or not isinstance(item, cst.Call):
            return {}, {}, [], []  # reported when visited
        context: dict[str, cst.Arg] = {}
        wrapper = None
        for arg in item.args:
            if arg.keyword is None or arg.star:
                self.problems.append(Problem(arg, "enable_wrap(...) with positional or ** arguments", "", ""))
            elif arg.keyword.value == "wrapper_cls":
                wrapper = arg.value
            else:
                context[arg.keyword.value] = arg
        if wrapper is None or self.fsdp1(wrapper) != "FullyShardedDataParallel":
            why = "its wrapper_cls is not FSDP1's FullyShardedDataParallel"
            self.problems.append(Problem(item, "enable_wrap(wrapper_cls=...)", why, ""))
        mapped = unit_keywords(list(context.values()), self.code, self.fsdp1, self.value_of, MESH)
        self.problems += mapped.problems
        self.plan.imports += mapped.imports
        notes = [f"{NOTE} enable_wrap(...) became fully_shard's keywords ({KWARGS}), each wrap(m) fully_shard(m)"]
        notes += [f"{NOTE} {note}" for note in mapped.notes]
        return context, mapped.kwargs, mapped.pre, notes

    def _call(self, call: cst.Call, context: dict[str, cst.Arg], kwargs: dict[str, str], pre: list[str]) -> list[str]:
        """fully_shard's keyword arguments for one wrap(module, **overrides), as code."""
        if not call.args or call.args[0].keyword is not None or call.args[0].star:
            self.problems.append(Problem(call, "wrap() without the module as first argument", "", ""))
            return []
        overrides = call.args[1:]
        if not overrides:
            return [f"**{KWARGS}"] if kwargs else []
        merged = dict(context)
        for arg in overrides:
            if arg.keyword is None or arg.star:
                self.problems.append(Problem(arg, "wrap() with positional or ** overrides", "", ""))
                return []
            merged[arg.keyword.value] = arg
        mapped = unit_keywords(list(merged.values()), self.code, self.fsdp1, self.value_of, MESH)
        self.problems += mapped.problems
        self.plan.imports += mapped.imports
        if mapped.pre != pre:
            why = "the override needs a mesh of its own (a process group or hybrid strategy the context lacks)"
            self.problems.append(Problem(call, "wrap(..., overrides)", why, ""))
        if mapped.kwargs == kwargs:
            return [f"**{KWARGS}"] if kwargs else []
        return [f"{key}={value}" for key, value in mapped.kwargs.items()]


def _items(kwargs: dict[str, str]) -> str:
    return ", ".join(f'"{key}": {value}' for key, value in kwargs.items())
