"""FSDP1's state-dict configs (`FullStateDictConfig(offload_to_cpu=..., rank0_only=...)` and the rest) as the
StateDictOptions a state_dict_type block's calls take.

Literal values give literal options. A config with a computed value (`offload_to_cpu=device.type != "cpu"`) is
mapped only when it is a name bound once (bindings.py): its assignment becomes a helper of
fsdp_legacy.migrate.runtime called with the same arguments, so every value is evaluated where FSDP1's config was and
the decision is made at run time; the calls then take that name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst

from .bindings import Binding, Bindings

Fsdp1 = Callable[[cst.CSTNode], "str | None"]

FULL_HELPER = "full_state_dict_options"
SHARDED_HELPER = "sharded_state_dict_options"


@dataclass(frozen=True)
class Config:
    """The options code the calls take; the config's assignment to take out (`drop`: its only use is mapped) or to
    call `helper` instead (`rewrite`)."""

    options: str
    drop: Binding | None = None
    rewrite: Binding | None = None
    helper: str = ""
    named: Binding | None = None  # a literal config's name used by several blocks: out when every one goes


def _bool(node: cst.BaseExpression) -> bool | None:
    return {"True": True, "False": False}.get(node.value) if isinstance(node, cst.Name) else None


def options_code(full: bool, offload: bool) -> str:
    # DSD's full + cpu_offload is FSDP1's rank0_only (on the CPU); its full alone is every rank's copy on the
    # device, where FSDP1's offload_to_cpu put it on the CPU: the same values either way.
    settings = (["full_state_dict=True"] if full else []) + (["cpu_offload=True"] if offload else [])
    return f"StateDictOptions({', '.join(settings)})"


def read(
    node: cst.BaseExpression | None, cls: str, offload_default: bool, fsdp1: Fsdp1, bindings: Bindings | None
) -> Config | None:
    """`node` (a config argument of state_dict_type, None where not given) for a block of kind `cls`'s (full or
    sharded); None where it cannot be read faithfully."""
    full = cls.startswith("Full")
    if node is None or (isinstance(node, cst.Name) and node.value == "None"):
        return Config(options_code(full, False if full else offload_default))
    binding = None
    if bindings is not None and isinstance(node, cst.Name):
        binding = bindings.single(node) or bindings.reaching(node)
    value = binding.value if binding is not None else node
    if not isinstance(value, cst.Call) or fsdp1(value.func) != cls:
        return None
    fields = ("offload_to_cpu", "rank0_only") if full else ("offload_to_cpu",)
    values: dict[str, cst.BaseExpression] = {}
    for index, arg in enumerate(value.args):
        key = arg.keyword.value if arg.keyword else fields[index] if index < len(fields) else None
        if arg.star or key is None or key not in fields or key in values:
            return None
        values[key] = arg.value
    literal = {key: _bool(v) for key, v in values.items()}
    if None not in literal.values():
        offload = literal.get("rank0_only", False) if full else literal.get("offload_to_cpu", offload_default)
        single = binding is not None and len(binding.uses) == 1
        return Config(options_code(full, bool(offload)), drop=binding if single else None, named=binding)
    if binding is None or not isinstance(node, cst.Name):
        return None  # computed inline: evaluated where the block starts, which no call inside it can repeat
    return Config(node.value, rewrite=binding, helper=FULL_HELPER if full else SHARDED_HELPER)


def may_be_full(options: str) -> bool:
    """Whether options code gives full state dicts (a name: decided at run time)."""
    return "full_state_dict=True" in options or not options.startswith("StateDictOptions(")
