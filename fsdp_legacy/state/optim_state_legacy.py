"""The older optimizer-state API that torch deprecated and is removing (full_optim_state_dict, sharded_optim_state_dict,
shard_full_optim_state_dict, flatten_sharded_optim_state_dict, scatter_full_optim_state_dict, rekey_optim_state_dict),
kept whole: thin wrappers over optim_state.py's saving and loading, with torch's defaults and FutureWarnings, and
`optim_input` (parameters or param-group dicts) standing in for an optimizer that is not given.
"""

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..api import FullOptimStateDictConfig, ShardedOptimStateDictConfig, StateDictType
from ..flat_param import FlatParameter
from .optim_entries import ParamOrder
from .optim_state import save_optim_state
from .optim_state_loading import optim_state_to_load
from .state_dict import clean_key

_OPTIM_INPUT_WARNING = (
    "The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. You may remove it from your "
    "code without changing its functionality."
)


def _deprecated(name: str, replacement: str) -> None:
    # torch's text, including the missing space before "is being".
    warnings.warn(
        f"``FullyShardedDataParallel.{name}``is being deprecated and is replaced by "
        f"``FullyShardedDataParallel.{replacement}``. ``FullyShardedDataParallel.{name}`` may be removed after "
        "PyTorch 2.2.",
        FutureWarning,
        stacklevel=3,
    )


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: Any = None,
    rank0_only: bool = True,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    _deprecated("full_optim_state_dict", "optim_state_dict")
    _check_optim_input(optim_input)
    config = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only)
    return save_optim_state(model, optim, None, StateDictType.FULL_STATE_DICT, config, group)


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    _deprecated("sharded_optim_state_dict", "optim_state_dict")
    return save_optim_state(model, optim, None, StateDictType.SHARDED_STATE_DICT, ShardedOptimStateDictConfig(), group)


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    _deprecated("shard_full_optim_state_dict", "optim_state_dict_to_load")
    return optim_state_to_load(
        model, _optimizer_or_order(model, optim, optim_input), full_optim_state_dict, broadcast=False
    )


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    _deprecated("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    return optim_state_to_load(model, optim, sharded_optim_state_dict, broadcast=False)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
    group: Any | None = None,
) -> dict[str, Any]:
    _deprecated("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    order = _optimizer_or_order(model, optim, optim_input)
    return optim_state_to_load(model, order, full_optim_state_dict, broadcast=True, group=group)


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: Any,
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Re-key an optimizer state dict between parameter ids (`optim.state_dict()`) and clean FQNs (FULL
    `optim_state_dict`) for `model`, whose parameters are those of the optimizer (in `optim`'s order, else
    `optim_input`'s, else `model.parameters()`'): a plain model, or an FSDP model with use_orig_params=True."""
    _check_optim_input(optim_input)
    key_type = getattr(optim_state_key_type, "name", None)
    if key_type not in ("PARAM_NAME", "PARAM_ID"):
        raise ValueError(
            f"optim_state_key_type must be OptimStateKeyType.PARAM_NAME or PARAM_ID, not {optim_state_key_type!r}"
        )
    want = str if key_type == "PARAM_NAME" else int
    key_types = {type(key) for key in optim_state_dict["state"]}
    if len(key_types) > 1 or not key_types <= {str, int}:
        raise ValueError(f"Invalid parameter keys {list(optim_state_dict['state'])}: expected all ints or all FQNs")
    if key_types == {want}:
        return optim_state_dict
    names = _clean_names(model)
    ids = _param_ids(model, optim, optim_input)
    rename: dict[Any, Any]  # ids -> FQNs, or FQNs -> ids
    if want is str:
        rename = {pid: names[param] for pid, param in ids.items()}
    else:
        by_name = {name: param for param, name in names.items()}
        position = {param: pid for pid, param in ids.items()}
        rename = {name: position[param] for name, param in by_name.items() if param in position}

    def new_key(key: Any) -> Any:
        if key not in rename:
            raise KeyError(
                f"Parameter {key!r} of the optimizer state dict is not a parameter of the optimizer of this "
                "model: pass the model (and optim) the state dict was saved from."
            )
        return rename[key]

    result = {"state": {new_key(key): state for key, state in optim_state_dict["state"].items()}}
    result["param_groups"] = copy.deepcopy(optim_state_dict["param_groups"])
    for param_group in result["param_groups"]:
        param_group["params"] = sorted(new_key(key) for key in param_group["params"])
    return result


def _clean_names(model: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter of `model` -> its first clean FQN (no FSDP wrapper prefixes)."""
    names: dict[nn.Parameter, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if isinstance(param, FlatParameter):
            raise ValueError(
                "rekey_optim_state_dict needs original parameters, but the model holds flat parameters "
                "(use_orig_params=False): pass the unwrapped model, or use FSDP.optim_state_dict / "
                "FSDP.optim_state_dict_to_load, which re-key FSDP models themselves."
            )
        names.setdefault(param, clean_key(name))
    return names


def _param_ids(model: nn.Module, optim: torch.optim.Optimizer | None, optim_input: Any) -> dict[int, nn.Parameter]:
    """Parameter id -> parameter, numbered as torch.optim numbers them: in order across param groups."""
    if optim is not None:
        groups = optim.param_groups
    else:
        items = list(model.parameters() if optim_input is None else optim_input)
        groups = items if items and all(isinstance(item, dict) for item in items) else [{"params": items}]
    return dict(enumerate(param for group in groups for param in group["params"]))


def _check_optim_input(optim_input: Any) -> None:
    if optim_input is not None:
        warnings.warn(_OPTIM_INPUT_WARNING, FutureWarning, stacklevel=3)


def _optimizer_or_order(model: nn.Module, optim: torch.optim.Optimizer | None, optim_input: Any) -> Any:
    """The optimizer, whose parameter order wins as in torch; else the order `optim_input` (or the model) gives."""
    _check_optim_input(optim_input)
    return optim if optim is not None else ParamOrder.of(model, optim_input)
