"""A wrapped model handed to a function of another file: fms-fsdp's `train(cfg, model, ...)` in
utils/train_utils.py, called by each main_training*.py as `train(cfg, model, ...)` with the model it wrapped.

Where every call of a module-level function in the program (its own file's too) hands a wrapped model of the
calling file at a parameter's place, by position or keyword, that parameter is the wrapped model inside the function
where it does not rebind it (methods.py: `model.clip_grad_norm_(...)`, `model.state_dict()`, `model.no_sync()`).
Followed only where the function is imported by name (`from utils import train`) or read through its imported module
(`utils.train(...)`), not listed in `__all__` or star-imported, and every mention of it is a call without `*args` or
`**kwargs`; where only some calls hand it the model, its state-dict calls on that parameter are reported. A calling
file that stays FSDP1 keeps the function's file FSDP1 too (program.py): FSDP2's calls there would meet an FSDP1
model. And the other way: a file that hands its wrapped model to a function of a file that stays FSDP1, in any
form (`utils.save(model=model)` included), stays FSDP1 with it (`Handover`): FSDP1's calls there would meet an FSDP2
model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import Assignment, MetadataWrapper, ParentNodeProvider

from .bindings import Bindings
from .cross_file import Caller, CrossFile
from .maybe_wrapped import before_wrapping, surely_wrapped
from .policies import Shared
from .returned_model import exported_names
from .survey import Survey


@dataclass(frozen=True)
class Handover:
    """`caller` hands one of its wrapped models to `function` of the program's file `callee`."""

    caller: str
    callee: str
    function: str


Params = dict[str, dict[str, frozenset[str]]]  # path -> function -> parameters


@dataclass(frozen=True)
class Handed:
    # path -> function -> its parameters every call hands a wrapped model (on some runs only, for those in
    # `maybe_plain`)
    params: Mapping[str, Mapping[str, frozenset[str]]] = field(default_factory=dict)
    callers: frozenset[Caller] = frozenset()
    # the files some of whose functions are handed a wrapped model by some call but not followed: their FSDP1 calls
    # are looked at (and reported) even where the file names no FSDP
    receiving: frozenset[str] = frozenset()
    handovers: frozenset[Handover] = frozenset()
    # path -> function -> the parameters some call hands a wrapped model where the tool cannot tell what every use
    # hands: their state-dict calls are reported
    sometimes: Mapping[str, Mapping[str, frozenset[str]]] = field(default_factory=dict)
    # path -> function -> of `params`, those some call hands a name wrapped on some runs only, or a plain module
    maybe_plain: Mapping[str, Mapping[str, frozenset[str]]] = field(default_factory=dict)
    # path -> function -> the parameters every call hands something other than the wrapped model (the plain module
    # ahead of its wrapping, None): a name they share with a wrapped model is not it there
    plain: Mapping[str, Mapping[str, frozenset[str]]] = field(default_factory=dict)
    # path -> its module-level classes some construction in the program hands a wrapped model (Self-Forcing's
    # `EMA_FSDP(self.model.generator)`): their methods' parameters and attributes may hold it
    classes: Mapping[str, frozenset[str]] = field(default_factory=dict)


@dataclass
class _Decided:
    wrapped: Params = field(default_factory=dict)
    maybe_plain: Params = field(default_factory=dict)
    plain: Params = field(default_factory=dict)
    sometimes: Params = field(default_factory=dict)


def _decide(path: str, function: str, kinds: Mapping[str, set[str]], followed: bool, decided: _Decided) -> None:
    """Sorts a function's parameters by what its calls hand them; `followed`: every use of it is one of them."""

    def add(table: Params, param: str) -> None:
        table.setdefault(path, {})[function] = table.get(path, {}).get(function, frozenset()) | {param}

    for param, seen in kinds.items():
        handed = bool(seen & {WRAPPED, MAYBE})
        if followed and seen == {PLAIN}:
            add(decided.plain, param)
        elif followed and handed and UNKNOWN not in seen:
            add(decided.wrapped, param)
            if seen != {WRAPPED}:
                add(decided.maybe_plain, param)
        elif handed:
            add(decided.sometimes, param)


@dataclass(frozen=True)
class _Models:
    """A file's names bound to a wrapped model, the statements binding them, and its bindings."""

    names: frozenset[str]
    wrapping: frozenset[cst.SimpleStatementLine]
    bindings: Bindings


def _known(wrapper: MetadataWrapper, exported: Mapping[str, str], imported: frozenset[str]) -> _Models:
    """The names a file binds to a wrapped model (survey.py, returned_model.py, cross_file.py)."""
    survey = Survey()
    wrapper.visit(survey)
    survey.follow_builders(wrapper.resolve(ParentNodeProvider), wrapper.module, exported)
    return _Models(frozenset(survey.models | imported), frozenset(survey.wrapping), Bindings(wrapper))


def _calls(wrapper: MetadataWrapper, callee: str, definition: cst.Name | None) -> tuple[list[cst.Call], bool]:
    """The calls of `callee` (a local name, or `module.function` for an imported module) in a file, and whether
    every mention of it is one (imports and its own def aside)."""
    parents = wrapper.resolve(ParentNodeProvider)
    calls: list[cst.Call] = []
    last = callee.rpartition(".")[2]

    class _Mentions(cst.CSTVisitor):
        ok = True

        def visit_Import(self, node: cst.Import) -> bool:
            return False

        def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
            return False

        def _mention(self, node: cst.Name | cst.Attribute) -> None:
            call = parents.get(node)
            if isinstance(call, cst.Call) and call.func is node:
                calls.append(call)
            else:
                self.ok = False

        def visit_Name(self, node: cst.Name) -> None:
            if node.value != callee or node is definition:
                return
            parent = parents.get(node)
            if isinstance(parent, cst.Attribute) and parent.attr is node:
                return  # `model.train()`: another name
            self._mention(node)

        def visit_Attribute(self, node: cst.Attribute) -> None:
            if node.attr.value == last and "." in callee and wrapper.module.code_for_node(node) == callee:
                self._mention(node)

    found = _Mentions()
    wrapper.module.visit(found)
    return calls, found.ok


# What one call hands a parameter: the wrapped model, a name wrapped on some runs only (maybe_wrapped.py), a value
# that is not the wrapped model, or something the text does not tell
WRAPPED, MAYBE, PLAIN, UNKNOWN = "wrapped", "maybe", "plain", "unknown"


def _kind(value: cst.BaseExpression, models: _Models) -> str:
    if cst.Module([]).code_for_node(value) in models.names:
        if not isinstance(value, cst.Name):
            return WRAPPED
        if before_wrapping(models.bindings, value, models.wrapping):
            return PLAIN  # (open_lm's `load_model(args, model)` ahead of `model = FSDP(model)`)
        return WRAPPED if surely_wrapped(models.bindings, value, models.wrapping) else MAYBE
    if isinstance(value, (cst.BaseNumber, cst.BaseString)) or (isinstance(value, cst.Name) and value.value == "None"):
        return PLAIN
    if isinstance(value, cst.Name):  # a local bound by plain assignments only, none of them a wrapping
        scope = models.bindings.scopes.get(value)
        found = list(scope[value.value]) if scope is not None else []
        statements = [
            models.bindings.enclosing(a.node, cst.SimpleStatementLine) if isinstance(a, Assignment) else None
            for a in found
        ]
        if found and all(s is not None and s not in models.wrapping for s in statements):
            return PLAIN
    return UNKNOWN


def _given(call: cst.Call, function: cst.FunctionDef, models: _Models) -> dict[str, str]:
    """What `call` hands each parameter of `function` (a parameter it leaves to its default: PLAIN); every one
    UNKNOWN where it unpacks `*args` or `**kwargs`."""
    params = function.params
    positional = [p.name.value for p in (*params.posonly_params, *params.params)]
    keywords = [p.name.value for p in (*params.params, *params.kwonly_params)]
    every = [*positional, *keywords]
    if any(a.star for a in call.args):
        return dict.fromkeys(every, UNKNOWN)
    given = dict.fromkeys(every, PLAIN)
    for index, arg in enumerate(call.args):
        name = arg.keyword.value if arg.keyword is not None else None
        if name is None:
            name = positional[index] if index < len(positional) else None
        elif name not in keywords:
            name = None
        if name is not None:
            given[name] = _kind(arg.value, models)
    return given


def _handovers(path: str, wrapper: MetadataWrapper, shared: Shared, models: _Models) -> set[Handover]:
    """The calls of `path` that hand one of its wrapped models to a function of another program file, by the name it
    imports (`save(model)`) or through its module (`utils.save(model=model)`)."""
    functions = {local: (source, name) for source, name, local in shared.named_imports(path)}
    modules = shared.imported_modules(path)
    found: set[Handover] = set()

    class _Calls(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            func, target = node.func, None
            if isinstance(func, cst.Name) and func.value in functions:
                target = functions[func.value]
            elif isinstance(func, cst.Attribute) and cst.Module([]).code_for_node(func.value) in modules:
                target = (modules[cst.Module([]).code_for_node(func.value)], func.attr.value)  # (`util.ckpt.save`)
            if target is None or target[0] == path:
                return
            if any(cst.Module([]).code_for_node(a.value) in models.names for a in node.args):
                found.add(Handover(path, *target))

    wrapper.module.visit(_Calls())
    return found


def _importing(path: str, imports: Mapping[str, list[tuple[str, str, str]]]) -> list[tuple[str, str, str]]:
    """The files importing names from `path`: (file, name, local)."""
    return [(p, n, local) for p, found in imports.items() for s, n, local in found if s == path]


def _through(path: str, modules: Mapping[str, Mapping[str, str]]) -> list[tuple[str, str]]:
    """The other files importing `path` as a module: (file, local module name)."""
    return [(p, local) for p, found in modules.items() if p != path for local, m in found.items() if m == path]


def _mentions(
    path: str, name: str, imports: Mapping[str, list[tuple[str, str, str]]], through: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """Where `name`, defined at `path`'s top level, may be called: (file, what that file calls it), its own too."""
    importers = [(p, local) for p, n, local in _importing(path, imports) if n == name]
    importers += [(p, f"{local}.{name}") for p, local in through]  # `utils.save(model)`
    return [*importers, (path, name)]


def follow_handed(
    wrappers: Mapping[str, MetadataWrapper], sources: Mapping[str, str], shared: Shared, cross: CrossFile
) -> Handed:
    """Each function of the program's files that other files import, with the parameters every call gives a
    wrapped model."""
    imports = {path: shared.named_imports(path) for path in wrappers}
    known: dict[str, _Models] = {}

    def models(path: str) -> _Models:
        if path not in known:
            exported = {**exported_names(wrappers[path].module), **cross.read_elsewhere.get(path, {})}
            known[path] = _known(wrappers[path], exported, cross.models.get(path, frozenset()))
        return known[path]

    decided = _Decided()
    callers: set[Caller] = set()
    receiving: set[str] = set()
    mention = {path for path, source in sources.items() if "fsdp" in source.lower()}  # (only these wrap models)
    handovers = {
        h for path in mention if path in wrappers for h in _handovers(path, wrappers[path], shared, models(path))
    }
    modules = {path: shared.imported_modules(path) for path in wrappers}
    for path, wrapper in wrappers.items():
        through = _through(path, modules)
        importing = {p for p, _, _ in _importing(path, imports)} | {p for p, _ in through}
        if path not in mention and not importing & mention:
            continue
        listed = set(exported_names(wrapper.module)) | ({"*"} & shared.read_otherwise(path))
        defined = [s for s in wrapper.module.body if isinstance(s, cst.FunctionDef)]
        names = [f.name.value for f in defined]
        for function in defined:
            name = function.name.value
            if function.decorators or names.count(name) > 1 or name in listed or "*" in listed:
                continue
            kinds: dict[str, set[str]] = {}  # parameter -> what the calls hand it
            handing: set[str] = set()  # the files whose calls hand a wrapped model
            followed = True
            for caller, local in _mentions(path, name, imports, through):
                calls, only_calls = _calls(wrappers[caller], local, function.name if caller == path else None)
                followed = followed and only_calls
                for call in calls:
                    for param, kind in _given(call, function, models(caller)).items():
                        kinds.setdefault(param, set()).add(kind)
                        handing |= {caller} if kind in (WRAPPED, MAYBE) else set()
            _decide(path, name, kinds, followed, decided)
            receiving |= {path} if any(k & {WRAPPED, MAYBE} for k in kinds.values()) else set()
            if path in decided.wrapped and name in decided.wrapped[path]:
                callers |= {Caller(path, name, p, handed=True) for p in handing - {path}}
    classes = _receiving_classes(wrappers, imports, modules, models)
    return Handed(
        decided.wrapped, frozenset(callers), frozenset(receiving | set(classes)), frozenset(handovers),
        decided.sometimes, decided.maybe_plain, decided.plain, classes,
    )  # fmt: skip


def _receiving_classes(
    wrappers: Mapping[str, MetadataWrapper],
    imports: Mapping[str, list[tuple[str, str, str]]],
    modules: Mapping[str, Mapping[str, str]],
    models: Callable[[str], _Models],
) -> dict[str, frozenset[str]]:
    """Each file's module-level classes that some construction in the program (`Cls(...)`, `utils.Cls(...)`) hands
    a wrapped model among its arguments. Which method is later handed what is not followed: where the class reads
    `x.module`, the tool guards it to hold either (methods.py)."""
    found: dict[str, frozenset[str]] = {}
    for path, wrapper in wrappers.items():
        through = _through(path, modules)
        receiving = set()
        for cls in (s for s in wrapper.module.body if isinstance(s, cst.ClassDef)):
            name = cls.name.value
            for caller, local in _mentions(path, name, imports, through):
                calls, _ = _calls(wrappers[caller], local, cls.name if caller == path else None)
                if any(_kind(a.value, models(caller)) in (WRAPPED, MAYBE) for c in calls for a in c.args):
                    receiving.add(name)
        if receiving:
            found[path] = frozenset(receiving)
    return found
