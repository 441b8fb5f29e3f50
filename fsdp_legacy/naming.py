"""torch FSDP1's naming: the wrapper's and the activation-checkpoint wrapper's attribute names, and clean FQNs.

State dicts, optimizer state and layouts name parameters by their clean FQN, as torch does: without the
`_fsdp_wrapped_module.` of FSDP units and the `_checkpoint_wrapped_module.` of activation-checkpoint wrappers
(applied before or after wrapping; each wrapper's own state-dict hooks strip and restore its prefix).
"""

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
FLAT_PARAM = "_flat_param"
CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"  # torch.distributed.algorithms._checkpoint's wrapper
TRANSPARENT_MODULES = (FSDP_WRAPPED_MODULE, CHECKPOINT_WRAPPED_MODULE)


def clean_fqn(name: str) -> str:
    """A parameter, buffer or module name as the user's model has it (no wrapper segments)."""
    return ".".join(part for part in name.split(".") if part not in TRANSPARENT_MODULES)


def join_fqn(path: str, name: str) -> str:
    """`path.name`, leaving out wrapper segments, so that names built while walking a module tree stay clean."""
    if name in TRANSPARENT_MODULES:
        return path
    return f"{path}.{name}" if path else name
