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
from ..unit import FSDPUnit
from .optim_entries import ParamOrder
from .optim_state import save_optim_state
from .optim_state_loading import optim_state_to_load
from .optim_state_named import by_param_names
from .state_dict import clean_key

_OPTIM_INPUT_WARNING = (
    "The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. You may remove it from your "
    "code without changing its functionality."
)


def warn_legacy_optim_state_dict(curr: str, new: str, *, stacklevel: int = 1) -> None:
    """torch's `FSDP._warn_legacy_optim_state_dict`: its text, including the missing space before "is being"."""
    warnings.warn(
        f"``FullyShardedDataParallel.{curr}``is being deprecated and is replaced by "
        f"``FullyShardedDataParallel.{new}``. ``FullyShardedDataParallel.{curr}`` may be removed after PyTorch 2.2.",
        FutureWarning,
        stacklevel=stacklevel + 1,
    )


def warn_optim_input(optim_input: Any, *, stacklevel: int = 1) -> None:
    """torch's `FSDP._warn_optim_input`."""
    if optim_input is not None:
        warnings.warn(_OPTIM_INPUT_WARNING, FutureWarning, stacklevel=stacklevel + 1)


def is_using_optim_input(optim_input: Any, optim: torch.optim.Optimizer | None) -> bool:
    """torch's `FSDP._is_using_optim_input`: whether the parameter order comes from `optim_input` (or the model, when
    neither is given) rather than from the optimizer."""
    return optim_input is not None or optim is None


def _deprecated(name: str, replacement: str) -> None:
    warn_legacy_optim_state_dict(name, replacement, stacklevel=2)


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
    warn_optim_input(optim_input, stacklevel=2)


def _optimizer_or_order(model: nn.Module, optim: torch.optim.Optimizer | None, optim_input: Any) -> Any:
    """The optimizer, whose parameter order wins as in torch; else the order `optim_input` (or the model) gives."""
    _check_optim_input(optim_input)
    return optim if optim is not None else ParamOrder.of(model, optim_input)


# --------------------------------------------------------------------------------------------------------------------
# torch's internal entry points, which checkpointers call directly (ByteCheckpoint): the public methods' work with the
# state dict type given as arguments instead of by state_dict_type()


def _check_impl_arguments(model: nn.Module, optim_input: Any, rank0_only: bool, full_state_dict: bool) -> None:
    if full_state_dict:
        warn_optim_input(optim_input, stacklevel=3)
    elif optim_input is not None or rank0_only:  # torch's messages, word for word
        raise AssertionError(
            f"Expected optim_input to be None and rank0_only to be False, "
            f"got optim_input={optim_input}, rank0_only={rank0_only}"
        )
    units = [m for m in model.modules() if isinstance(m, FSDPUnit)]
    if len({unit._use_orig_params for unit in units}) > 1:
        raise AssertionError("Not all FSDP modules have the same _use_orig_params value")


def optim_state_dict_impl(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    optim_input: Any = None,
    rank0_only: bool = True,
    full_state_dict: bool = True,
    group: dist.ProcessGroup | None = None,
    cpu_offload: bool = True,
    *,
    _stacklevel: int = 1,
) -> dict[str, Any]:
    """torch's `FSDP._optim_state_dict_impl`: `optim_state_dict` (the optimizer's own) keyed by FQNs, FULL or (not
    `full_state_dict`) SHARDED."""
    _check_impl_arguments(model, optim_input, rank0_only, full_state_dict)
    if full_state_dict:
        config = FullOptimStateDictConfig(cpu_offload, rank0_only=rank0_only)
        return save_optim_state(model, optim, optim_state_dict, StateDictType.FULL_STATE_DICT, config, group)
    sharded = ShardedOptimStateDictConfig(cpu_offload)
    return save_optim_state(model, optim, optim_state_dict, StateDictType.SHARDED_STATE_DICT, sharded, group)


def optim_state_dict_to_load_impl(
    optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
    full_state_dict: bool = True,
    rank0_only: bool = False,
    is_named_optimizer: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """torch's `FSDP._optim_state_dict_to_load_impl`: this rank's part of an FQN-keyed dict, keyed as the optimizer
    (or, without one, `optim_input`'s order) keys its state; with `rank0_only`, rank 0's dict is broadcast."""
    _check_impl_arguments(model, optim_input, rank0_only, full_state_dict)
    order: Any = optim if optim is not None else ParamOrder.of(model, optim_input)
    result = optim_state_to_load(model, order, optim_state_dict, broadcast=rank0_only, group=group)
    if is_named_optimizer:
        assert optim is not None, "a named optimizer is given as `optim`"
        result = by_param_names(model, optim, result)
    return result
