"""FSDP1's optimizer-state API as torch.distributed.checkpoint.state_dict's helpers.

`FSDP.optim_state_dict` and the legacy `full_optim_state_dict` / `sharded_optim_state_dict` become
`get_optimizer_state_dict`. `optim_state_dict_to_load` and the legacy `shard_full_optim_state_dict` /
`scatter_full_optim_state_dict` / `flatten_sharded_optim_state_dict` give what an FSDP1 program hands to
`optim.load_state_dict`: with that call (the rewriter finds the pair) they become `set_optimizer_state_dict`, which
loads. `rekey_optim_state_dict` becomes fsdp_legacy.migrate.runtime's. An argument FSDP2 has no counterpart for
(`optim_input`, `group`, ...) is mapped only at FSDP1's default; anything else is a Refusal and the call stays."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst

Code = Callable[[cst.CSTNode], str]
Fsdp1 = Callable[[cst.CSTNode], "str | None"]

PREFIX = "FullyShardedDataParallel."
# name -> its parameters, of which the first `required` are required.
_PARAMS: dict[str, tuple[int, tuple[str, ...]]] = {
    "optim_state_dict": (2, ("model", "optim", "optim_state_dict", "group")),
    "full_optim_state_dict": (2, ("model", "optim", "optim_input", "rank0_only", "group")),
    "sharded_optim_state_dict": (2, ("model", "optim", "group")),
    "optim_state_dict_to_load": (
        3,
        ("model", "optim", "optim_state_dict", "is_named_optimizer", "load_directly", "group"),
    ),
    "shard_full_optim_state_dict": (2, ("full_optim_state_dict", "model", "optim_input", "optim")),
    "scatter_full_optim_state_dict": (2, ("full_optim_state_dict", "model", "optim_input", "optim", "group")),
    "flatten_sharded_optim_state_dict": (3, ("sharded_optim_state_dict", "model", "optim")),
    "rekey_optim_state_dict": (3, ("optim_state_dict", "optim_state_key_type", "model", "optim_input", "optim")),
}
SAVES = ("optim_state_dict", "full_optim_state_dict", "sharded_optim_state_dict")
LOADS = (
    "optim_state_dict_to_load",
    "shard_full_optim_state_dict",
    "scatter_full_optim_state_dict",
    "flatten_sharded_optim_state_dict",
)
REKEY = "rekey_optim_state_dict"
# Parameters FSDP2 has nothing for: mapped only at FSDP1's default. (The sharded optimizer state FSDP2 shards over
# the model's mesh, which is where FSDP1's `group` had to match the model's process group.)
_ONLY_AT = {"optim_input": "None", "group": "None", "is_named_optimizer": "False", "load_directly": "False"}
# What the legacy loads take, whatever the model's state-dict type: a full dict on every rank, a full dict on rank 0
# (sent to the others, whose argument FSDP1 ignores, as DSD does), or the sharded dict of sharded_optim_state_dict.
_LOAD_OPTIONS = {
    "shard_full_optim_state_dict": "StateDictOptions(full_state_dict=True)",
    "scatter_full_optim_state_dict": "StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)",
    "flatten_sharded_optim_state_dict": "StateDictOptions()",
}
_ONLY_AT_FIX = {
    "optim_input": "pass the optimizer as `optim=` instead (FSDP1 then ignores optim_input), and run it again",
    "group": "FSDP2 shards optimizer state over the model's mesh: drop `group` once the model is sharded over it",
}
_FIX = (
    "load with `set_optimizer_state_dict(model, optim, osd, options=StateDictOptions(...))` and save with "
    "`get_optimizer_state_dict` (docs/migration.md section 7)"
)


@dataclass(frozen=True)
class Refusal:
    """Why a call stays as it was (worded for the report)."""

    what: str
    why: str
    fix: str = _FIX


@dataclass(frozen=True)
class Load:
    """A to-load call: the model, the state dict's code, and the optimizer it names (None: not given)."""

    api: str
    model: str
    osd: str
    optim: str | None


def api_of(name: str | None) -> str | None:
    """`FullyShardedDataParallel.full_optim_state_dict` -> `full_optim_state_dict`; None for other names."""
    if name is None or not name.startswith(PREFIX):
        return None
    api = name[len(PREFIX) :]
    return api if api in _PARAMS else None


# torch before 2.1 took `optim_state_dict_to_load(optim_state_dict, model, optim)` (ml-4m's checkpoint helpers)
_BEFORE_2_1 = ("optim_state_dict", "model", "optim")


def _bind(
    api: str, call: cst.Call, code: Code, is_model: Callable[[str], bool] | None = None, directly: bool = False
) -> dict[str, cst.BaseExpression] | Refusal:
    required, params = _PARAMS[api]
    positional = [a.value for a in call.args if a.keyword is None and not a.star]
    if api == "optim_state_dict_to_load" and is_model is not None and len(positional) == len(call.args) == 3:
        if is_model(code(positional[1])) and not is_model(code(positional[0])):
            params = _BEFORE_2_1  # (its model second, where the file knows it wrapped)
    bound: dict[str, cst.BaseExpression] = {}
    for index, arg in enumerate(call.args):
        key = arg.keyword.value if arg.keyword else params[index] if index < len(params) else None
        if arg.star or key not in params or key in bound:
            return Refusal(f"FSDP.{api}(...)", "its arguments cannot be read from the source (*args, **kwargs)")
        bound[key] = arg.value
    for key, default in _ONLY_AT.items():
        if directly and key == "load_directly":
            continue  # (a statement that loads: what set_optimizer_state_dict does)
        if key in bound and code(bound[key]) != default:
            why = f"`{key}` has no FSDP2 counterpart (mapped only at FSDP1's default, {default})"
            return Refusal(f"FSDP.{api}(..., {key}={code(bound[key])})", why, _ONLY_AT_FIX.get(key, _FIX))
    missing = [p for p in params[:required] if p not in bound]
    if missing:
        return Refusal(f"FSDP.{api}(...) without {', '.join(missing)}", "its arguments cannot be read")
    return bound


def save(
    api: str, call: cst.Call, code: Code, options: str, own: Callable[[cst.BaseExpression, str], bool]
) -> str | Refusal:
    """`get_optimizer_state_dict(...)` for a save; `options` is what the model's state-dict type gives
    FSDP.optim_state_dict (the legacy saves have their own). `own(value, optim)`: whether a dict passed in is the
    optimizer's own `optim.state_dict()`, which FSDP1 converts when none is given (Infinity passes it, modalities
    through a name)."""
    args = _bind(api, call, code)
    if isinstance(args, Refusal):
        return args
    given = args.get("optim_state_dict")
    if (
        api == "optim_state_dict"
        and given is not None
        and code(given) != "None"
        and not own(given, code(args["optim"]))
    ):
        why = "a state dict passed in to convert is not mapped"
        return Refusal("FSDP.optim_state_dict(..., optim_state_dict=...)", why)
    if api == "full_optim_state_dict":
        rank0_only = code(args.get("rank0_only", cst.Name("True")))
        if rank0_only not in ("True", "False"):
            return Refusal(f"FSDP.full_optim_state_dict(..., rank0_only={rank0_only})", "rank0_only is computed")
        # FSDP1 gathers onto the CPU; rank0_only=True (its default): rank 0 only, {} on the others, as DSD's
        # full_state_dict + cpu_offload; rank0_only=False: every rank's full copy (DSD's on the device).
        options = "StateDictOptions(full_state_dict=True" + (", cpu_offload=True)" if rank0_only == "True" else ")")
    elif api == "sharded_optim_state_dict":
        options = "StateDictOptions(cpu_offload=True)"  # FSDP1's sharded optimizer state is offloaded as well
    return f"get_optimizer_state_dict({code(args['model'])}, {code(args['optim'])}, options={options})"


def load(
    api: str, call: cst.Call, code: Code, is_model: Callable[[str], bool] | None = None, directly: bool = False
) -> Load | Refusal:
    """The to-load call's model, state dict and optimizer (`is_model`: whether a code is a model the file knows
    wrapped, which tells the pre-2.1 order of optim_state_dict_to_load's arguments; `directly`: a statement with
    `load_directly=True`)."""
    args = _bind(api, call, code, is_model, directly)
    if isinstance(args, Refusal):
        return args
    osd = next(args[p] for p in ("optim_state_dict", "full_optim_state_dict", "sharded_optim_state_dict") if p in args)
    optim = code(args["optim"]) if "optim" in args and code(args["optim"]) != "None" else None
    return Load(api, code(args["model"]), code(osd), optim)


def load_options(api: str) -> str | None:
    """The options of a legacy load; None for optim_state_dict_to_load, which takes the model's state-dict type."""
    return _LOAD_OPTIONS.get(api)


def load_code(loading: Load, optimizer: str, options: str) -> str | Refusal:
    """`set_optimizer_state_dict(...)` for `loading` handed to `optimizer.load_state_dict`."""
    if loading.optim is not None and loading.optim != optimizer:
        why = f"the state dict is laid out for `{loading.optim}` but loaded into `{optimizer}`"
        return Refusal(f"FSDP.{loading.api}(...) loaded into another optimizer", why)
    # FSDP1's FULL optimizer state dicts share one `step` tensor among a unit's parameters; FSDP2 would advance it
    # once per parameter (runtime.unshared_optim_state gives each its own).
    osd = f"unshared_optim_state({loading.osd})" if "full_state_dict=True" in options else loading.osd
    return f"set_optimizer_state_dict({loading.model}, {optimizer}, {osd}, options={options})"


def rekey(call: cst.Call, code: Code, fsdp1: Fsdp1) -> str | Refusal:
    """fsdp_legacy.migrate.runtime's rekey_optim_state_dict, the key type as a string."""
    args = _bind(REKEY, call, code)
    if isinstance(args, Refusal):
        return args
    key_type = args.get("optim_state_key_type")
    name = fsdp1(key_type) if key_type is not None else None
    if name not in ("OptimStateKeyType.PARAM_NAME", "OptimStateKeyType.PARAM_ID"):
        why = "its key type is not written as OptimStateKeyType.PARAM_NAME or PARAM_ID"
        fix = 'call fsdp_legacy.migrate.runtime.rekey_optim_state_dict(osd, "PARAM_NAME" or "PARAM_ID", model, optim)'
        return Refusal("FSDP.rekey_optim_state_dict(...)", why, fix)
    assert name is not None
    optim = f", optim={code(args['optim'])}" if "optim" in args and code(args["optim"]) != "None" else ""
    osd, model = code(args["optim_state_dict"]), code(args["model"])
    return f'rekey_optim_state_dict({osd}, "{name.split(".")[1]}", {model}{optim})'
