"""A wrapped model that a function returns to its callers, followed to them where the text shows every path.

- A state-dict type set where the model is built (`def build(): model = FSDP(...); FSDP.set_state_dict_type(model,
  ...); return model`) travels with the returned model: state_dict_type.py follows it to the calls after each
  `name = build(...)` (`returned`).
- A function that builds and returns the model (`return FSDP(net, ...)`, or `model = FSDP(net, ...)` ... `return
  model`, or `return model, optim`) makes each caller's name a wrapped model (`builders`): the rewriter maps the
  construction and the calls on those names as for a model wrapped in place (`model.state_dict()`,
  `model.clip_grad_norm_(...)`, `no_sync()`).

Followed only where the text shows every path: a function without decorators (module-level, or for a builder a
method of a module-level class), whose one `return` ends its body and gives the model alone or as one name of a flat
tuple; called only as `name = build(...)` statements of this file (`model, optim = build(...)` for a tuple; for a
builder also `self.model = build(...)` and `x = obj.setup(...)`), and neither exported (`__all__`) nor imported by
another file of the program; a caller's name that its own function returns is followed the same way. Anything else
(the model in a dict, a list, a nested tuple or a call's arguments, a yield, bound inside a block), and the calls on
the model may be anywhere: the construction then stays FSDP1 (reported, and the file with it); a function nothing
in the file names or exports is not followed, its model sharded as before. Handed to a function of the file that
returns none of its parameters (`return train(model, optim)`), the model does not leave with the result. A file
migrated alone cannot see the files that import it: `__all__` is the only sign of them it reads."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import CodeRange

from .reorder import names_in
from .report import Finding

Parents = Mapping[cst.CSTNode, cst.CSTNode]
Escapes = dict[str, tuple[int, int] | None]  # a function other files import -> the model's place in its result


@dataclass(frozen=True)
class Sites:
    """The statements `target = build(...)` that receive the model, and the function's name."""

    function: str
    statements: tuple[cst.SimpleStatementLine, ...]
    position: int | None = None  # `return model, optim`: the model's place in the tuple the callers unpack

    def target(self, statement: cst.SimpleStatementLine) -> str:
        assign = statement.body[0]
        assert isinstance(assign, cst.Assign)
        target = _element(assign.targets[0].target, self.position)
        assert isinstance(target, (cst.Name, cst.Attribute))
        return cst.Module([]).code_for_node(target)

    def targets(self) -> list[tuple[cst.SimpleStatementLine, str]]:
        return [(s, self.target(s)) for s in self.statements]


class _Returns(cst.CSTVisitor):
    """The returns and yields of one function, not those of the functions, classes and lambdas inside it."""

    def __init__(self, root: cst.FunctionDef) -> None:
        super().__init__()
        self.root = root
        self.returns: list[cst.Return] = []
        self.yields = False
        self.yielded: list[cst.BaseExpression] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return node is self.root

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_Return(self, node: cst.Return) -> None:
        self.returns.append(node)

    def visit_Yield(self, node: cst.Yield) -> None:
        self.yields = True
        if isinstance(node.value, cst.BaseExpression):
            self.yielded.append(node.value)


class _Mentions(cst.CSTVisitor):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.found: list[cst.Name] = []

    def visit_Name(self, node: cst.Name) -> None:
        if node.value == self.name:
            self.found.append(node)


def _imported(name: cst.Name, parents: Parents) -> bool:
    """Whether `name` is part of an import statement (`from lib import build as make`)."""
    node: cst.CSTNode | None = name
    while node is not None and not isinstance(node, (cst.ImportFrom, cst.Import, cst.BaseStatement)):
        node = parents.get(node)
    return isinstance(node, (cst.ImportFrom, cst.Import))


def _function(statement: cst.BaseStatement, parents: Parents) -> cst.FunctionDef | None:
    """The function whose body holds `statement` directly."""
    owner = parents.get(statement)
    function = parents.get(owner) if isinstance(owner, cst.IndentedBlock) else None
    return function if isinstance(function, cst.FunctionDef) else None


def _class_of(function: cst.FunctionDef, parents: Parents, module: cst.Module) -> cst.ClassDef | None:
    """The module-level class `function` is a method of."""
    owner = parents.get(parents.get(function) or function)
    return owner if isinstance(owner, cst.ClassDef) and parents.get(owner) is module else None


def _shape(function: cst.FunctionDef, returns: _Returns) -> str | None:
    """Why the one return of `function` is not the last statement of its body (None: it is)."""
    body = list(function.body.body) if isinstance(function.body, cst.IndentedBlock) else []
    last = body[-1] if body else None
    if len(returns.returns) != 1 or not (
        isinstance(last, cst.SimpleStatementLine) and last.body[0] is returns.returns[0]
    ):
        return f"`{function.name.value}` returns in more than one place, or not at the end of its body"
    return None


def _sites(
    function: cst.FunctionDef,
    what: str,
    parents: Parents,
    module: cst.Module,
    exported: Mapping[str, str],
    builder: bool,
    shape: tuple[int, int] | None = None,
    escapes: Escapes | None = None,
) -> Sites | str:
    """Each `target = function(...)` statement of the file, or why the text does not show every place the result
    goes. `builder`: a method too (called as `target = obj.method(...)`), and `self.model = ...` targets (the setter's
    calls must follow their target in its block, which an attribute's would not show). `shape`: the model's place
    in a returned tuple and the tuple's length, which each caller unpacks (`model, optim = build(...)`). `escapes`:
    gets the module-level functions that other files import (cross_file.py may follow their callers there)."""
    name = function.name.value
    cls = _class_of(function, parents, module) if builder else None
    static = cls is not None and [cst.Module([]).code_for_node(d.decorator) for d in function.decorators] == [
        "staticmethod"
    ]
    if (
        (function.decorators and not static)
        or _yields(function)
        or (parents.get(function) is not module and cls is None)
    ):
        kind = "module-level function or method" if builder else "module-level function"
        return f"`{name}` returns {what} but is not a plain {kind}"
    public = cls.name.value if cls is not None else name
    if public in exported or ("*" in exported and not public.startswith("_")):
        where = exported.get(public) or exported["*"]
        if escapes is not None and cls is None:
            escapes[name] = shape
        whose = f" (its `{name}` returns {what})" if cls is not None else f", which returns {what},"
        return f"`{public}`{whose} is {where}: the calls made there are not followed"
    return _call_sites(name, what, parents, module, builder, shape, method=cls is not None, skip=function.name)


def imported_models(
    local: str,
    shape: tuple[int, int] | None,
    parents: Parents,
    module: cst.Module,
    exported: Mapping[str, str],
    escapes: Escapes,
) -> set[str] | str:
    """For a function of another file that returns the wrapped model (at `shape` in its result) and that this file
    imports as `local` (cross_file.py): the names the model reaches here, or why the text does not show every place
    it goes. This file's functions it is returned on through go to `escapes` where other files import them."""
    sites = _call_sites(local, "a wrapped model", parents, module, True, shape, method=False, skip=None)
    if isinstance(sites, str):
        return sites
    models: set[str] = set()
    for site, target in sites.targets():
        models.add(target)
        reason = _follow(site, target, parents, module, exported, models, True, escapes)
        if reason is not None:
            return reason
    return models


def _call_sites(
    name: str,
    what: str,
    parents: Parents,
    module: cst.Module,
    builder: bool,
    shape: tuple[int, int] | None,
    method: bool,
    skip: cst.Name | None,
) -> Sites | str:
    """The `target = name(...)` statements (`target = obj.name(...)` for a `method`) that are the file's only
    mentions of `name` but `skip` (its def) and imports."""
    call = f"obj.{name}" if method else name
    mentions = _Mentions(name)
    module.visit(mentions)
    sites = []
    for found in mentions.found:
        if found is skip or _imported(found, parents):
            continue
        callee: cst.CSTNode = found
        attribute = parents.get(found)
        if method and isinstance(attribute, cst.Attribute) and attribute.attr is found:
            callee = attribute
        called = parents.get(callee)
        assign = parents.get(called) if isinstance(called, cst.Call) and called.func is callee else None
        line = parents.get(assign) if isinstance(assign, cst.Assign) else None
        target = assign.targets[0].target if isinstance(assign, cst.Assign) and len(assign.targets) == 1 else None
        bound = _unpacked(target, shape)
        if not (
            (callee is not found) == method
            and (isinstance(bound, cst.Name) or (builder and isinstance(bound, cst.Attribute)))
            and isinstance(line, cst.SimpleStatementLine)
            and len(line.body) == 1
            and isinstance(parents.get(line), (cst.IndentedBlock, cst.Module))
        ):
            form = f"name = {call}(...)" if shape is None else f"{_names(*shape)} = {call}(...)"
            return f"`{name}`, which returns {what}, is used other than as `{form}`"
        sites.append(line)
    if not sites and skip is not None:
        return f"`{name}` returns {what} and is not called in this file: its callers' calls are elsewhere"
    return Sites(name, tuple(sites), None if shape is None else shape[0])


def _uncalled(function: cst.FunctionDef, parents: Parents, module: cst.Module, exported: Mapping[str, str]) -> bool:
    """Whether nothing in the file names `function` (but its def), nor exports it (it, or its class), nor decorates
    it: its callers are in no file the tool is given."""
    name = function.name.value
    cls = _class_of(function, parents, module)
    public = cls.name.value if cls is not None else name
    if function.decorators or public in exported or ("*" in exported and not public.startswith("_")):
        return False
    mentions = _Mentions(name)
    module.visit(mentions)
    return all(found is function.name for found in mentions.found)


def _yields(function: cst.FunctionDef) -> bool:
    found = _Returns(function)
    function.visit(found)
    return found.yields


def returned(
    statement: cst.SimpleStatementLine,
    model: str,
    parents: Parents,
    module: cst.Module,
    exported: Mapping[str, str] | None = None,
    builder: bool = False,
    uncalled: bool = False,
    escapes: Escapes | None = None,
) -> Sites | str | None:
    """The call sites the model bound (or set) by `statement` is returned to; None where the function holding it
    does not return it (nothing to follow); a reason where it does and the text does not show where it goes."""
    function = _enclosing(statement, parents)
    if function is None:
        return None
    returns = _Returns(function)
    function.visit(returns)
    name = function.name.value
    if uncalled and _uncalled(function, parents, module, exported or {}):
        return None  # its callers, and what they do with the model, are outside what the tool is given
    opaque = _opaque(module)
    if any(_holds(value, model, opaque) for value in returns.yielded):
        return f"`{name}` yields `{model}`"
    if not any(r.value is not None and _holds(r.value, model, opaque) for r in returns.returns):
        return None
    if _function(statement, parents) is not function:
        return f"`{model}` is bound inside a block of `{name}`, which returns it"
    shape = _shape(function, returns)
    if shape is not None:
        return shape
    value = returns.returns[0].value
    assert value is not None
    place = _place(value, model, name, opaque)
    if isinstance(place, str):
        return place
    return _sites(function, f"`{model}`", parents, module, exported or {}, builder, place, escapes)


def exported_names(module: cst.Module) -> dict[str, str]:
    """The names a module-level `__all__ = [...]` (or `+=`) lists -> where, for a finding's wording."""
    found: dict[str, str] = {}
    for statement in module.body:
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else []
        if isinstance(small, cst.AugAssign):
            targets = [small.target]
        if not any(isinstance(t, cst.Name) and t.value == "__all__" for t in targets):
            continue
        value = small.value if isinstance(small, (cst.Assign, cst.AugAssign)) else None
        for element in value.elements if isinstance(value, (cst.List, cst.Tuple, cst.Set)) else ():
            if isinstance(element.value, cst.SimpleString) and isinstance(element.value.evaluated_value, str):
                found[element.value.evaluated_value] = "exported by `__all__`, so other files may call it"
    return found


@dataclass
class Builders:
    """The file's functions that build and return a wrapped model, as the rewriter needs them."""

    returned: dict[cst.Call, str] = field(default_factory=dict)  # `return FSDP(...)` mapped -> the module's name
    models: set[str] = field(default_factory=set)  # the callers' names (code) the wrapped model is bound to
    sites: set[cst.SimpleStatementLine] = field(default_factory=set)  # the callers' statements that bind them
    # the FSDP(...) calls in an expression, which stay FSDP1's -> the finding's (what, why)
    refused: dict[cst.Call, tuple[str, str]] = field(default_factory=dict)
    escapes: Escapes = field(default_factory=dict)  # module-level functions returning the model to other files

    def returning(self, statement: cst.BaseSmallStatement) -> tuple[str, cst.Call] | None:
        """For a mapped `return FSDP(...)`: the module's name and the call."""
        value = statement.value if isinstance(statement, cst.Return) else None
        return (self.returned[value], value) if isinstance(value, cst.Call) and value in self.returned else None

    def findings(self, positions: Mapping[cst.CSTNode, CodeRange]) -> list[Finding]:
        return [Finding(positions[c].start.line, what, why, _FIX) for c, (what, why) in self.refused.items()]


# why a result the text does not follow stays FSDP1's, after the finding's own reason
_UNFOLLOWED = (
    "the calls made on the model are then on objects this file does not name as it, and would be left as written "
    "under FSDP2 (`state_dict()`: FSDP1's full state dict, each rank's DTensor shards under FSDP2)"
)
_FIX = (
    "bind it to a name in a statement of its own (`model = FSDP(...)`), return that name alone or in a tuple, and have "
    "each caller bind the function's result to a name (`model = build(...)`, `model, optim = build(...)`; in another "
    "file, imported by name: `from lib import build`), then migrate again"
)
_EXPRESSION = (
    "`FSDP(...)` used as an expression",
    "its result is not bound to a name by a statement of its own (`model = FSDP(...)`) nor returned to callers that "
    f"each bind it to one (`model = build(...)`): {_UNFOLLOWED}",
)


def builders(
    calls: Iterable[cst.Call],
    constructions: Mapping[cst.Call, str],
    parents: Parents,
    module: cst.Module,
    exported: Mapping[str, str],
) -> Builders:
    """`calls`: every FSDP(...) of the file; `constructions`: those that are `target = FSDP(...)` statements."""
    out = Builders()
    for call in calls:
        if call in constructions:  # sharded as before where it does not escape, or escapes to callers followed
            statement = parents.get(parents.get(call) or call)
            found: set[str] = set()
            if isinstance(statement, cst.SimpleStatementLine):
                why = _follow(
                    statement, constructions[call], parents, module, exported, found, True, out.escapes, out.sites
                )
                if why is not None:
                    out.refused[call] = (f"`{constructions[call]} = FSDP(...)`", f"{why}; {_UNFOLLOWED}")
                    continue
            out.models |= found
            continue
        ret = parents.get(call)
        function = _enclosing(call, parents) if isinstance(ret, cst.Return) else None
        if function is None:
            out.refused[call] = _EXPRESSION
            continue
        if not _yields(function) and _uncalled(function, parents, module, exported):
            out.returned[call] = _name_for(call, function)  # its callers are outside what the tool is given
            continue
        returns = _Returns(function)
        function.visit(returns)
        sites = _shape(function, returns) or _sites(
            function, "`FSDP(...)`", parents, module, exported, True, escapes=out.escapes
        )
        models: set[str] = set()
        reason = sites if isinstance(sites, str) else None
        for site, target in sites.targets() if isinstance(sites, Sites) else ():
            models.add(target)
            out.sites.add(site)
            reason = reason or _follow(site, target, parents, module, exported, models, True, out.escapes, out.sites)
        if reason is not None:
            out.refused[call] = (f"`return FSDP(...)` in `{function.name.value}`", f"{reason}; {_UNFOLLOWED}")
            continue
        out.returned[call] = _name_for(call, function)
        out.models |= models
    return out


def _enclosing(node: cst.CSTNode, parents: Parents) -> cst.FunctionDef | None:
    while node in parents and not isinstance(node, cst.FunctionDef):
        node = parents[node]
    return node if isinstance(node, cst.FunctionDef) else None


def _follow(
    statement: cst.SimpleStatementLine,
    name: str,
    parents: Parents,
    module: cst.Module,
    exported: Mapping[str, str],
    models: set[str],
    uncalled: bool = False,
    escapes: Escapes | None = None,
    bound_by: set[cst.SimpleStatementLine] | None = None,
) -> str | None:
    """The names the model bound to `name` by `statement` reaches through `name = function(...)` returns, added to
    `models` (and the statements that bind them to `bound_by`); why it also reaches places the text does not show
    (None: it does not). `uncalled`: a function called nowhere, exported nowhere and imported by no file of the
    program is no such place (sharded as before, its callers outside what the tool is given, as for any name a file
    migrated alone defines)."""
    pending, seen = [(statement, name)], set()
    while pending:
        statement, name = pending.pop()
        if id(statement) in seen:
            continue
        seen.add(id(statement))
        sites = returned(statement, name, parents, module, exported, True, uncalled, escapes)
        if isinstance(sites, str):
            return sites
        if sites is None:
            continue
        for site, target in sites.targets():
            models.add(target)
            if bound_by is not None:
                bound_by.add(site)
            pending.append((site, target))
    return None


def _name_for(call: cst.Call, function: cst.FunctionDef) -> str:
    """The name the module of `return FSDP(module, ...)` is sharded under: its own, else a name the function lacks."""
    first = next((a.value for a in call.args if a.keyword is None or a.keyword.value == "module"), None)
    if isinstance(first, (cst.Name, cst.Attribute)):
        return cst.Module([]).code_for_node(first)
    used = names_in(function)
    return next(n for n in ("model", "fsdp_model", *(f"fsdp_model_{i}" for i in range(1, 100))) if n not in used)


# calls whose result is never the module handed to them: the model in their arguments does not leave with the result
_OPAQUE = frozenset({"len", "isinstance", "print", "str", "repr", "id", "hash", "type", "bool", "int", "float"})


def _is(node: cst.CSTNode, model: str) -> bool:
    return isinstance(node, (cst.Name, cst.Attribute)) and (
        cst.Module([]).code_for_node(node.with_changes(lpar=[], rpar=[])) == model
    )


def _holds(node: cst.CSTNode, model: str, opaque: frozenset[str] = _OPAQUE) -> bool:
    """Whether the value `node` may be, or hold, the model bound to `model`: its attributes (`model.state_dict()`),
    its forward (`model(x)`) and the calls named in `opaque` are other values; any other call it is handed to may
    return it."""
    if _is(node, model):
        return True
    if isinstance(node, cst.Attribute):
        return False
    if isinstance(node, cst.Call):
        named = isinstance(node.func, cst.Name) and node.func.value in opaque
        return not named and any(_holds(a.value, model, opaque) for a in node.args)
    if isinstance(node, cst.Subscript):
        return _holds(node.value, model, opaque)
    return any(_holds(child, model, opaque) for child in node.children)


def _opaque(module: cst.Module) -> frozenset[str]:
    """The builtins above, and the file's module-level functions (one def, no decorators) whose returns and yields
    hold none of their parameters: `return train(model, optim)` returns train's losses, not the model."""
    defs: dict[str, list[cst.FunctionDef]] = {}
    for statement in module.body:
        if isinstance(statement, cst.FunctionDef):
            defs.setdefault(statement.name.value, []).append(statement)
    found = set(_OPAQUE) - set(defs)
    for name, (function, *more) in defs.items():
        returns = _Returns(function)
        function.visit(returns)
        values = [r.value for r in returns.returns if r.value is not None] + returns.yielded
        params = [
            p.name.value
            for p in (*function.params.posonly_params, *function.params.params, *function.params.kwonly_params)
        ]
        star = isinstance(function.params.star_arg, cst.Param) or function.params.star_kwarg is not None
        if not (more or function.decorators or star) and not any(_holds(v, p) for v in values for p in params):
            found.add(name)
    return frozenset(found)


def _place(
    value: cst.BaseExpression, model: str, function: str, opaque: frozenset[str]
) -> tuple[int, int] | None | str:
    """Where `return value` puts the model: the whole value (None), one element of a flat tuple (its index and the
    tuple's length), or why it is neither."""
    if _is(value, model):
        return None
    elements = value.elements if isinstance(value, cst.Tuple) else ()
    at = [i for i, e in enumerate(elements) if _is(e.value, model)]
    flat = not any(isinstance(e, cst.StarredElement) for e in elements)
    if len(at) == 1 and flat and not any(_holds(e.value, model, opaque) for i, e in enumerate(elements) if i != at[0]):
        return at[0], len(elements)
    code = cst.Module([]).code_for_node(value)
    code = code if len(code) <= 60 else code[:57] + "..."
    return (
        f"`{function}` returns `{model}` in `{code}`, which is not followed to its callers (only `return {model}`, "
        "or a tuple of names each caller unpacks)"
    )


def _unpacked(target: cst.BaseAssignTargetExpression | None, shape: tuple[int, int] | None) -> cst.CSTNode | None:
    """A caller's target for the model: the whole target, or its element at the model's place in the tuple it
    unpacks (None: the target is not such a tuple)."""
    if shape is None or target is None:
        return target
    elements = target.elements if isinstance(target, (cst.Tuple, cst.List)) else ()
    if len(elements) != shape[1] or any(isinstance(e, cst.StarredElement) for e in elements):
        return None
    return elements[shape[0]].value


def _element(target: cst.BaseAssignTargetExpression, position: int | None) -> cst.CSTNode:
    if position is None:
        return target
    assert isinstance(target, (cst.Tuple, cst.List))
    return target.elements[position].value


def _names(position: int, length: int) -> str:
    return ", ".join("model" if i == position else "_" for i in range(length))
