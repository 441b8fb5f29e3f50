"""`model = FSDP(module, **kwargs)` as FSDP2 statements: a `fully_shard` call per unit of the auto-wrap policy and one
for the root, the kwargs mapped onto fully_shard's, and what FSDP2 has no argument for made explicit around them.

Everything is decided from the source text: a keyword whose value cannot be read faithfully is a problem, and one
problem leaves the whole construction as it was (a partial rewrite would train differently without saying so)."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import libcst as cst

from .facts import ImportedPolicy
from .names import FSDP1_DROPPED_KWARGS, FSDP1_MAPPED_KWARGS, WRAP_POLICIES

Code = Callable[[cst.CSTNode], str]  # a node's source text
Fsdp1 = Callable[[cst.CSTNode], "str | None"]  # a node's FSDP1 name, if it is one
Resolve = Callable[[cst.BaseExpression], cst.BaseExpression]  # a name to the one value the file assigns it

STATE_DICT_HELPERS = "torch.distributed.checkpoint.state_dict"
FSDP2 = "torch.distributed.fsdp"
RUNTIME = "fsdp_legacy.migrate.runtime"
NOTE = "# fsdp-legacy migrate:"

# Keywords FSDP2 does without, and why (the comment left where they were).
_DROPPED = {
    "use_orig_params": "FSDP2 always keeps the original parameters",
    "limit_all_gathers": "FSDP2 bounds its all-gathers itself",
    "backward_prefetch": "FSDP2 prefetches the next unit in backward (as BACKWARD_PRE); "
    "set_modules_to_backward_prefetch() sets another order",
    "forward_prefetch": "set_modules_to_forward_prefetch() prefetches in forward in FSDP2",
    "device_id": "fully_shard moves the parameters to its mesh's device (the current CUDA device, else the CPU)",
}


@dataclass
class Problem:
    node: cst.CSTNode
    what: str
    why: str
    fix: str


@dataclass
class Construction:
    """The statements replacing one FSDP(...) assignment, the imports they need, or why it cannot be replaced."""

    statements: list[cst.BaseStatement] = field(default_factory=list)
    imports: list[tuple[str, str | None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # comments to put above the statements
    problems: list[Problem] = field(default_factory=list)
    materializes: bool = False  # sharded through apply_fully_shard, which may initialize meta modules
    at_run_time: frozenset[str] = frozenset()  # FSDP1 keywords whose values fsdp1_options reads at run time
    fsdp1_values: bool = False  # fully_shard_fsdp1(...): every value it takes stays FSDP1's (MixedPrecision, ...)


@dataclass
class _Parts:
    pre: list[str] = field(default_factory=list)  # code before the fully_shard calls
    post: list[str] = field(default_factory=list)  # code after them
    kwargs: dict[str, str] = field(default_factory=dict)  # fully_shard keyword -> value code
    notes: list[str] = field(default_factory=list)
    buffer_dtype: str | None = None  # FSDP1's MixedPrecision.buffer_dtype, cast explicitly after sharding
    ignored: str | None = None  # ignored_modules' code
    ignored_params: str | None = None  # ignored_states' parameters, as code
    param_init_fn: str | None = None
    sync: bool = False  # sync_module_states=True
    sync_code: str | None = None  # sync_module_states computed at run time, handed to apply_fully_shard
    # FSDP1 keyword -> value code, for values only known at run time: fsdp1_options (keywords_runtime.py) maps them
    at_run_time: dict[str, str] = field(default_factory=dict)


def _literal_bool(node: cst.BaseExpression) -> bool | None:
    return {"True": True, "False": False}.get(node.value) if isinstance(node, cst.Name) else None


def mixed_precision_policy(call: cst.Call, code: Code) -> tuple[str, str | None, list[str]]:
    """FSDP1's `MixedPrecision(...)` as `MixedPrecisionPolicy(...)` code, its buffer_dtype (which FSDP2 lacks) and
    the keywords that cannot be carried over."""
    kept, buffer_dtype, refused = [], None, []
    for arg in call.args:
        name = arg.keyword.value if arg.keyword else None
        if name in ("param_dtype", "reduce_dtype"):
            kept.append(f"{name}={code(arg.value)}")
        elif name == "buffer_dtype":
            buffer_dtype = code(arg.value)
        elif name in ("cast_forward_inputs", "cast_root_forward_inputs") and _literal_bool(arg.value) is not None:
            continue  # FSDP2 casts each unit's floating inputs to param_dtype, which is where FSDP1's casts end up
        elif name == "keep_low_precision_grads" and _literal_bool(arg.value) is False:
            continue
        else:
            refused.append(code(arg))
    return f"MixedPrecisionPolicy({', '.join(kept)})", buffer_dtype, refused


def offload_policy(call: cst.Call, code: Code) -> str | None:
    """FSDP2's policy class for a `CPUOffload(...)` standing on its own (offload_params written as a literal)."""
    flags = [(a.keyword.value if a.keyword else "offload_params", code(a.value)) for a in call.args]
    if len(flags) > 1 or any(k != "offload_params" or v not in ("True", "False") for k, v in flags):
        return None
    return "CPUOffloadPolicy" if flags and flags[0][1] == "True" else "OffloadPolicy"


def build(
    target: str,
    call: cst.Call,
    code: Code,
    fsdp1: Fsdp1,
    resolve: Resolve,
    meta: bool,
    imported: Mapping[str, ImportedPolicy] | None = None,
    kept: Collection[cst.CSTNode] = (),
) -> Construction:
    """The FSDP2 statements for `target = FSDP(...)` (`call`); `meta`: the file names the meta device, so the module
    may be built there and must be materialized as FSDP1 does; `imported`: names bound to MixedPrecision policies of
    other files of the program (facts.py); `kept`: the file's MixedPrecision(...) values that stay FSDP1's (another
    use of them may reach an FSDP1 construction), which fsdp1_options reads at run time."""
    out = Construction()
    call = module_first(call)
    if not call.args or call.args[0].keyword is not None or call.args[0].star:
        out.problems.append(Problem(call, "FSDP(...) without the module as first argument", *_UNMAPPED))
        return out
    module = call.args[0].value
    model = code(module)
    if any(arg.star == "**" for arg in call.args[1:]):
        return _unpacked(target, call, code, out)
    parts = _Parts()
    if not isinstance(module, (cst.Name, cst.Attribute)):
        parts.pre.append(f"{target} = {model}")
        model = target
    keywords = _read(call.args[1:], code, fsdp1, resolve, parts, out, imported or {}, kept)
    _placement(keywords, code, parts, out)
    if out.problems:
        return out
    shard = _units(model, keywords.policy, code, fsdp1, resolve, parts, out, meta)
    out.at_run_time = frozenset(parts.at_run_time)
    if keywords.policy is not None and isinstance(resolve(keywords.policy), (cst.Name, cst.Attribute)):
        # a policy built where this file does not show (main_training's `wrapping_policy` from get_policies()):
        # apply_fully_shard evaluates whatever FSDP1 policy it is, as FSDP1 does
        out.at_run_time |= {"auto_wrap_policy"}
    if parts.buffer_dtype is not None:
        parts.post.append(
            f"for buffer in {model}.buffers():  # FSDP1's buffer_dtype: FSDP2 leaves buffers as they are\n"
            f"    if buffer.is_floating_point():\n"
            f"        buffer.data = buffer.data.to({parts.buffer_dtype})"
        )
    out.notes = [f"{NOTE} FSDP(...) became fully_shard (FSDP2)"] + [f"{NOTE} {n}" for n in parts.notes]
    text = list(parts.pre)
    if list(parts.kwargs) == [_AT_RUN_TIME]:
        text.append(f"fsdp_kwargs = {parts.kwargs[_AT_RUN_TIME]}")
    elif parts.kwargs:
        text.append("fsdp_kwargs = {" + ", ".join(_entries(parts)) + "}")
    text += shard + parts.post
    if target != model:
        text.append(f"{target} = {model}")
    if any(re.search(r"\bfully_shard\(", line) for line in shard):
        out.imports.append((FSDP2, "fully_shard"))
    out.statements = list(cst.parse_module("\n".join(text) + "\n").body)
    return out


UNPACKED_HELPER = "fully_shard_fsdp1"


def _unpacked(target: str, call: cst.Call, code: Code, out: Construction) -> Construction:
    """`FSDP(module, ..., **kwargs)` (DPO's `FSDP(policy, **shared_fsdp_kwargs, mixed_precision=...)`, open_lm's
    `**fsdp_kwargs` filled by flags): which keywords the dict holds only the run shows, so the call becomes
    `fully_shard_fsdp1(module, ...)` with its arguments as written, every value mapped at run time as FSDP1 applies
    it (runtime.py), the module sharded in place and returned; a keyword it has no mapping for raises TypeError there,
    naming it. Written keywords without a mapping, and arguments by position, are reported here."""
    for arg in call.args[1:]:
        name = arg.keyword.value if arg.keyword is not None else None
        if arg.star == "*" or (name is None and not arg.star):
            why = "an argument by position or unpacked from a sequence: which FSDP1 keyword it gives cannot be read"
            out.problems.append(Problem(arg, f"FSDP(..., {code(arg.value)})", why, "pass it by keyword"))
        elif name is not None and name not in FSDP1_MAPPED_KWARGS | FSDP1_DROPPED_KWARGS:
            out.problems.append(Problem(arg, f"FSDP(..., {name}=...)", *_UNMAPPED))
    if out.problems:
        return out
    args = ", ".join(code(a.with_changes(comma=cst.MaybeSentinel.DEFAULT)) for a in call.args)
    out.statements = list(cst.parse_module(f"{target} = {UNPACKED_HELPER}({args})\n").body)
    out.imports.append((RUNTIME, UNPACKED_HELPER))
    out.notes = [
        f"{NOTE} FSDP(..., **kwargs) became fully_shard_fsdp1 (FSDP2): the keywords the dict holds are mapped at run "
        "time as FSDP1 applies them"
    ]
    out.at_run_time, out.materializes, out.fsdp1_values = FSDP1_MAPPED_KWARGS, True, True
    return out


def _entries(parts: _Parts) -> list[str]:
    """fsdp_kwargs' entries: the keywords read from the text, then fsdp1_options(...) over those known at run time."""
    entries = [f'"{k}": {v}' for k, v in parts.kwargs.items() if k != _AT_RUN_TIME]
    if parts.at_run_time:
        entries.append(f"**{parts.kwargs[_AT_RUN_TIME]}")
    return entries


_AT_RUN_TIME = "**"  # parts.kwargs' key for the fsdp1_options(...) call


@dataclass
class _Keywords:
    """What of FSDP(...)'s keywords decides the units and the mesh (the rest goes straight into _Parts)."""

    policy: cst.BaseExpression | None = None
    strategy: str | None = None
    mesh: str | None = None
    group: cst.Arg | None = None


def _read(
    args: Sequence[cst.Arg],
    code: Code,
    fsdp1: Fsdp1,
    resolve: Resolve,
    parts: _Parts,
    out: Construction,
    imported: Mapping[str, ImportedPolicy] | None = None,
    kept: Collection[cst.CSTNode] = (),
) -> _Keywords:
    """FSDP1's keyword arguments (after the module) into `parts`, or problems into `out`."""
    found = _Keywords()
    for arg in args:
        if arg.star:
            out.problems.append(Problem(arg, "FSDP(..., *args or **kwargs)", *_UNMAPPED))
            continue
        if arg.keyword is None:  # (once per call, at its first one)
            if arg is next(a for a in args if a.keyword is None):
                count = sum(a.keyword is None and not a.star for a in args)
                what = f"FSDP(module, {code(arg.value)}{', ...' if count > 1 else ''}): {count} argument(s) by position"
                out.problems.append(Problem(arg, what, *_POSITIONAL))
            continue
        name, value = arg.keyword.value, arg.value
        if name == "auto_wrap_policy":
            found.policy = None if isinstance(value, cst.Name) and value.value == "None" else value
        elif name == "sharding_strategy" and not (isinstance(value, cst.Name) and value.value == "None"):
            found.strategy = fsdp1(value)
            if found.strategy is None or not found.strategy.startswith("ShardingStrategy."):
                found.strategy = None  # a strategy computed at run time: fsdp1_options decides (with the mesh)
                parts.at_run_time[name] = code(value)
        elif name == "device_mesh":
            found.mesh = code(value)
        elif name == "process_group":
            found.group = arg
        elif name == "mixed_precision" and isinstance(value, cst.Name) and value.value in (imported or {}):
            policy = (imported or {})[value.value]
            if policy.kept is not None and not policy.refused:  # FSDP1's policy, which fsdp1_options reads
                parts.at_run_time[name] = code(value)
            else:
                _imported_precision(value.value, policy, parts, out, arg)
        elif name == "mixed_precision" and resolve(value) in kept:
            parts.at_run_time[name] = code(value)  # (dpo-v2's `mixed_precision=mixed_precision`, its name used again)
        elif name == "mixed_precision":
            _mixed_precision(resolve(value), value, code, fsdp1, parts, out)
        elif name == "cpu_offload":
            _cpu_offload(resolve(value), value, code, fsdp1, parts, out)
        elif name == "sync_module_states" and _literal_bool(value) is not None:
            parts.sync = bool(_literal_bool(value))
        elif name == "sync_module_states":
            parts.sync_code = code(value)
        elif name == "ignored_modules":
            parts.ignored = code(value)
        elif name == "ignored_states":  # FSDP1 takes modules or parameters there; which, is known at run time
            parts.pre.append(f"fsdp_ignored_states = list({code(value)})")
            parts.ignored = "[s for s in fsdp_ignored_states if isinstance(s, torch.nn.Module)]"
            parts.ignored_params = "{s for s in fsdp_ignored_states if isinstance(s, torch.nn.Parameter)}"
            out.imports.append(("torch", None))
        elif name == "param_init_fn":
            parts.param_init_fn = code(value)
        elif name in _DROPPED:
            parts.notes.append(f"{name}={code(value)} dropped: {_DROPPED[name]}")
        else:
            why = "FSDP2 has no such argument and this tool does not map it yet"
            out.problems.append(Problem(arg, f"FSDP(..., {name}=...)", why, _UNMAPPED[1]))
    return found


def _placement(found: _Keywords, code: Code, parts: _Parts, out: Construction, mesh_name: str = "mesh") -> None:
    """The ranks the units shard over: process_group, device_mesh and the sharding strategy as fully_shard's mesh
    (and reshard_after_forward), built by statements named `mesh_name` where one is needed."""
    strategy, mesh = found.strategy, found.mesh
    kind = (strategy or "ShardingStrategy.FULL_SHARD").split(".", 1)[-1]
    if "sharding_strategy" in parts.at_run_time:  # the strategy decides the mesh: both at run time
        if found.group is not None:
            parts.at_run_time["process_group"] = code(found.group.value)
        if mesh is not None:
            parts.at_run_time["device_mesh"] = mesh
        _run_time(parts, out)
        return
    if found.group is not None:
        group = code(found.group.value)
        if kind in ("FULL_SHARD", "SHARD_GRAD_OP") and mesh is None:  # the ranks it shards over, as a 1-D mesh
            parts.pre.append(
                f'{mesh_name} = DeviceMesh.from_group({group}, "cuda" if torch.cuda.is_available() else "cpu")'
            )
            out.imports += [("torch.distributed.device_mesh", "DeviceMesh"), ("torch", None)]
        elif kind in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") and mesh is None:
            # FSDP1 shards within the first group (intra-node) and all-reduces across the second (inter-node): the
            # 2-D (replicate, shard) mesh over the same groups
            parts.pre.append(f"{mesh_name} = hybrid_mesh({group})")
            out.imports.append((RUNTIME, "hybrid_mesh"))
        else:
            why = "a process group for NO_SHARD, or beside a device_mesh"
            fix = "build the mesh with init_device_mesh (or DeviceMesh.from_group) and pass it as mesh="
            out.problems.append(Problem(found.group, "FSDP(..., process_group=...)", why, fix))
            return
        mesh = mesh_name
    _strategy(strategy, mesh, parts, out, mesh_name)
    if parts.at_run_time:
        _run_time(parts, out)


def _run_time(parts: _Parts, out: Construction) -> None:
    """The keywords known only at run time as one fsdp1_options(...) call, spread into fsdp_kwargs."""
    given = ", ".join(f"{k}={v}" for k, v in parts.at_run_time.items())
    parts.kwargs[_AT_RUN_TIME] = f"fsdp1_options({given})"
    parts.notes.append(
        f"{', '.join(parts.at_run_time)} known only at run time: fsdp1_options maps the values as FSDP1 applied them "
        "(and raises for one FSDP2 cannot be given)"
    )
    out.imports.append((RUNTIME, "fsdp1_options"))


@dataclass
class UnitKeywords:
    """FSDP1's keywords for one unit as fully_shard's: `kwargs` (keyword -> code), the statements that must run
    first (`pre`, a mesh), the comments, imports, and problems."""

    kwargs: dict[str, str]
    pre: list[str]
    notes: list[str]
    imports: list[tuple[str, str | None]]
    problems: list[Problem]


def unit_keywords(args: Sequence[cst.Arg], code: Code, fsdp1: Fsdp1, resolve: Resolve, mesh_name: str) -> UnitKeywords:
    """For a unit that is one module (`wrap()`'s): keywords that would need statements around the module (a policy,
    ignored modules, initialization, buffer_dtype's cast) are problems."""
    parts, out = _Parts(), Construction()
    found = _read(args, code, fsdp1, resolve, parts, out)
    around = {
        "auto_wrap_policy": found.policy is not None,
        "ignored_modules/ignored_states": parts.ignored is not None,
        "param_init_fn": parts.param_init_fn is not None,
        "sync_module_states=True": parts.sync,
        "MixedPrecision(buffer_dtype=...)": parts.buffer_dtype is not None,
        "a keyword known only at run time": bool(parts.at_run_time) or parts.sync_code is not None,
    }
    for name in (name for name, present in around.items() if present):
        why = "it needs statements around the module, which a wrap() call inside an expression cannot have"
        out.problems.append(Problem(args[0], f"{name} for wrap()", why, "shard those modules by hand"))
    if not out.problems:
        _placement(found, code, parts, out, mesh_name)
    return UnitKeywords(parts.kwargs, parts.pre, parts.notes, out.imports, out.problems)


_UNMAPPED = (
    "not mapped by fsdp-legacy migrate",
    "write the fully_shard calls by hand (docs/migration.md has the mapping)",
)
_POSITIONAL = (
    "FSDP1's parameters after `module` changed order between releases (torch 1.11: process_group, cpu_offload, "
    "fsdp_auto_wrap_policy, backward_prefetch; 1.12 put sharding_strategy second; 2.1 renamed ignored_parameters "
    "to ignored_states), so which one a value passed by position is cannot be read from the text",
    "pass it by keyword (`FSDP(module, process_group=..., sharding_strategy=..., ...)` for the release the program "
    "ran on), then migrate again",
)


def _imported_precision(name: str, policy: ImportedPolicy, parts: _Parts, out: Construction, arg: cst.Arg) -> None:
    """`mixed_precision=name`, a MixedPrecision(...) of another file of the program: that file rewrites it as FSDP2's
    policy (policies.py) where every construction taking it becomes fully_shard."""
    why = None
    if policy.kept is not None:
        why = f"the MixedPrecision `{name}` it takes ({policy.origin}) stays FSDP1's: {policy.kept}"
    elif policy.buffer_dtype is not None and not re.fullmatch(r"torch\.\w+", policy.buffer_dtype):
        why = f"the buffer_dtype of `{name}` ({policy.origin}) is `{policy.buffer_dtype}`, a name this file may lack"
    if why is not None:
        out.problems.append(Problem(arg, f"FSDP(..., mixed_precision={name})", why, _UNMAPPED[1]))
        return
    parts.kwargs["mp_policy"] = name
    parts.notes.append("FSDP1 ran BatchNorm modules in fp32 units of their own under mixed precision; FSDP2 does not")
    parts.buffer_dtype = policy.buffer_dtype
    if policy.buffer_dtype is not None:  # (torch.<dtype>, checked above)
        out.imports.append(("torch", None))


def _mixed_precision(
    value: cst.BaseExpression, written: cst.BaseExpression, code: Code, fsdp1: Fsdp1, parts: _Parts, out: Construction
) -> None:
    if isinstance(value, cst.Name) and value.value == "None":
        return
    if not (isinstance(value, cst.Call) and fsdp1(value.func) == "MixedPrecision"):
        parts.at_run_time["mixed_precision"] = code(written)  # a policy known at run time: fsdp1_options reads it
        return
    policy, buffer_dtype, refused = mixed_precision_policy(value, code)
    if refused:
        why = "FSDP2's MixedPrecisionPolicy has no counterpart"
        out.problems.append(Problem(value, f"MixedPrecision({', '.join(refused)})", why, _UNMAPPED[1]))
        return
    # A MixedPrecision assigned to a name is rewritten where it is assigned; an inline one here.
    parts.kwargs["mp_policy"] = code(written) if written is not value else policy
    out.imports.append((FSDP2, "MixedPrecisionPolicy"))
    parts.notes.append("FSDP1 ran BatchNorm modules in fp32 units of their own under mixed precision; FSDP2 does not")
    parts.buffer_dtype = buffer_dtype


def _cpu_offload(
    value: cst.BaseExpression, written: cst.BaseExpression, code: Code, fsdp1: Fsdp1, parts: _Parts, out: Construction
) -> None:
    if isinstance(value, cst.Name) and value.value == "None":
        return
    if isinstance(value, cst.Call) and fsdp1(value.func) == "CPUOffload":
        flags = [(a.keyword.value if a.keyword else "offload_params", _literal_bool(a.value)) for a in value.args]
        if all(k == "offload_params" and v is not None for k, v in flags) and len(flags) <= 1:
            if flags and flags[0][1]:
                parts.kwargs["offload_policy"] = "CPUOffloadPolicy()"
                out.imports.append((FSDP2, "CPUOffloadPolicy"))
            return
    parts.at_run_time["cpu_offload"] = code(written)  # known at run time (`CPUOffload(offload_params=cfg.offload)`)


def _strategy(strategy: str | None, mesh: str | None, parts: _Parts, out: Construction, mesh_name: str) -> None:
    kind = (strategy or "ShardingStrategy.FULL_SHARD").split(".", 1)[1]
    if kind in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2"):
        parts.kwargs["reshard_after_forward"] = "False"
    if kind in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD") and mesh is None:
        # FSDP1 shards HYBRID within a node (its local ranks) and replicates across nodes; NO_SHARD replicates on
        # every rank: both are FSDP2's 2-D (replicate, shard) mesh.
        shard = "1" if kind == "NO_SHARD" else 'int(os.environ["LOCAL_WORLD_SIZE"])'
        parts.pre.append(
            f"{mesh_name} = init_device_mesh(\n"
            f'    "cuda" if torch.cuda.is_available() else "cpu",\n'
            f"    (torch.distributed.get_world_size() // {shard}, {shard}),\n"
            f'    mesh_dim_names=("replicate", "shard"),\n'
            f")"
        )
        mesh = mesh_name
        out.imports += [("torch.distributed.device_mesh", "init_device_mesh"), ("torch", None), ("os", None)]
    if mesh is not None:
        parts.kwargs["mesh"] = mesh


def _units(
    model: str,
    policy: cst.BaseExpression | None,
    code: Code,
    fsdp1: Fsdp1,
    resolve: Resolve,
    parts: _Parts,
    out: Construction,
    meta: bool,
) -> list[str]:
    """The fully_shard calls: over the policy's classes, through apply_fully_shard, or the root alone."""
    classes = None if policy is None else _policy_classes(resolve(policy), code, fsdp1)
    at_run_time = bool(parts.at_run_time) or parts.sync_code is not None
    if parts.param_init_fn is not None or meta or (classes is None and policy is not None) or at_run_time:
        return [_through_runtime(model, policy, code, parts, out, meta)]
    if parts.sync:
        parts.pre.append(
            f"for tensor in [*{model}.parameters(), *{model}.buffers()]:  # FSDP1's sync_module_states\n"
            "    torch.distributed.broadcast(tensor.detach(), src=0)"
        )
        out.imports.append(("torch", None))
    skip = ""
    if parts.ignored is not None:
        # FSDP1 never wraps an ignored module (nor anything inside it), whatever the policy says.
        parts.pre.append(f"fsdp_ignored = {{m for top in {parts.ignored} for m in top.modules()}}")
        ignored = "{p for m in fsdp_ignored for p in m.parameters()}"
        parts.kwargs["ignored_params"] = ignored + (f" | {parts.ignored_params}" if parts.ignored_params else "")
        skip = " and module not in fsdp_ignored"
    kwargs = ", **fsdp_kwargs" if parts.kwargs else ""
    if classes is None:
        return [f"fully_shard({model}{kwargs})"]
    return [
        f"for module in reversed(list({model}.modules())):  # children before parents, as FSDP1 wraps",
        f"    if module is not {model} and isinstance(module, {classes}){skip}:",
        f"        fully_shard(module{kwargs})",
        f"fully_shard({model}{kwargs})",
    ]


def _through_runtime(
    model: str, policy: cst.BaseExpression | None, code: Code, parts: _Parts, out: Construction, meta: bool
) -> str:
    """apply_fully_shard: the policy evaluated as FSDP1 evaluates it, and each unit initialized as FSDP1 does."""
    out.imports.append((RUNTIME, "apply_fully_shard"))
    if policy is not None:
        parts.notes.append("the policy is evaluated as FSDP1 evaluates it, each unit sharded with fully_shard")
    if parts.param_init_fn is not None or meta:
        out.materializes = True
        parts.notes.append(
            "a unit still on the meta device is materialized just before it is sharded, as FSDP1 does "
            "(param_init_fn on each of its modules, else to_empty + reset_parameters)"
        )
    if parts.sync or parts.sync_code is not None:
        parts.notes.append("sync_module_states: each unit is broadcast from rank 0 before it is sharded")
    if parts.ignored_params:  # (apply_fully_shard adds the ignored modules' own)
        parts.kwargs["ignored_params"] = parts.ignored_params
    extra = [f"ignored_modules={parts.ignored}"] if parts.ignored is not None else []
    extra += [f"param_init_fn={parts.param_init_fn}"] if parts.param_init_fn is not None else []
    extra += ["sync_module_states=True"] if parts.sync else []
    extra += [f"sync_module_states={parts.sync_code}"] if parts.sync_code is not None else []
    extra += ["**fsdp_kwargs"] if parts.kwargs else []
    return f"apply_fully_shard({', '.join([model, 'None' if policy is None else code(policy), *extra])})"


def _policy_classes(policy: cst.BaseExpression, code: Code, fsdp1: Fsdp1) -> str | None:
    """The classes a ModuleWrapPolicy or a transformer_auto_wrap_policy partial wraps, as a tuple's code."""
    if not isinstance(policy, cst.Call):
        return None
    classes: cst.BaseExpression | None = None
    if fsdp1(policy.func) == "ModuleWrapPolicy" and len(policy.args) == 1:
        classes = policy.args[0].value
    elif code(policy.func) in ("functools.partial", "partial") and policy.args:
        if fsdp1(policy.args[0].value) == "transformer_auto_wrap_policy":
            found = [a.value for a in policy.args[1:] if a.keyword and a.keyword.value == "transformer_layer_cls"]
            classes = found[0] if len(found) == 1 and len(policy.args) == 2 else None
    if isinstance(classes, (cst.Set, cst.List, cst.Tuple)):
        names = [code(e.value) for e in classes.elements if isinstance(e, cst.Element)]
        return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"
    return None if classes is None else f"tuple({code(classes)})"


def policy_names(node: cst.CSTNode, fsdp1: Fsdp1) -> list[cst.CSTNode]:
    """The FSDP1 wrap policies named inside `node` (a function that builds a policy): torch's policy functions and
    classes, which apply_fully_shard evaluates as FSDP1 does."""
    found: list[cst.CSTNode] = []

    class _Names(cst.CSTVisitor):
        def on_visit(self, inner: cst.CSTNode) -> bool:
            if isinstance(inner, (cst.Name, cst.Attribute)) and fsdp1(inner) in WRAP_POLICIES:
                found.append(inner)
                return False
            return True

    node.visit(_Names())
    return found


def module_first(call: cst.Call) -> cst.Call:
    """`FSDP(module=model, ...)` (torchtune's recipes write it so) read as `FSDP(model, ...)`: the same argument,
    by position. Any other call as it is."""
    named = [a for a in call.args if a.keyword is not None and a.keyword.value == "module"]
    if len(named) != 1 or any(a.keyword is None for a in call.args):
        return call
    first = named[0].with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT)
    return call.with_changes(args=[first, *(a for a in call.args if a is not named[0])])


def leading(built: Construction, original: cst.SimpleStatementLine) -> list[cst.EmptyLine]:
    """The lines above what `FSDP(...)`'s statement became: its own, the notes, then the comments written inside it
    (the new code is built from text, without them), less those the new statements hold already."""

    class _Comments(cst.CSTVisitor):
        def __init__(self) -> None:
            super().__init__()
            self.found: list[str] = []

        def visit_Comment(self, node: cst.Comment) -> None:
            self.found.append(node.value)

    inside, kept = _Comments(), _Comments()
    original.body[0].visit(inside)
    original.trailing_whitespace.visit(inside)
    for statement in built.statements:
        statement.visit(kept)
    comments = [*built.notes, *(c for c in inside.found if c not in kept.found)]
    return [*original.leading_lines, *(cst.EmptyLine(comment=cst.Comment(c)) for c in comments)]
