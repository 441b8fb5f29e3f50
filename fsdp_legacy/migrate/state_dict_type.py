"""FSDP1's state-dict types as the `StateDictOptions` of torch.distributed.checkpoint.state_dict.

`with FSDP.state_dict_type(model, type, config, optim_config):` gives the calls in its block their options (the
rewriter keeps a stack of blocks). `FSDP.set_state_dict_type(model, ...)` sets them for the rest of the run, which
the text shows only in simple cases: SetTypes follows a setter to the calls it governs where that is unambiguous
(one setter for the model, configs it can read, and every state-dict call on the model after it in its own block,
not in a nested function, the model not rebound there; or, where the function holding it returns the model, after
each `name = function(...)` of the file, returned_model.py). Anywhere else the setter and the calls it may govern stay
as they are and are reported, and so does the rest of the file (the rewriter refuses it as a whole): mapped with
FSDP1's default type instead, the calls would save or load something else, and FSDP1's setter on a fully_shard model
fails."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import libcst as cst
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider

from . import configs
from .bindings import Bindings
from .configs import Config
from .names import fsdp1_name
from .reorder import bound_names, names_in
from .report import Finding
from .returned_model import Sites, returned

_FSDP = "FullyShardedDataParallel."
BLOCK = _FSDP + "state_dict_type"
SETTER = _FSDP + "set_state_dict_type"
# Calls whose result depends on the model's state-dict type (the legacy optimizer API ignores it).
_STATIC_USES = (_FSDP + "optim_state_dict", _FSDP + "optim_state_dict_to_load")
_METHOD_USES = ("state_dict", "load_state_dict")
_PARAMS = ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config")

Code = Callable[[cst.CSTNode], str]
Fsdp1 = Callable[[cst.CSTNode], "str | None"]


@dataclass(frozen=True)
class TypeOptions:
    """A state-dict type for one model, as the StateDictOptions code of its model and optimizer calls, and what
    becomes of the configs it was given as names (configs.py)."""

    model: str
    model_options: str
    optim_options: str
    full: bool = False
    configs: tuple[Config, ...] = ()
    run_time: str = ""  # a block decided at run time: the helper call that gives both options (run_time_blocks.py)
    data: tuple[cst.CSTNode, ...] = ()  # (and the FSDP1 configs it reads, kept as they are)
    reads_nothing: bool = False  # a block no call under which reads its type (type_blocks.py's NO_CALL options)


def parse(call: cst.Call, code: Code, fsdp1: Fsdp1, bindings: Bindings | None = None) -> TypeOptions | None:
    """The options of `FSDP.state_dict_type(model, type, config, optim_config)` (or set_state_dict_type's) when FSDP2
    has them (FULL, SHARDED); None otherwise. Without `bindings`, only configs written inline with literal values."""
    args: dict[str, cst.BaseExpression] = {}
    for index, arg in enumerate(call.args):
        if arg.star:
            return None
        key = arg.keyword.value if arg.keyword else _PARAMS[index] if index < len(_PARAMS) else ""
        args[key] = arg.value
    kind = fsdp1(args["state_dict_type"]) if "state_dict_type" in args else None
    if "module" not in args or kind not in ("StateDictType.FULL_STATE_DICT", "StateDictType.SHARDED_STATE_DICT"):
        return None
    full = kind == "StateDictType.FULL_STATE_DICT"
    found = []
    # FSDP1's default offload_to_cpu: off for the model's configs, on for the optimizer's.
    for key, cls, offload_default in (
        ("state_dict_config", "FullStateDictConfig" if full else "ShardedStateDictConfig", False),
        ("optim_state_dict_config", "FullOptimStateDictConfig" if full else "ShardedOptimStateDictConfig", True),
    ):
        config = configs.read(args.get(key), cls, offload_default, fsdp1, bindings)
        if config is None:
            return None
        found.append(config)
    return TypeOptions(code(args["module"]), found[0].options, found[1].options, full, tuple(found))


class SetTypes(cst.CSTVisitor):
    """Visits the original tree: every set_state_dict_type and every call its type may govern, by model (its code).
    Then `governed` (call -> the options it takes), `followed` (setter statements to take out) and `findings` (with
    `left`, the nodes they account for) say what the rewriter does."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider, ParentNodeProvider, PositionProvider)

    def __init__(self, code: Code, bindings: Bindings, exported: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.code = code
        self.bindings = bindings
        self.exported = exported or {}  # names other files may call (returned_model.py does not follow there)
        self.setters: dict[str, list[cst.Call]] = {}
        self.uses: dict[str, list[cst.Call]] = {}
        self.explicit: list[str | None] = []  # the models of the state_dict_type blocks around the node visited
        self.governed: dict[cst.Call, TypeOptions] = {}
        self.followed: dict[cst.SimpleStatementLine, tuple[cst.Call, TypeOptions]] = {}
        self.findings: list[Finding] = []
        self.left: set[cst.CSTNode] = set()
        # followed setters in a function that returns the model -> its name (returned_model.py)
        self.returned_to: dict[cst.SimpleStatementLine, str] = {}
        self.module = cst.Module([])  # the tree visited (set on leaving it)

    def fsdp1(self, node: cst.CSTNode) -> str | None:
        names = [fsdp1_name(q.name) for q in self.get_metadata(QualifiedNameProvider, node, set())]
        return next((n for n in names if n), None)

    def visit_With(self, node: cst.With) -> None:
        item = node.items[0].item if len(node.items) == 1 else None
        model = None
        if isinstance(item, cst.Call) and self.fsdp1(item.func) == BLOCK and item.args and not item.args[0].keyword:
            model = self.code(item.args[0].value)
        self.explicit.append(model)

    def leave_With(self, original_node: cst.With) -> None:
        self.explicit.pop()

    def visit_Call(self, node: cst.Call) -> None:
        name = self.fsdp1(node.func)
        first = node.args[0] if node.args and not node.args[0].star else None
        model = None
        if name == SETTER and first is not None:
            self.setters.setdefault(self.code(first.value), []).append(node)
            return
        if name in _STATIC_USES and first is not None and first.keyword is None:
            model = self.code(first.value)
        elif isinstance(node.func, cst.Attribute) and node.func.attr.value in _METHOD_USES:
            model = self.code(node.func.value)
        if model is not None and model not in self.explicit:
            self.uses.setdefault(model, []).append(node)

    def leave_Module(self, original_node: cst.Module) -> None:
        self.module = original_node
        for model, setters in self.setters.items():
            self._decide(model, setters, self.uses.get(model, []))

    def _decide(self, model: str, setters: list[cst.Call], uses: list[cst.Call]) -> None:
        setter = setters[0]
        statement = self._statement(setter)
        options = parse(setter, self.code, self.fsdp1, self.bindings)
        if options is not None and any(c.rewrite for c in options.configs):
            options = None  # (a computed config: only a block's is rebuilt at run time)
        why = None
        if len(setters) > 1:
            why = f"the type of `{model}` is set {len(setters)} times (lines {self._lines(setters)})"
        elif statement is None:
            why = "its result (the settings before it) is used"
        elif options is None:
            why = (
                "its type or configs are not ones this tool maps faithfully (LOCAL, positional or computed configs, "
                "offload_to_cpu without rank0_only)"
            )
        sites: Sites | str | None = None
        if why is None and statement is not None:
            sites = returned(statement, model, self.bindings.parents, self.module, self.exported)
            if isinstance(sites, Sites):  # the caller's calls on what it receives take the type too
                uses = uses + [
                    u for s in sites.statements if sites.target(s) != model for u in self.uses.get(sites.target(s), [])
                ]
            outside = [use for use in uses if not self._covered(use, statement, sites)]
            if isinstance(sites, str):
                why = sites
            elif outside:
                why = (
                    f"state-dict calls on `{model}` at lines {self._lines(outside)} are not after it in its block "
                    "(before it, in another function, or in a nested one): which type they run under depends on "
                    "the run"
                )
            elif names_in(cst.parse_expression(model)) & self._bound_after(statement):
                why = f"`{model}` is bound again after it"
            elif isinstance(sites, Sites):
                rebound = [s for s in sites.statements if sites.target(s) in self._bound_after(s)]
                if rebound:
                    why = f"`{sites.target(rebound[0])}` is bound again after `{self.code(rebound[0].body[0])}`"
        if why is None:
            assert statement is not None and options is not None
            self.followed[statement] = (setter, options)
            if isinstance(sites, Sites):
                self.returned_to[statement] = sites.function
            self.governed.update(dict.fromkeys(uses, options))
            return
        fix = "use `get_/set_model_state_dict` and `get_/set_optimizer_state_dict` with `StateDictOptions` at each call"
        why += (
            "; the file is left as it is, as a whole: the model must stay FSDP1 for its type to hold, and every call "
            "on it with it"
        )
        for node in setters:
            self._report(node, f"FSDP.set_state_dict_type({model}, ...)", why, fix)
        for use in uses:
            what = f"state-dict call on `{model}`, whose type FSDP.set_state_dict_type may set"
            why = f"the setter (line {self._line(setter)}) is left as it is, and so is this call"
            self._report(use, what, why, fix)

    def _statement(self, call: cst.Call) -> cst.SimpleStatementLine | None:
        """The statement holding `call` alone, its value unused, directly in a block."""
        expr = self.get_metadata(ParentNodeProvider, call)
        line = self.get_metadata(ParentNodeProvider, expr) if isinstance(expr, cst.Expr) else None
        if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
            if isinstance(self.get_metadata(ParentNodeProvider, line), (cst.IndentedBlock, cst.Module)):
                return line
        return None

    def _covered(self, use: cst.Call, setter: cst.SimpleStatementLine, sites: Sites | str | None) -> bool:
        """Whether the type set by `setter` governs `use`: after it in its block, or, for a model the function
        returns, after a call site whose target the use is on."""
        if self._after(use, setter):
            return True
        if not isinstance(sites, Sites):
            return False
        receiver = (
            use.func.value if isinstance(use.func, cst.Attribute) and use.func.attr.value in _METHOD_USES else None
        )
        on = self.code(receiver) if receiver is not None else self.code(use.args[0].value) if use.args else ""
        return any(sites.target(s) == on and self._after(use, s) for s in sites.statements)

    def _after(self, node: cst.CSTNode, statement: cst.SimpleStatementLine) -> bool:
        """Whether `node` runs after `statement` whenever it runs: within a later statement of the same block, not
        inside a function, class or lambda defined there."""
        owner = cast(cst.IndentedBlock | cst.Module, self.get_metadata(ParentNodeProvider, statement))
        body = list(owner.body)
        while True:
            parent = self.get_metadata(ParentNodeProvider, node, None)
            if parent is None or isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                return False
            if parent is owner:
                return any(node is s for s in body[body.index(statement) + 1 :])
            node = parent

    def _bound_after(self, statement: cst.SimpleStatementLine) -> set[str]:
        body = list(cast(cst.IndentedBlock | cst.Module, self.get_metadata(ParentNodeProvider, statement)).body)
        return {name for s in body[body.index(statement) + 1 :] for name in bound_names(s)}

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def _lines(self, nodes: list[cst.Call]) -> str:
        return ", ".join(str(self._line(n)) for n in nodes)

    def _report(self, node: cst.CSTNode, what: str, why: str, fix: str) -> None:
        self.findings.append(Finding(self._line(node), what, why, fix, "refused"))
        self.left.add(node)
