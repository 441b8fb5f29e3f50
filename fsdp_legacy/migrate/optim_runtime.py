"""The helpers a migrated program imports (through runtime.py) to carry FSDP1's optimizer state dicts over to FSDP2.

`unshared_optim_state`: FSDP1's FULL optimizer state dicts (`full_optim_state_dict`, `optim_state_dict`, and the
files saved from them) give every parameter of a unit the same `step` tensor, one per flat parameter. FSDP1 loads
it back per flat parameter; `set_optimizer_state_dict` keeps 0-dim tensors as they are, so FSDP2's optimizer would
then advance one shared counter once per parameter in every step (Adam's bias correction goes wrong). Each 0-dim
tensor is given its own copy first.

`loaded_optim_state_dict`: FSDP1's `osd = FSDP.optim_state_dict_to_load(model, optim, osd)` where `osd` is used
beyond one `optim.load_state_dict(osd)` (open_lm converts it under `if args.fsdp:` only, then loads either form):
the state is loaded into `optim` at once, and `optim`'s own state dict comes back, which a later
`optim.load_state_dict(osd)` takes as it is (the same values again), as it took FSDP1's result.

`rekey_optim_state_dict`: FSDP1's re-keying between parameter ids and FQNs, with the key type as a string
("PARAM_NAME" or "PARAM_ID") so that the migrated program names nothing of FSDP1's. FSDP2 keeps the original
parameters (DTensors, same FQNs), so the re-keying fsdp_legacy does for a plain model applies to a sharded one."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

from ..api import OptimStateKeyType
from ..state import optim_state_legacy

__all__ = ["loaded_optim_state_dict", "rekey_optim_state_dict", "unshared_optim_state"]


def unshared_optim_state(optim_state_dict: dict[str, Any] | None) -> dict[str, Any] | None:
    """`optim_state_dict` with a copy of each 0-dim tensor of its per-parameter state (the rest shared with the
    input); None or an empty dict (what a non-zero rank holds when rank 0 broadcasts) as it is."""
    if not optim_state_dict or "state" not in optim_state_dict:
        return optim_state_dict
    state = {
        key: {
            name: value.clone() if isinstance(value, torch.Tensor) and value.dim() == 0 else value
            for name, value in values.items()
        }
        for key, values in optim_state_dict["state"].items()
    }
    return {**optim_state_dict, "state": state}


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any], key_type: str, model: nn.Module, optim: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """FSDP1's `FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.<key_type>, model, optim=optim)`: the state and
    the param groups keyed by FQN ("PARAM_NAME") or by position in `optim`'s param groups ("PARAM_ID"; without
    `optim`, in `model.parameters()`); a dict already keyed so comes back as it is."""
    if key_type not in ("PARAM_NAME", "PARAM_ID"):
        raise ValueError(f'key_type must be "PARAM_NAME" or "PARAM_ID", not {key_type!r}')
    return optim_state_legacy.rekey_optim_state_dict(optim_state_dict, OptimStateKeyType[key_type], model, optim=optim)


def loaded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any], options: StateDictOptions
) -> dict[str, Any]:
    """Loads `optim_state_dict` (FSDP1's layout, keyed by FQN) into `optim` with set_optimizer_state_dict and
    returns `optim.state_dict()`: what FSDP1's optim_state_dict_to_load returned, a dict `optim.load_state_dict`
    takes."""
    if options.full_state_dict:
        optim_state_dict = cast(dict[str, Any], unshared_optim_state(optim_state_dict))
    set_optimizer_state_dict(model, optim, optim_state_dict, options=options)
    return optim.state_dict()
