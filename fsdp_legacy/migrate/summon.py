"""`with FSDP.summon_full_params(model, ...):` over a block that only reads becomes `with full_params(model, ...):`
(runtime.py, the same keywords). A block that may write to what it gathered stays as it was and is reported: FSDP2
has nothing that writes full parameters back into the shards.

Which statements write is decided from the text, erring towards "writes": an in-place call (a name ending in `_`,
`copy_`, `add_`, `nn.init.zeros_`), a call known to change a module's tensors (`load_state_dict`, `setattr`, ...),
an assignment or `del` to an attribute (`p.data = ...`) or an item (`p[0] = ...`) unless the item's container is a
dict or list the file builds. What the text hides (a write in a called function) is caught by `full_params` itself,
which fails rather than drop a write."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import libcst as cst

SUMMON = "FullyShardedDataParallel.summon_full_params"
HELPER = "full_params"  # fsdp_legacy.migrate.runtime's counterpart
PARAMS = ("module", "recurse", "writeback", "rank0_only", "offload_to_cpu", "with_grads")

# Calls that change a module's tensors without the trailing underscore of torch's in-place ops.
_WRITING_CALLS = frozenset(
    {
        "setattr",
        "load_state_dict",
        "register_parameter",
        "register_buffer",
        "to_empty",
        "vector_to_parameters",
        "apply",
        "_apply",
    }
)


@dataclass
class SummonPlan:
    """What to do with one summon_full_params block: rewrite its call (`call`), or report `problem` at `node`."""

    call: cst.Call | None = None
    problem: tuple[cst.CSTNode, str, str, str] | None = None
    writes: list[cst.CSTNode] = field(default_factory=list)


Code = Callable[[cst.CSTNode], str]


def plan(call: cst.Call, body: cst.CSTNode, is_container: Callable[[str], bool], code: Code) -> SummonPlan:
    """The rewrite of `with <call>: <body>` or why there is none."""
    args: list[cst.Arg] = []
    for index, arg in enumerate(call.args):
        key = arg.keyword.value if arg.keyword else PARAMS[index] if index < len(PARAMS) else None
        if arg.star or key is None:
            why = "its arguments cannot be read from the source"
            return SummonPlan(problem=(call, "summon_full_params(*args/**kwargs)", why, _READ_FIX))
        if key == "with_grads":
            if isinstance(arg.value, cst.Name) and arg.value.value == "False":
                continue
            why = "FSDP2 keeps gradients sharded as DTensors; gathering them with the parameters is not mapped"
            fix = "read `p.grad.full_tensor()` of each DTensor parameter instead"
            return SummonPlan(problem=(call, f"summon_full_params({code(arg)})", why, fix))
        args.append(arg.with_changes(comma=cst.MaybeSentinel.DEFAULT))
    if not args:
        return SummonPlan(problem=(call, "summon_full_params() without a module", "nothing to gather", _READ_FIX))
    finder = _WriteFinder(is_container)
    body.visit(finder)
    if finder.writes:
        write = code(finder.writes[0]).strip().splitlines()[0]
        what = f"summon_full_params over a block that writes (`{write}`)"
        why = (
            "FSDP2 cannot write full parameters back into their shards, and a write to the gathered copies would be "
            "lost silently"
        )
        fix = (
            "change each DTensor parameter's local shard (`p.to_local()`, under torch.no_grad()), or edit a full "
            "state dict (get_model_state_dict(..., options=StateDictOptions(full_state_dict=True))) and load it "
            "back with set_model_state_dict; a block that only reads becomes fsdp_legacy.migrate.runtime.full_params"
        )
        return SummonPlan(problem=(call, what, why, fix), writes=finder.writes)
    return SummonPlan(call=call.with_changes(func=cst.Name(HELPER), args=args))


_READ_FIX = "gather with fsdp_legacy.migrate.runtime.full_params(model, ...) (the same keywords) for reading"


class _WriteFinder(cst.CSTVisitor):
    def __init__(self, is_container: Callable[[str], bool]) -> None:
        super().__init__()
        self.is_container = is_container
        self.writes: list[cst.CSTNode] = []

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        name = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
        if (name.endswith("_") and not name.endswith("__")) or name in _WRITING_CALLS:
            self.writes.append(node)

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            self._target(target.target, node)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self._target(node.target, node)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._target(node.target, node)  # `p += 1` on a plain name is caught by full_params when it is a parameter

    def visit_Del(self, node: cst.Del) -> None:
        self._target(node.target, node)

    def _target(self, target: cst.BaseExpression, statement: cst.CSTNode) -> None:
        if isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                self._target(element.value, statement)
        elif isinstance(target, cst.Attribute):
            self.writes.append(statement)
        elif isinstance(target, cst.Subscript):
            base = target.value
            if not (isinstance(base, cst.Name) and self.is_container(base.value)):
                self.writes.append(statement)


_CONTAINER_CALLS = frozenset({"dict", "list", "set", "OrderedDict", "defaultdict", "collections.OrderedDict"})


def is_container_value(value: cst.BaseExpression, code: Code) -> bool:
    """Whether an assigned value is a new dict, list or set (so item assignments to it write no tensor)."""
    if isinstance(value, (cst.Dict, cst.List, cst.Set, cst.DictComp, cst.ListComp, cst.SetComp)):
        return True
    return isinstance(value, cst.Call) and code(value.func) in _CONTAINER_CALLS
