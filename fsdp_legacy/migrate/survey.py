"""What the rewrite needs to know about a whole file before it changes anything (rewriter.py reads it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import cast

import libcst as cst
from libcst.metadata import QualifiedNameProvider

from .names import FSDP1_IMPORT_MODULES, fsdp1_name
from .narrowed import BoundChains
from .partials import is_fsdp_partial
from .returned_model import Builders, Parents, builders

_FSDP = "FullyShardedDataParallel"
_AC = "apply_activation_checkpointing"


def is_checkpointing(qualified: set[str]) -> bool:
    """Whether a callee's qualified names are torch's apply_activation_checkpointing."""
    return any(q == _AC or q.endswith("." + _AC) for q in qualified)


_RUN_TIME_MAPPERS = frozenset(
    f"fsdp_legacy.migrate.runtime.{name}" for name in ("fully_shard_fsdp1", "fsdp1_options", "apply_fully_shard")
)


class Survey(cst.CSTVisitor):
    """What the rewrite needs to know about the whole file first: the wrapped models' names, single assignments
    (to read a policy or a config assigned to a name), how often each name occurs, the FSDP1 imports, the functions
    that apply activation checkpointing, and whether the file names the meta device."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider,)

    def __init__(self) -> None:
        super().__init__()
        self.models: set[str] = set()
        self.assigned: dict[str, list[tuple[cst.SimpleStatementLine, cst.BaseExpression]]] = {}
        self.bindings = BoundChains(every=True)  # every binding of each name (assigned: the `name = value` ones)
        self.name_count: Counter[str] = Counter()  # each name's uses (not as a keyword or an attribute)
        self.attribute_count: Counter[str] = Counter()  # each attribute name's reads (`self._policy()`)
        self.fsdp1_imports: list[tuple[str, str, str | None]] = []
        self.checkpointing_functions: set[str] = set()
        self.functions: dict[str, list[cst.FunctionDef]] = {}  # every def of the file (any depth), by name
        self.meta = False
        self.fsdp_calls: list[cst.Call] = []  # every FSDP(...) call
        # those the rewriter maps: `target = FSDP(...)` -> target, `return FSDP(...)` -> the module's name (builders)
        self.constructions: dict[cst.Call, str] = {}
        # the statements that bind a name to the wrapped model: `model = FSDP(...)`, `model = build(...)` (builders)
        self.wrapping: set[cst.SimpleStatementLine] = set()
        self.fsdp_partials: list[cst.Call] = []  # every `partial(FSDP, ...)` (partials.py)
        # a migrated file's fully_shard_fsdp1(...), fsdp1_options(...), apply_fully_shard(...): FSDP1's values (its
        # policies, precision and offload objects), read at run time
        self.runs_fsdp1_calls = False
        self.builders = Builders()  # functions returning the wrapped model to their callers (follow_builders)

    def visit_Module(self, node: cst.Module) -> None:
        node.visit(self.bindings)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        """A function that only applies activation checkpointing (besides local names, prints and its docstring)
        can move with its call; one that does more cannot."""
        self.functions.setdefault(node.name.value, []).append(node)
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
            if is_checkpointing(self._qualified(func)):
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
                    self.wrapping.add(node)
                    if len(node.body) == 1:
                        self.constructions[small.value] = cst.Module([]).code_for_node(target)

    def visit_Call(self, node: cst.Call) -> None:
        if self._is_fsdp(node.func):
            self.fsdp_calls.append(node)
        if is_fsdp_partial(node, self._qualified):
            self.fsdp_partials.append(node)
        self.runs_fsdp1_calls |= bool(self._qualified(node.func) & _RUN_TIME_MAPPERS)

    def visit_Name(self, node: cst.Name) -> None:
        self.name_count[node.value] += 1

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:  # (`mixed_precision=mixed_precision`: the keyword is no use of the name)
            self.name_count[node.keyword.value] -= 1

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.name_count[node.attr.value] -= 1  # (`cfg.mixed_precision`: another name)
        self.attribute_count[node.attr.value] += 1

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        module = cst.Module([]).code_for_node(node.module) if node.module else ""
        if module in FSDP1_IMPORT_MODULES and not isinstance(node.names, cst.ImportStar):
            for alias in node.names:
                asname = alias.asname.name.value if alias.asname and isinstance(alias.asname.name, cst.Name) else None
                self.fsdp1_imports.append((module, cst.Module([]).code_for_node(alias.name), asname))

    def _is_fsdp(self, node: cst.CSTNode) -> bool:
        return any(fsdp1_name(q.name) == _FSDP for q in self.get_metadata(QualifiedNameProvider, node, set()))

    def follow_builders(self, parents: Parents, module: cst.Module, exported: Mapping[str, str]) -> None:
        """After the visit: the names callers bind a returned wrapped model to are models too, and each mapped
        `return FSDP(...)` a construction (returned_model.py)."""
        self.builders = builders(self.fsdp_calls, self.constructions, parents, module, exported)
        self.models |= self.builders.models
        self.wrapping |= self.builders.sites
        self.constructions.update(self.builders.returned)
        for call in self.builders.refused:  # a model escaping where the text does not follow: it stays FSDP1's
            self.constructions.pop(call, None)

    def value_of(self, node: cst.BaseExpression) -> cst.BaseExpression:
        """A name the file assigns exactly once (`name = value`) and binds in no other way, as its value; anything
        else as it is (t5_11 binds `mp_policy` by unpacking a tuple, then `mp_policy = None` under a flag: its
        `mixed_precision=mp_policy` is not the None of the second)."""
        if (
            isinstance(node, cst.Name)
            and len(self.assigned.get(node.value, [])) == self.bindings.bound[node.value] == 1
        ):
            return self.assigned[node.value][0][1]
        return node
