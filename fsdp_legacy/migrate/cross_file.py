"""A function that builds and returns the wrapped model, called from another file of the program: `def build(cfg):
... return FSDP(net, ...)` in model_lib.py, `from model_lib import build` and `model = build(cfg)` in train.py.

Followed as within one file (returned_model.py): where every file importing the function calls it only as
`name = build(...)` statements (`model, optim = build(...)` for a tuple), those names are wrapped models in their
files, and through their own functions that return them on, in the files importing those in turn. The function is
then no longer "read elsewhere" for its own file, whose construction becomes fully_shard code. Read as `lib.build`,
through a star import or exported by `__all__`, or called any other way, the function is not followed: its
construction stays FSDP1, reported with the reason the caller's text gives. A caller's file that stays FSDP1 keeps
the builder's FSDP1 too (program.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from libcst.metadata import MetadataWrapper, ParentNodeProvider

from .policies import Shared
from .returned_model import Escapes, exported_names, imported_models
from .survey import Survey

_ROUNDS = 8  # a model returned on from file to file: one round per file of the chain


@dataclass(frozen=True)
class Caller:
    """`caller` binds the model that `function` of `builder` returns (directly, or through the files between), or
    hands `function` its model."""

    builder: str
    function: str
    caller: str
    handed: bool = False  # the caller hands its model to `function` (handed_models.py) rather than binding its result


@dataclass(frozen=True)
class CrossFile:
    """What the program's files tell each other about the models their functions return."""

    models: Mapping[str, frozenset[str]] = field(default_factory=dict)  # path -> names bound to another file's model
    # path -> its names other files read (read_from), each with where; without those followed, with a caller's
    # reason for the others
    read_elsewhere: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    callers: frozenset[Caller] = frozenset()
    # path -> its builders followed to their callers in other files, each with where: a state-dict type set where
    # the model is built is not followed there (state_dict_type.py reads these as read elsewhere)
    followed: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


@dataclass
class _File:
    escapes: Escapes  # its functions returning a model to other files
    models: set[str]
    reasons: dict[str, str]  # an imported builder's local name -> why its calls here are not followed


def _analyse(
    wrapper: MetadataWrapper, exported: Mapping[str, str], imported: Mapping[str, tuple[int, int] | None]
) -> _File:
    survey = Survey()
    wrapper.visit(survey)
    parents = wrapper.resolve(ParentNodeProvider)
    survey.follow_builders(parents, wrapper.module, exported)
    found = _File(dict(survey.builders.escapes), set(), {})
    for local, shape in imported.items():
        models = imported_models(local, shape, parents, wrapper.module, exported, found.escapes)
        if isinstance(models, str):
            found.reasons[local] = models
        else:
            found.models |= models
    return found


def follow_across(wrappers: Mapping[str, MetadataWrapper], sources: Mapping[str, str], shared: Shared) -> CrossFile:
    """Follow every builder other files import, round by round until nothing new is found."""
    read = {path: shared.read_from(path) for path in wrappers}
    if not any(read.values()):
        return CrossFile(read_elsewhere=read)
    imports = {path: shared.named_imports(path) for path in wrappers}
    unfollowable = {path: set(exported_names(w.module)) | shared.read_otherwise(path) for path, w in wrappers.items()}
    followed: dict[str, set[str]] = {path: set() for path in wrappers}
    returning: dict[str, Escapes] = {path: {} for path in wrappers}  # every builder found so far, followed or not
    files: dict[str, _File] = {}
    for _ in range(_ROUNDS):
        before = ({p: dict(r) for p, r in returning.items()}, {p: set(f) for p, f in followed.items()})
        files = {}
        for path, wrapper in wrappers.items():
            imported = {
                local: returning[source][name] for source, name, local in imports[path] if name in returning[source]
            }
            if imported or ("fsdp" in sources[path].lower() and read[path]):
                exported = {n: w for n, w in read[path].items() if n not in followed[path]}
                files[path] = _analyse(wrapper, {**exported_names(wrapper.module), **exported}, imported)
                returning[path].update(files[path].escapes)
        for path, names in returning.items():
            for name in names:
                callers = [(p, local) for p in wrappers for s, n, local in imports[p] if (s, n) == (path, name)]
                blocked = name in unfollowable[path] or ("*" in unfollowable[path] and not name.startswith("_"))
                if not blocked and all(p in files and local not in files[p].reasons for p, local in callers):
                    followed[path].add(name)
        if before == ({p: dict(r) for p, r in returning.items()}, followed):
            break
    return CrossFile(
        {path: frozenset(found.models) for path, found in files.items() if found.models},
        {path: _unfollowed(path, names, followed[path], imports, files) for path, names in read.items()},
        frozenset(
            Caller(source, name, path)
            for path in files
            for source, name, _ in imports[path]
            if name in followed[source]
        ),
        {path: {n: w for n, w in read[path].items() if n in names} for path, names in followed.items() if names},
    )


def _unfollowed(
    path: str, read: Mapping[str, str], followed: set[str], imports: Mapping[str, list], files: Mapping[str, _File]
) -> dict[str, str]:
    """The names of `path` other files read, less those followed, each with where (and why, for a builder whose
    calls a file shows otherwise than as `name = build(...)`)."""
    out = dict(read)
    for other, found in files.items():
        for source, name, local in imports[other]:
            if source == path and local in found.reasons and name in out:
                out[name] = f"imported by {other}, where {found.reasons[local]}"
    return {name: where for name, where in out.items() if name not in followed}
