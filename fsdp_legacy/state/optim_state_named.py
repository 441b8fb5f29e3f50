"""Optimizers whose state dict names the parameters instead of numbering them: torch.distributed.optim's
_NamedOptimizer (as torchrec uses) keys `state` and each group's `params` by the names the optimizer was given, the
model's `named_parameters()` names (wrapper prefixes included).

FSDP.optim_state_dict saves them as torch does, as it saves an optimizer keyed by ids: such a dict is re-keyed by id
(the position of the parameter among the optimizer's parameters) first; the groups keep their saved order.
FSDP.optim_state_dict_to_load(..., is_named_optimizer=True) keys what it returns by those names again.
"""

from typing import Any

from torch import nn


def keyed_by_name(osd: dict[str, Any]) -> bool:
    """Whether an optimizer state dict names its parameters (torch tells by the first state key; a rank without
    state still has the names in its groups)."""
    keys = [*osd.get("state", {}), *(key for group in osd.get("param_groups", ()) for key in group["params"])]
    return bool(keys) and isinstance(keys[0], str)


def by_param_ids(model: nn.Module, params: list[nn.Parameter], osd: dict[str, Any]) -> dict[str, Any]:
    """`osd` (keyed by name) keyed by the ids of the optimizer's `params`, in order. A parameter's name is its name in
    `model` (the first, if shared), as torch's FSDP1 finds it."""
    name_of: dict[nn.Parameter, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        name_of.setdefault(param, name)
    id_of = {name_of[param]: key for key, param in enumerate(params) if param in name_of}
    groups = osd.get("param_groups", [])
    unknown = [key for key in [*osd["state"], *(k for g in groups for k in g["params"])] if key not in id_of]
    if unknown:
        raise ValueError(
            f"The optimizer state dict is keyed by parameter names, but {sorted(map(str, unknown))[:8]} name no "
            "parameter the optimizer holds: build the named optimizer from the FSDP-wrapped model's "
            "named_parameters() (after wrapping)."
        )
    result: dict[str, Any] = {"state": {id_of[name]: value for name, value in osd["state"].items()}}
    if "param_groups" in osd:
        result["param_groups"] = [
            {k: [id_of[name] for name in v] if k == "params" else v for k, v in group.items()} for group in groups
        ]
    return result


def by_param_names(model: nn.Module, optim: Any, osd: dict[str, Any]) -> dict[str, Any]:
    """`osd` (keyed by the ids of the optimizer's parameters, as optim_state_dict_to_load returns it) keyed by the
    parameters' names in `model` instead: what a named optimizer loads. The reverse of `by_param_ids`; each group lists
    its names sorted, as torch's FSDP1 does."""
    name_of: dict[nn.Parameter, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        name_of.setdefault(param, name)
    params = [param for group in optim.param_groups for param in group["params"]]
    unnamed = [key for key, param in enumerate(params) if param not in name_of]
    if unnamed:
        raise ValueError(
            f"is_named_optimizer=True: the optimizer's parameters {unnamed[:8]} (by position) are not parameters of "
            "the model, so they have no name to key the state by: build the optimizer from the model's parameters."
        )
    result: dict[str, Any] = {"state": {name_of[params[key]]: value for key, value in osd["state"].items()}}
    if "param_groups" in osd:
        result["param_groups"] = [
            {k: sorted(name_of[params[key]] for key in v) if k == "params" else v for k, v in group.items()}
            for group in osd["param_groups"]
        ]
    return result
