"""Which names are FSDP1's, what to tell a person about each one the rewriter leaves in place, and the dotted name an
attribute chain spells."""

from __future__ import annotations

import libcst as cst

# Longest first: the first prefix that matches decides. fsdp_legacy's names are torch's, as a drop-in.
_MODULES = (
    "torch.distributed.fsdp.fully_sharded_data_parallel",
    "torch.distributed.fsdp.wrap",
    "torch.distributed.fsdp.api",
    "torch.distributed.fsdp",
    "fsdp_legacy.fully_sharded_data_parallel",
    "fsdp_legacy.wrap",
    "fsdp_legacy.api",
    "fsdp_legacy",
)
FSDP1_IMPORT_MODULES = frozenset(_MODULES)

WRAP_POLICIES = frozenset(
    {
        "always_wrap_policy",
        "lambda_auto_wrap_policy",
        "transformer_auto_wrap_policy",
        "size_based_auto_wrap_policy",
        "ModuleWrapPolicy",
        "CustomPolicy",
        "_or_policy",  # (private, but what llama-recipes and mistral-finetune combine their policies with)
    }
)
FSDP1_NAMES = WRAP_POLICIES | {
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "MixedPrecision",
    "CPUOffload",
    "BackwardPrefetch",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
    "FlatParameter",
    "enable_wrap",
    "wrap",
}

# Attributes that only exist inside FSDP1's implementation.
PRIVATE_ATTRIBUTES = frozenset(
    {"_flat_param", "_handle", "_handles", "_fsdp_wrapped_module", "_fsdp_handles", "_wrap_overrides"}
)

# Methods only an FSDP1 instance has (no_sync is DDP's too, so it is not here).
FSDP1_METHODS = frozenset({"clip_grad_norm_", "summon_full_params", "fsdp_modules", "check_is_root"})


def fsdp1_name(qualified: str) -> str | None:
    """`torch.distributed.fsdp.FullyShardedDataParallel.state_dict_type` -> `FullyShardedDataParallel.state_dict_type`;
    None for anything that is not FSDP1's (FSDP2's names in torch.distributed.fsdp included)."""
    for module in _MODULES:
        if qualified.startswith(module + "."):
            rest = qualified[len(module) + 1 :]
            return rest if rest.split(".")[0] in FSDP1_NAMES else None
    return None


_FSDP = "FullyShardedDataParallel."
_MANUAL_WRAP = (
    "manual wrapping is mapped only when every wrap() of the file is written inside an `enable_wrap(wrapper_cls=FSDP, "
    "...)` block whose keywords fully_shard can take (the other findings of this file say what stopped it)"
)
_MANUAL_WRAP_FIX = "call `fully_shard(module, ...)` on each module `wrap()` wrapped, children first"

# name -> (why it is left, the manual fix). Anything FSDP1 not listed gets the generic wording.
_ADVICE: dict[str, tuple[str, str]] = {
    _FSDP + "summon_full_params": (
        "FSDP2 has no summon_full_params; only `with FSDP.summon_full_params(...):` over a block that only reads is "
        "mapped (onto fsdp_legacy.migrate.runtime.full_params), not this use",
        "read inside `with full_params(model, ...):` (fsdp_legacy.migrate.runtime, the same keywords); to write, "
        "change each DTensor parameter's local shard (`p.to_local()`) or load a state dict",
    ),
    _FSDP + "full_optim_state_dict": (
        "mapped only as `FSDP.full_optim_state_dict(model, optim[, rank0_only=True/False])` (optim_input and group "
        "have no FSDP2 counterpart)",
        "`get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))`: "
        "rank 0's full state keyed by FQN, as FSDP1's (without cpu_offload: every rank's)",
    ),
    _FSDP + "sharded_optim_state_dict": (
        "mapped only as `FSDP.sharded_optim_state_dict(model, optim)`",
        "`get_optimizer_state_dict(model, optim, options=StateDictOptions(cpu_offload=True))`, saved with "
        "torch.distributed.checkpoint",
    ),
    _FSDP + "shard_full_optim_state_dict": (
        "mapped only where its result is loaded: `optim.load_state_dict(FSDP.shard_full_optim_state_dict(...))`, or "
        "through a name used only by a later `optim.load_state_dict(name)` in the same block",
        "`set_optimizer_state_dict(model, optim, unshared_optim_state(osd), options=StateDictOptions("
        "full_state_dict=True))` (unshared_optim_state: fsdp_legacy.migrate.runtime)",
    ),
    _FSDP + "scatter_full_optim_state_dict": (
        "mapped only where its result is loaded: `optim.load_state_dict(FSDP.scatter_full_optim_state_dict(...))`, "
        "or through a name used only by a later `optim.load_state_dict(name)` in the same block",
        "`set_optimizer_state_dict(model, optim, unshared_optim_state(osd), options=StateDictOptions("
        "full_state_dict=True, broadcast_from_rank0=True))`: rank 0's dict is sent, the others' ignored",
    ),
    _FSDP + "flatten_sharded_optim_state_dict": (
        "mapped only where its result is loaded by `optim.load_state_dict(...)`",
        "`set_optimizer_state_dict(model, optim, osd)` with the sharded dict (get_optimizer_state_dict + DCP load)",
    ),
    _FSDP + "optim_state_dict_to_load": (
        "mapped only where its result is loaded by `optim.load_state_dict(...)` (nested, or through a name)",
        "`set_optimizer_state_dict(model, optim, osd, options=StateDictOptions(...))`, which loads",
    ),
    _FSDP + "rekey_optim_state_dict": (
        "mapped only with its key type written as OptimStateKeyType.PARAM_NAME or PARAM_ID, and no optim_input",
        '`rekey_optim_state_dict(osd, "PARAM_NAME" or "PARAM_ID", model, optim=optim)` from '
        "fsdp_legacy.migrate.runtime",
    ),
    _FSDP + "set_state_dict_type": (
        "followed only when it is the model's one setter, a statement of its own with configs this tool reads, and "
        "every state-dict call on the model comes after it in its block",
        "use `get_model_state_dict`/`set_model_state_dict` with `StateDictOptions` at each call",
    ),
    "StateDictType.LOCAL_STATE_DICT": (
        "FSDP2 has no LOCAL (flat) state dict",
        "save SHARDED (`get_model_state_dict(model)` + torch.distributed.checkpoint); convert existing LOCAL "
        "checkpoints with `fsdp-legacy convert SRC DST --to dcp`",
    ),
    _FSDP + "state_dict_type": (
        "its type or configs are not ones this tool maps faithfully (LOCAL, positional or computed configs, "
        "offload_to_cpu without rank0_only)",
        "use `get_/set_model_state_dict` and `get_/set_optimizer_state_dict` with `StateDictOptions`",
    ),
    _FSDP + "apply": (
        "FSDP1's apply gathers the full parameters around fn and writes its in-place changes back; on FSDP2, "
        "nn.Module.apply runs fn on the DTensor shards (other random values, `.data` edits lost). Mapped only as "
        "`model.apply(fn)` on a name the file wraps or `FSDP.apply(model, fn)`, the arguments written out",
        "call `apply_full(model, fn)` (fsdp_legacy.migrate.runtime) on the FSDP2 model where FSDP1's apply ran",
    ),
    "enable_wrap": (_MANUAL_WRAP, _MANUAL_WRAP_FIX),
    "wrap": (_MANUAL_WRAP, _MANUAL_WRAP_FIX),
}


def advice(name: str) -> tuple[str, str]:
    """(why, fix) for an FSDP1 name left in place."""
    for key in (name, name.rsplit(".", 1)[0]):
        if key in _ADVICE:
            return _ADVICE[key]
    return (
        "fsdp-legacy migrate does not map this FSDP1 API (or not in this form)",
        "rewrite it onto fully_shard / FSDPModule / torch.distributed.checkpoint.state_dict (docs/migration.md)",
    )


# FSDP(...)'s keywords FSDP2 does without (construction.py drops them with a note where it sees them).
FSDP1_DROPPED_KWARGS = frozenset(
    {"use_orig_params", "limit_all_gathers", "backward_prefetch", "forward_prefetch", "device_id"}
)
# Those fully_shard_fsdp1 maps: through fsdp1_options, or apply_fully_shard's own.
FSDP1_MAPPED_KWARGS = frozenset(
    {
        "sharding_strategy",
        "mixed_precision",
        "cpu_offload",
        "process_group",
        "device_mesh",
        "auto_wrap_policy",
        "ignored_modules",
        "param_init_fn",
        "sync_module_states",
    }
)


def attribute_chain(node: cst.CSTNode) -> str | None:
    """`self._model` for an attribute chain of names; None for anything else."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        inner = attribute_chain(node.value)
        return None if inner is None else f"{inner}.{node.attr.value}"
    return None
