"""Which names are FSDP1's, and what to tell a person about each one the rewriter leaves in place."""

from __future__ import annotations

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
PRIVATE_ATTRIBUTES = frozenset({"_flat_param", "_handle", "_handles", "_fsdp_wrapped_module", "_fsdp_handles"})

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

# name -> (why it is left, the manual fix). Anything FSDP1 not listed gets the generic wording.
_ADVICE: dict[str, tuple[str, str]] = {
    _FSDP + "summon_full_params": (
        "FSDP2 has no summon_full_params; only `with FSDP.summon_full_params(...):` over a block that only reads is "
        "mapped (onto fsdp_legacy.migrate.runtime.full_params), not this use",
        "read inside `with full_params(model, ...):` (fsdp_legacy.migrate.runtime, the same keywords); to write, "
        "change each DTensor parameter's local shard (`p.to_local()`) or load a state dict",
    ),
    _FSDP + "full_optim_state_dict": (
        "the legacy API keys state by parameter index and FSDP2 has no equivalent format",
        "`get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))` "
        "(keyed by FQN); convert saved files with `fsdp-legacy convert`",
    ),
    _FSDP + "sharded_optim_state_dict": (
        "the legacy API's sharded format has no FSDP2 counterpart",
        "`get_optimizer_state_dict(model, optim)` and save it with torch.distributed.checkpoint",
    ),
    _FSDP + "shard_full_optim_state_dict": (
        "the legacy API's input is keyed by parameter index",
        "`set_optimizer_state_dict(model, optim, osd, options=StateDictOptions(full_state_dict=True))` with an "
        "FQN-keyed state dict (`fsdp-legacy convert` rewrites saved files)",
    ),
    _FSDP + "scatter_full_optim_state_dict": (
        "the legacy API's input is keyed by parameter index",
        "`set_optimizer_state_dict(model, optim, osd, options=StateDictOptions(full_state_dict=True, "
        "broadcast_from_rank0=True))` with an FQN-keyed state dict",
    ),
    _FSDP + "rekey_optim_state_dict": (
        "FSDP2's optimizer state dicts are keyed by FQN already",
        "drop the rekeying and load with `set_optimizer_state_dict`",
    ),
    _FSDP + "set_state_dict_type": (
        "a state-dict type set for the rest of the program is not followed through the code by this slice",
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
    "enable_wrap": ("manual wrapping is not mapped", "call `fully_shard(module)` on each module `wrap()` wrapped"),
    "wrap": ("manual wrapping is not mapped", "call `fully_shard(module)` on each module `wrap()` wrapped"),
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
