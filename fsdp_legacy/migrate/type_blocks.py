"""Which `with FSDP.state_dict_type(model, ...):` blocks are taken away, and what becomes of their configs.

A block goes only when every call in it whose result its type decides is rewritten with the block's options:
`model.state_dict()` / `load_state_dict()` on the block's model (a parameter or an attribute as well), FSDP1's
optimizer-state calls. A call the rewrite did not map that may run under the type (a state-dict call on another
object, an FSDP1 call left in place, a call handed the model or an object holding it, a save or load this tool
cannot see into such as `trainer.save_model()`) keeps the block as it was, reported: taken away, such a call would
save or load something else under FSDP2 without a word. `Plan` decides before the rewrite, `readers` checks after it
(migrate_source reruns the rewrite with the blocks it keeps)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import libcst as cst
from libcst.metadata import Assignment, PositionProvider, QualifiedNameProvider

from . import run_time_blocks
from .bindings import Bindings
from .configs import Config
from .names import attribute_chain as _chain
from .names import fsdp1_name
from .state_dict_type import BLOCK, TypeOptions, parse

Code = Callable[[cst.CSTNode], str]

# nn.Module methods that read nothing of the state-dict type
_HARMLESS = frozenset(
    {"parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules", "children",
     "named_children", "eval", "train", "zero_grad"}
)  # fmt: skip
_SAVES_OR_LOADS = ("save", "load", "checkpoint", "state_dict")
# the options of a block no call under which reads its type (Lumina's LOCAL block around `opt.state_dict()`): any
# type, taken away as it is; no call takes these
NO_CALL = "StateDictOptions()"
# tensor-file writers and readers that see only the tensors handed to them (fsdp_qlora saves with save_file)
_TENSOR_FILES = frozenset(
    f"safetensors.torch.{name}" for name in ("save_file", "load_file", "save", "load")
)  # fmt: skip


@dataclass
class Plan:
    """The blocks taken away (with their options), those kept (why), and the config statements taken out or
    rebuilt at run time."""

    removed: dict[cst.With, TypeOptions] = field(default_factory=dict)
    kept: dict[cst.With, str] = field(default_factory=dict)
    configs: dict[cst.SimpleStatementLine, Config] = field(default_factory=dict)


class TypeBlocks(cst.CSTVisitor):
    """Visits the original tree: every state_dict_type block and its options."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider,)

    def __init__(self, code: Code, bindings: Bindings) -> None:
        super().__init__()
        self.code = code
        self.bindings = bindings
        self.blocks: dict[cst.With, tuple[cst.Call, TypeOptions | None]] = {}
        self.open: list[cst.With] = []  # the blocks decided at run time around the node visited
        self.taken: frozenset[str] = frozenset()  # every name the file uses

    def fsdp1(self, node: cst.CSTNode) -> str | None:
        names = [fsdp1_name(q.name) for q in self.get_metadata(QualifiedNameProvider, node, set())]
        return next((n for n in names if n), None)

    def visit_With(self, node: cst.With) -> None:
        item = node.items[0] if len(node.items) == 1 else None
        if item is None or item.asname or not isinstance(item.item, cst.Call) or self.fsdp1(item.item.func) != BLOCK:
            return
        options = parse(item.item, self.code, self.fsdp1, self.bindings)
        if options is None and not self.open:  # (one decided at run time inside another would rebind its names)
            options = run_time_blocks.parse(item.item, self.code, self.fsdp1, self.bindings, self.taken)
            if options is not None:
                self.open.append(node)
        call = item.item
        if options is None and call.args and not call.args[0].keyword and not any(a.star for a in call.args):
            model = self.code(call.args[0].value)
            if reads_nothing(_Reads(self, self.bindings, set()), node, model):
                options = TypeOptions(model, NO_CALL, NO_CALL, reads_nothing=True)  # nothing under it reads its type
        self.blocks[node] = (call, options)

    def leave_With(self, original_node: cst.With) -> None:
        if self.open and self.open[-1] is original_node:
            self.open.pop()

    def visit_Module(self, node: cst.Module) -> None:
        names: set[str] = set()

        class _Names(cst.CSTVisitor):
            def visit_Name(self, name: cst.Name) -> None:
                names.add(name.value)

        node.visit(_Names())
        self.taken = frozenset(names)

    def plan(self, keep: dict[cst.With, str]) -> Plan:
        """With the blocks of `keep` kept (why): a config rebuilt at run time must serve only blocks taken away, so
        a block sharing one with a block that stays stays too."""
        keep = dict(keep)
        while True:
            removed = {w: o for w, (_, o) in self.blocks.items() if o is not None and w not in keep}
            args = {a.value for w in removed for a in self.blocks[w][0].args}
            shared = {
                w: f"its config `{c.options}` is used elsewhere too (where it stays FSDP1's)"
                for w, o in removed.items()
                for c in o.configs
                if c.rewrite is not None and not set(c.rewrite.uses) <= args
            }
            if not shared:
                break
            keep.update(shared)
        configs = {c.rewrite.statement: c for o in removed.values() for c in o.configs if c.rewrite is not None}
        configs.update({c.drop.statement: c for o in removed.values() for c in o.configs if c.drop is not None})
        # (fsdp_qlora's `save_policy`, given to two blocks: out when both go, FSDP1's where one stays)
        named = [(c, c.named) for o in removed.values() for c in o.configs if c.drop is None and c.named is not None]
        configs.update({b.statement: replace(c, drop=b) for c, b in named if set(b.uses) <= args})
        return Plan(removed, keep, configs)


def related(chain: str, model: str) -> bool:
    """The model itself, an object it hangs from (`self` for `self._model`), or something inside it."""
    return chain == model or model.startswith(chain + ".") or chain.startswith(model + ".")


class _Calls(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[cst.Call] = []

    def visit_Call(self, node: cst.Call) -> None:
        self.calls.append(node)


class _Reads:
    """Whether a call may run under a state-dict type set on `model`: what a block's calls are checked for, on the
    tree as read (`consumed`: the calls the rewrite mapped, which read nothing of FSDP1's)."""

    def __init__(self, visitor: cst.MetadataDependent, bindings: Bindings, consumed: set[cst.CSTNode]) -> None:
        self.visitor, self.bindings, self.consumed = visitor, bindings, consumed

    def qualified(self, node: cst.CSTNode) -> set[str]:
        return {q.name for q in self.visitor.get_metadata(QualifiedNameProvider, node, set())}

    def optimizer(self, node: cst.BaseExpression) -> bool:
        """A torch optimizer, whose state_dict() no state-dict type touches: a name bound once to `torch.optim.X(
        ...)`, or a parameter annotated with a torch.optim class (`optimizer: torch.optim.Optimizer`)."""
        if not isinstance(node, cst.Name):
            return False
        scope = self.bindings.scopes.get(node)
        found = list(scope[node.value]) if scope is not None else []
        if len(found) != 1 or not isinstance(found[0], Assignment):
            return False
        bound = found[0].node
        if isinstance(bound, cst.Param):
            annotation = bound.annotation.annotation if bound.annotation else None
            return annotation is not None and any(q.startswith("torch.optim.") for q in self.qualified(annotation))
        binding = self.bindings.single(node)
        value = binding.value if binding is not None else None
        return isinstance(value, cst.Call) and any(q.startswith("torch.optim.") for q in self.qualified(value.func))

    def why(self, call: cst.Call, model: str) -> str | None:
        """Why `call` may read the type set on `model`; None where it cannot."""
        if call in self.consumed:
            return None
        qualified = self.qualified(call.func)
        func = call.func
        name = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
        torch = any(q.startswith("torch.") for q in qualified) or bool(qualified & _TENSOR_FILES)
        if any(fsdp1_name(q) for q in qualified):
            return "an FSDP1 call left in place"
        optimizer = isinstance(func, cst.Attribute) and self.optimizer(func.value)
        if name in ("state_dict", "load_state_dict") and not torch and not optimizer:
            return "a state-dict call not on the block's model, or not in a form this tool maps"
        if isinstance(func, cst.Attribute) and name not in _HARMLESS:
            receiver = _chain(func.value)
            if receiver is not None and related(receiver, model):
                return f"a call on `{receiver}`, which is or holds `{model}`"
        if any(self._mentions(arg.value, model) for arg in call.args):
            return f"a call handed `{model}` (or an object holding it)"
        if not torch and not optimizer and any(word in name.lower() for word in _SAVES_OR_LOADS):
            return "a save or load this tool cannot see into"
        return None

    def _mentions(self, node: cst.CSTNode, model: str) -> bool:
        """Whether `node` holds the model or an object related to it, outside the rewritten calls."""
        if node in self.consumed:
            return False
        chain = _chain(node)
        if chain is not None:
            return related(chain, model)
        return any(self._mentions(child, model) for child in node.children)


def torch_optimizer(visitor: cst.MetadataDependent, bindings: Bindings, node: cst.BaseExpression) -> bool:
    """Whether `node` is a torch optimizer the text shows (`_Reads.optimizer`)."""
    return _Reads(visitor, bindings, set()).optimizer(node)


# what a block may call and still read nothing of its type (besides an optimizer's state-dict calls): a block whose
# calls are all these and read nothing is taken away whatever its type (LOCAL included)
_PLAIN_CALLS = ("torch.", "builtins.", "os.", "logging.", "math.", "time.", "json.", "pathlib.")
_LOG_METHODS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical"})


def reads_nothing(reads: _Reads, block: cst.With, model: str) -> bool:
    """Whether no call under `block` can read the state-dict type it sets: each a plain library call (torch's,
    Python's own, a log line) or an optimizer's state_dict()/load_state_dict(), none handed the model."""
    if first_reader(reads, block, model) is not None:
        return False
    calls = _Calls()
    block.body.visit(calls)
    for call in calls.calls:
        func = call.func
        method = func.attr.value if isinstance(func, cst.Attribute) else ""
        if isinstance(func, cst.Attribute) and (method in _LOG_METHODS or reads.optimizer(func.value)):
            continue
        qualified = reads.qualified(func)
        if not qualified or not all(q.startswith(_PLAIN_CALLS) or q in _TENSOR_FILES for q in qualified):
            return False
    return True


def first_reader(reads: _Reads, block: cst.With, model: str) -> tuple[cst.Call, str] | None:
    """The first call in `block` that may run under the type it sets on `model`, and why."""
    calls = _Calls()
    block.body.visit(calls)
    for call in calls.calls:
        why = reads.why(call, model)
        if why is not None:
            return call, why
    return None


class Readers(cst.CSTVisitor):
    """Visits the original tree after a rewrite: for each block taken away (model code), the first call in it that
    may run under its type and was not rewritten (`consumed` holds the rewritten nodes)."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider)

    def __init__(
        self, removed: dict[cst.With, str], consumed: set[cst.CSTNode], code: Code, bindings: Bindings
    ) -> None:
        super().__init__()
        self.removed = removed
        self.reads = _Reads(self, bindings, consumed)
        self.code = code
        self.found: dict[cst.With, str] = {}

    def visit_With(self, node: cst.With) -> None:
        model = self.removed.get(node)
        found = first_reader(self.reads, node, model) if model is not None else None
        if found is not None:
            call, why = found
            line = self.get_metadata(PositionProvider, call).start.line
            self.found[node] = f"`{self.code(call.func)}(...)` at line {line} may run under the type it sets ({why})"
