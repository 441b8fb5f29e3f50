"""Calls and attributes on the wrapped model (the transformer's `leave_Call` / `leave_Attribute` ask here):
`clip_grad_norm_`, `apply`, `no_sync()` used as a value, `state_dict()` / `load_state_dict(sd, strict=...)`.

A model is known wrapped where the file wraps it (`model = FSDP(...)`), inside a state_dict_type block on it, or
in a function that hands it to such a block (a parameter or an attribute the function does not rebind: fms-fsdp's
`Checkpointer.load(model, ...)` loads a single-file checkpoint with `model.load_state_dict(sd, strict=strict)`
outside its SHARDED blocks). `model._orig_mod` (torch.compile's module) is the model it compiled. Outside a block,
FSDP1 gives its current state-dict type: its default, FULL on every rank, unless the program sets another with
`set_state_dict_type`, which a function's parameter cannot be followed to; then the call is reported."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import libcst as cst
from libcst.metadata import ParentNodeProvider

from . import apply_call, beside, summon
from .construction import FSDP2, RUNTIME
from .maybe_wrapped import FSDP_MODULE, before_wrapping, guarded, surely_wrapped
from .narrowed import BoundChains

if TYPE_CHECKING:
    from .transformer import Fsdp1ToFsdp2

# FSDP1's own attributes: on an FSDP1 instance they shadow the module's; under FSDP2 the model is the module.
FSDP1_ATTRIBUTES = frozenset(
    {"process_group", "sharding_strategy", "mixed_precision", "cpu_offload", "compute_device", "training_state",
     "use_orig_params", "limit_all_gathers", "backward_prefetch", "forward_prefetch"}
)  # fmt: skip
NO_SYNC = "without_gradient_sync"  # fsdp_legacy.migrate.runtime's no_sync() as a context manager
_COMPILED = "._orig_mod"


class _Blocks(BoundChains):
    """In a function: the models of its state_dict_type blocks, and every name or attribute it assigns."""

    def __init__(self, t: Fsdp1ToFsdp2) -> None:
        super().__init__()
        self.t = t
        self.models: set[str] = set()

    def visit_With(self, node: cst.With) -> None:
        options = self.t.plan.removed.get(node)
        if options is not None:
            self.models.add(options.model)
        elif node in self.t.plan.kept or node in self.t.kept_blocks:
            call = cast(cst.Call, node.items[0].item)
            if call.args and not call.args[0].keyword:
                self.models.add(self.t.code(call.args[0].value))


def function_models(t: Fsdp1ToFsdp2, node: cst.CSTNode) -> frozenset[str]:
    """The models of the state_dict_type blocks of the function holding `node`, and the parameters every caller in
    the program hands a wrapped model (handed_models.py), that it does not rebind."""
    parents = t.resume.bindings.parents
    function: cst.CSTNode | None = node
    while function is not None and not isinstance(function, cst.FunctionDef):
        function = parents.get(function)
    if function is None:
        return frozenset()
    cache = t.function_models
    if function not in cache:
        found = _Blocks(t)
        function.body.visit(found)
        handed = t.facts.wrapped_params.get(function.name.value, frozenset())
        handed = handed if parents.get(function) is t.module else frozenset()
        cache[function] = frozenset(m for m in found.models | handed if m not in found.bound)
    return cache[function]


def _parameter(t: Fsdp1ToFsdp2, receiver: str, node: cst.CSTNode, table: Mapping[str, frozenset[str]]) -> bool:
    """Whether `receiver` is one of the parameters `table` gives the module-level function holding `node`, which
    the function does not rebind (handed_models.py's findings about its calls)."""
    function = t.resume.bindings.enclosing(node, cst.FunctionDef)
    if function is None or t.resume.bindings.parents.get(function) is not t.module:
        return False
    if receiver not in table.get(function.name.value, frozenset()):
        return False
    found = _Blocks(t)
    function.body.visit(found)
    return receiver not in found.bound


def sometimes_handed(t: Fsdp1ToFsdp2, receiver: str, node: cst.CSTNode) -> bool:
    """Whether `receiver` is a parameter some calls in the program hand a wrapped model, where the tool cannot tell
    what every use of the function hands it."""
    return _parameter(t, receiver, node, t.facts.sometimes_wrapped_params)


def maybe_handed(t: Fsdp1ToFsdp2, receiver: cst.BaseExpression, node: cst.CSTNode) -> bool:
    """Whether `receiver` may hold a wrapped model on some runs, where the tool cannot tell which: a parameter some
    calls, not all, hand one, or, in a module-level class some construction hands a wrapped model (handed_models.py),
    a method's parameter (`self` aside) or an attribute of `self` (Self-Forcing's `EMA_FSDP.update(fsdp_module)`).
    Not where `node` is assigned or deleted."""
    parent = t.resume.bindings.parents.get(node)
    if isinstance(parent, (cst.AssignTarget, cst.AugAssign, cst.AnnAssign, cst.Del)) and parent.target is node:
        return False
    if sometimes_handed(t, t.code(receiver), node):
        return True
    function = t.resume.bindings.enclosing(node, cst.FunctionDef)
    owner = t.resume.bindings.enclosing(node, cst.ClassDef)
    if function is None or owner is None or owner.name.value not in t.facts.receiving_classes:
        return False
    params = function.params
    positional = [p.name.value for p in (*params.posonly_params, *params.params)]
    own = positional[0] if positional else None
    if isinstance(receiver, cst.Attribute):
        return isinstance(receiver.value, cst.Name) and receiver.value.value == own
    named = {*positional, *(p.name.value for p in params.kwonly_params)} - {own}
    return isinstance(receiver, cst.Name) and receiver.value in named


def _setters(t: Fsdp1ToFsdp2) -> bool:
    """Whether the program may set a state-dict type a function's parameter cannot be followed to."""
    return t.facts.state_dict_setters or bool(t.set_types.setters)


def before_its_wrapping(t: Fsdp1ToFsdp2, receiver: cst.BaseExpression) -> bool:
    """Whether `receiver`, a name, is read before the statement of its scope that wraps it (maybe_wrapped.py)."""
    return isinstance(receiver, cst.Name) and before_wrapping(t.resume.bindings, receiver, t.survey.wrapping)


def maybe_plain(t: Fsdp1ToFsdp2, receiver: cst.BaseExpression, node: cst.CSTNode) -> bool:
    """Whether the model `receiver` holds at `node` may be another module on some runs (maybe_wrapped.py): a name
    whose wrapping does not run before every read, a function's model known from its state_dict_type blocks alone
    (outside them it may be any module), or a parameter some call hands such a name or a plain module. Not one the
    program checks is FSDP1's where it is used (narrowed.py)."""
    if t.narrowing.unit(receiver, node):
        return False
    if isinstance(receiver, cst.Name) and not surely_wrapped(t.resume.bindings, receiver, t.survey.wrapping):
        return True
    code = t.code(receiver)
    if code in function_models(t, node) and code not in t.survey.models:  # (a block's model, outside the block)
        if not _parameter(t, code, node, t.facts.wrapped_params):
            return True  # (StableCascade's `save_model(model, is_fsdp)`: a block on one branch, a plain save on one)
    return _parameter(t, code, node, t.facts.maybe_plain_params)


def _classes_wrapping(t: Fsdp1ToFsdp2, model: str) -> set[str]:
    """The classes whose methods bind `self.<attribute>` to the wrapped model (survey.py's wrapping statements)."""
    found = set()
    for statement in t.survey.wrapping:
        assign = statement.body[0]
        targets = [t.code(a.target) for a in assign.targets] if isinstance(assign, cst.Assign) else []
        owner = t.resume.bindings.enclosing(statement, cst.ClassDef)
        if model in targets and owner is not None:
            found.add(owner.name.value)
    return found


def _relation(t: Fsdp1ToFsdp2, model: str, node: cst.CSTNode) -> tuple[str, list[cst.ClassDef]]:
    """How the class holding `node` stands to the classes that wrap `self.<attribute>` `model`: "own" (one of them,
    or derived from one in this file), "base" (a base of one: its methods may run on their wrapped model) or
    "other" (DPO's TensorParallelTrainer beside the FSDPTrainer that wraps `self.policy`); "own" where it is not
    such an attribute. With the wrapping classes that derive from it, for "base"."""
    owners = _classes_wrapping(t, model) if model.startswith("self.") else set()
    here = t.resume.bindings.enclosing(node, cst.ClassDef)
    if not owners or here is None:
        return "own", []
    classes = {c.name.value: c for c in t.module.body if isinstance(c, cst.ClassDef)}

    def ancestors(cls: cst.ClassDef) -> set[str]:
        pending, seen = [cls], set()
        while pending:
            current = pending.pop()
            seen.add(current.name.value)
            for base in current.bases:
                name = base.value.value if isinstance(base.value, cst.Name) else None
                if name in classes and name not in seen:
                    pending.append(classes[name])
        return seen

    if ancestors(here) & owners:
        return "own", []
    derived = [c for name, c in classes.items() if name in owners and here.name.value in ancestors(c)]
    return ("base", derived) if derived else ("other", [])


def _defines(cls: cst.ClassDef, name: str) -> bool:
    return any(isinstance(s, cst.FunctionDef) and s.name.value == name for s in cls.body.body)


# FSDP1 methods whose FSDP2 forms work on any module (torch.nn.utils' clip, runtime.without_gradient_sync falls back
# to DDP's no_sync): mapped in a base class whose subclass wraps the model
_ANY_MODULE = frozenset({"no_sync", "clip_grad_norm_"})


def known(t: Fsdp1ToFsdp2, receiver: str, node: cst.CSTNode) -> str | None:
    """The model `receiver` is (itself, or what `receiver._orig_mod` compiled) when the file knows it wrapped."""
    model = receiver[: -len(_COMPILED)] if receiver.endswith(_COMPILED) else receiver
    read = node.func if isinstance(node, cst.Call) else node  # `model.method` / `model.attribute`
    if isinstance(read, cst.Attribute) and t.narrowing.unit(read.value, node):
        return receiver  # (checked with `isinstance(receiver, FSDP)` where it is used: narrowed.py)
    if isinstance(read, cst.Attribute) and before_its_wrapping(t, read.value):
        return None
    if _parameter(t, model.partition(".")[0], node, t.facts.plain_params):
        return None  # every call hands it something else (the plain module ahead of its wrapping)
    relation, derived = _relation(t, model, node)
    if relation == "other":
        return None
    if relation == "base":  # (DPO's BasicTrainer, whose FSDPTrainer wraps `self.policy`)
        method = read.attr.value if isinstance(read, cst.Attribute) else ""
        if method in _ANY_MODULE:
            return model
        function = t.resume.bindings.enclosing(node, cst.FunctionDef)
        inherits = [c.name.value for c in derived if function is None or not _defines(c, function.name.value)]
        if method in ("state_dict", "load_state_dict") and inherits:
            why = (
                f"`{model}` is wrapped by {', '.join(inherits)}, which inherits this method: there it is FSDP1's "
                "model (its state-dict type's dict), elsewhere a plain module's"
            )
            fix = "override the method in the wrapping class with get_/set_model_state_dict, or call those here"
            t.report(node, f"`{receiver}.{method}(...)`", why, fix)
        return None
    if model in t.survey.models or any(m == model for m, _ in t.blocks) or model in function_models(t, node):
        return model
    return None


def no_sync_value(t: Fsdp1ToFsdp2, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression | None:
    """`model.no_sync` taken as a value on a known model (open_lm's `maybe_no_sync = model.no_sync`, called later):
    a callable giving the runtime's context manager, as FSDP1's bound method gave its own; None elsewhere."""
    if original.attr.value != "no_sync" or known(t, t.code(original.value), original) is None:
        return None
    parent = t.get_metadata(ParentNodeProvider, original, None)
    if isinstance(parent, cst.Call) and parent.func is original:
        return None  # `model.no_sync()`: rewrite() maps the call
    t.need(RUNTIME, NO_SYNC)
    t.need("functools")
    t.consumed.add(original)
    return t.expr(f"functools.partial({NO_SYNC}, {t.code(updated.value)})")


def attribute(t: Fsdp1ToFsdp2, original: cst.Attribute) -> None:
    """FSDP1's own attributes on a known model: reported, the line left as written (FSDP2 has no such attribute)."""
    name, receiver = original.attr.value, t.code(original.value)
    if name in FSDP1_ATTRIBUTES and known(t, receiver, original) is not None:
        why = f"`{name}` is FSDP1's attribute of its wrapper; under FSDP2 the model is the module, which has none"
        fix = (
            "take it from where the model was sharded (the process group or mesh given to fully_shard, the policies "
            "passed to it)"
        )
        t.report(original, f"`{receiver}.{name}`", why, fix)


def _with_strict(options: str, strict: str) -> str | None:
    if not options.startswith("StateDictOptions(") or not options.endswith(")"):
        return None  # options decided at run time (a name)
    inner = options[len("StateDictOptions(") : -1]
    return f"StateDictOptions({inner}{', ' if inner else ''}strict={strict})"


def rewrite(t: Fsdp1ToFsdp2, original: cst.Call, updated: cst.Call) -> cst.BaseExpression | None:
    """A method call on the wrapped model as FSDP2's; None where it stays as it is (reported where it must)."""
    from . import optim_loads, optim_state

    func = original.func
    assert isinstance(func, cst.Attribute)
    receiver, method = t.code(func.value), func.attr.value
    # (each argument without its own comma, which a node keeps when another argument follows it)
    args = [t.module.code_for_node(a.with_changes(comma=cst.MaybeSentinel.DEFAULT)) for a in updated.args]
    if method == "load_state_dict" and len(original.args) == 1:
        inner = original.args[0].value
        if isinstance(inner, cst.Call) and optim_state.api_of(t.fsdp1(inner.func)) in optim_state.LOADS:
            return optim_loads.optim_load(t, inner, receiver)
    if method == "apply" and isinstance(func.value, cst.Attribute) and func.value.attr.value == "module":
        if t.code(func.value.value) in t.survey.models:  # FSDP1's wrapped module: left as written
            return t._apply(original, apply_call.on_wrapped_module(receiver), updated.with_changes(func=func))
    model = known(t, receiver, original)
    if model is None and method in ("state_dict", "load_state_dict") and sometimes_handed(t, receiver, original):
        why = (
            f"calls of this function hand `{receiver}` the FSDP-wrapped model, but not every use of the function is "
            "such a call: for those calls FSDP1's state-dict type decides the dict (the full dict by default), which "
            "FSDP2's `state_dict()` does not give"
        )
        fix = "call get_/set_model_state_dict where it is the wrapped model, or hand every call the wrapped model"
        t.report(original, f"`{receiver}.{method}(...)`", why, fix)
        return None
    if model is None and original not in t.set_types.governed:
        return beside.rewrite(t, original, updated, args) if method in ("state_dict", "load_state_dict") else None
    outside = model is not None and model not in t.survey.models and all(m != model for m, _ in t.blocks)
    if method == "no_sync" and not args and original not in t.no_sync_items and model is not None:
        t.need(RUNTIME, NO_SYNC)  # `ctx = model.no_sync()` entered later: the same, as a context manager
        return t.expr(f"{NO_SYNC}({receiver})")
    if receiver != model and method not in ("state_dict", "load_state_dict"):
        return None  # only the state-dict calls of `model._orig_mod` are the model's
    if method == "apply":
        return t._apply(original, apply_call.bound(updated, cast(cst.Attribute, updated.func).value, receiver))
    if method == "clip_grad_norm_":
        t.need("torch")
        return t.expr(f"torch.nn.utils.clip_grad_norm_({receiver}.parameters(), {', '.join(args)})")
    if method not in ("state_dict", "load_state_dict"):
        return None
    if outside and _setters(t):
        why = (
            f"`{model}` is a function's FSDP1 model outside its state_dict_type blocks, where its type is the one "
            "set_state_dict_type gave it (the program calls it), which this tool cannot follow to here"
        )
        fix = "write it onto get_/set_model_state_dict with the StateDictOptions of that type"
        t.report(original, f"`{receiver}.{method}(...)`", why, fix)
        return None
    default = all(m != (model or receiver) for m, _ in t.blocks) and original not in t.set_types.governed
    if default and method == "state_dict" and not args and _gathered_whole(t, receiver, original):
        return None  # FSDP1's full dict, as the module's own state_dict() gives it there (state-dict hooks included)
    options = t._options(model or receiver, original)
    if options is None:
        return None  # under a state-dict type left to a person (reported)
    fsdp2 = _fsdp2_state_dict_call(t, method, receiver, args, original, updated, options)
    if fsdp2 is None and (model is None or maybe_plain(t, func.value, original)):
        return None  # (a module this tool does not know is wrapped there: its own call may be what FSDP1 gave too)
    if fsdp2 is None:  # (arguments get_/set_model_state_dict have no counterpart for: Dit's `assign=True`)
        why = (
            f"FSDP1's state-dict type decides what `{receiver}.{method}(...)` gives or loads, and FSDP2's "
            f"`{method}()` is the module's own (each rank's DTensor shards); get_/set_model_state_dict take only the "
            "dict (and `strict`) of these arguments"
        )
        fix = f"write it onto {'get' if method == 'state_dict' else 'set'}_model_state_dict with StateDictOptions"
        t.report(original, f"`{receiver}.{method}(...)` with these arguments", why, fix)
        t.kept_calls.add(original)
        return None
    if default and maybe_plain(t, func.value, original):  # (FSDP1's type is the wrapped model's alone)
        t.need(FSDP2, FSDP_MODULE)
        fsdp2 = guarded(receiver, fsdp2, t.module.code_for_node(updated))
    return t.expr(fsdp2)


def _gathered_whole(t: Fsdp1ToFsdp2, receiver: str, node: cst.CSTNode) -> bool:
    """Whether `node` runs inside a summon_full_params block that becomes full_params over all of `receiver` on every
    rank: there the module holds its full parameters as plain tensors, and its own `state_dict()` is FSDP1's full
    dict (get_model_state_dict would refuse the keys a state-dict hook adds: mistral-finetune's LoRA merge)."""
    current: cst.CSTNode | None = t.resume.bindings.parents.get(node)
    while current is not None and not isinstance(current, (cst.FunctionDef, cst.Lambda)):
        if isinstance(current, cst.With) and current in t.summons:
            call = cast(cst.Call, current.items[0].item)
            given = {a.keyword.value if a.keyword else summon.PARAMS[min(i, 5)]: a for i, a in enumerate(call.args)}
            module, recurse, rank0 = given.get("module"), given.get("recurse"), given.get("rank0_only")
            whole = recurse is None or t.code(recurse.value) == "True"
            everywhere = rank0 is None or t.code(rank0.value) == "False"
            return module is not None and t.code(module.value) == receiver and whole and everywhere
        current = t.resume.bindings.parents.get(current)
    return False


def _fsdp2_state_dict_call(
    t: Fsdp1ToFsdp2, method: str, receiver: str, args: list[str], original: cst.Call, updated: cst.Call, options: str
) -> str | None:
    """`model.state_dict()` / `model.load_state_dict(sd[, strict=...])` as get_/set_model_state_dict's code."""
    if method == "state_dict" and not args:
        t._need_helpers("get_model_state_dict")
        return f"get_model_state_dict({receiver}, options={options})"
    positional = [a for a in original.args if not a.keyword]
    keywords = {a.keyword.value: i for i, a in enumerate(original.args) if a.keyword}
    loads = len(positional) == 1 and not original.args[0].keyword and set(keywords) <= {"strict"}
    if method == "load_state_dict" and loads:
        if "strict" in keywords:
            with_strict = _with_strict(options, t.code(updated.args[keywords["strict"]].value))
            if with_strict is None:
                return None
            options = with_strict
        t._need_helpers("set_model_state_dict")
        return f"set_model_state_dict({receiver}, {args[0]}, options={options})"
    return None
