"""Drop-ins for torch.distributed.checkpoint.state_dict (get_/set_model_state_dict, get_/set_optimizer_state_dict,
get_/set_state_dict) that work on fsdp_legacy models.

torch's helpers recognise only torch's own FSDP class, so on our models they would see raw flat parameters. These
take the same arguments (StateDictOptions included) and do what torch's do for FSDP1: the sharded state dicts by
default, the full ones with `full_state_dict=True` (on rank 0 only with `cpu_offload=True`), keyed by the original
names, so what they return saves with DCP and loads into FSDP2 and back. Every option is honoured as torch's helpers
honour it: several optimizers (states merged), `flatten_optimizer_state_dict`, `ignore_frozen_params`,
`broadcast_from_rank0` and the deprecated `submodules` / module-keyed model state dicts.
"""

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.distributed_c10d import _get_default_group
from torch.nn.modules.module import _IncompatibleKeys

from ..api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from ..fully_sharded_data_parallel import FullyShardedDataParallel as FSDP
from .hf_checkpoint import load_full_model as load_full_model
from .hf_checkpoint import save_full_model as save_full_model
from .optim_entries import entries_by_param
from .state_dict import clean_key
from .state_dict_loading import collective_device

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]

# torch's own warning texts, so filters written for torch's helpers catch ours too.
_SUBMODULES_DEPRECATED = (
    "Getting submodules only model/optim state_dict is deprecated and will be removed in 2.5. This feature can be "
    "achieved by manually filtering out the state_dict returned from get_state_dict."
)
_MODULE_KEYS_DEPRECATED = (
    "Passing model_state_dict as a ``Dict[nn.Module, Dict[str, Any]]``is deprecated and will be removed in 2.5. If "
    "you need this feature, please preprocess the model_state_dict to achieve the same functionality."
)


def get_model_state_dict(
    model: nn.Module, *, submodules: set[nn.Module] | None = None, options: StateDictOptions | None = None
) -> dict[str, Any]:
    options = _verify_options(options, submodules)
    state = _get_model(model, options, submodules)
    _verify_not_empty(options, model_sd=state, submodules=submodules)
    return state


def set_model_state_dict(
    model: nn.Module, model_state_dict: dict[Any, Any], *, options: StateDictOptions | None = None
) -> Any:
    model_state_dict = _keyed_by_name(model, model_state_dict)
    options = _verify_options(options)
    _verify_not_empty(options, model_sd=model_state_dict)
    return _set_model(model, model_state_dict, options)


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    options = _verify_options(options, submodules)  # submodules filter nothing here, as in torch
    state = _get_optim(model, _as_tuple(optimizers), options)
    _verify_not_empty(options, optim_sd=state)
    return state


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    options = _verify_options(options)
    _verify_not_empty(options, optim_sd=optim_state_dict)
    _set_optim(model, _as_tuple(optimizers), optim_state_dict, options)


def get_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    options = _verify_options(options, submodules)
    model_sd = _get_model(model, options, submodules)
    optim_sd = _get_optim(model, _as_tuple(optimizers), options)
    _verify_not_empty(options, model_sd=model_sd, optim_sd=optim_sd, submodules=submodules)
    return model_sd, optim_sd


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: dict[Any, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
) -> Any:
    model_state_dict = _keyed_by_name(model, model_state_dict)
    options = _verify_options(options)
    _verify_not_empty(options, model_sd=model_state_dict, optim_sd=optim_state_dict)
    _set_optim(model, _as_tuple(optimizers), optim_state_dict, options)  # optimizer first, as torch does
    return _set_model(model, model_state_dict, options)


# --------------------------------------------------------------------------------------------------------------------
# Model


@torch.no_grad()
def _get_model(model: nn.Module, options: StateDictOptions, submodules: set[nn.Module] | None) -> dict[str, Any]:
    with _state_dict_type(model, options):
        state = model.state_dict()
    if submodules:
        prefixes = [clean_key(f"{name}.") for name, module in model.named_modules() if module in submodules]
        keep = options.keep_submodule_prefixes
        state = {
            key if keep else key[len(p) :]: value for key, value in state.items() for p in prefixes if key.startswith(p)
        }
    if options.ignore_frozen_params:
        for param, entry in entries_by_param(model).items():
            if not param.requires_grad:
                for fqn in entry.fqns:
                    # torch's helper pops unconditionally and so fails on the ranks that hold nothing (rank0_only)
                    state.pop(fqn, None)
    return state


@torch.no_grad()
def _set_model(model: nn.Module, state: dict[str, Any], options: StateDictOptions) -> Any:
    if not state and not options.broadcast_from_rank0:
        return _IncompatibleKeys([], [])  # torch's helper loads nothing from an empty dict
    if options.broadcast_from_rank0:
        state = _broadcast_from_rank0(state, options.cpu_offload)
    with _state_dict_type(model, options):
        return model.load_state_dict(state, strict=options.strict)


def _keyed_by_name(model: nn.Module, state: dict[Any, Any]) -> dict[str, Any]:
    """The deprecated {submodule: its state dict} form, keyed by full names."""
    if not state or not isinstance(next(iter(state)), nn.Module):
        return state
    warnings.warn(_MODULE_KEYS_DEPRECATED, FutureWarning, stacklevel=3)
    prefixes = {module: clean_key(f"{name}.") for name, module in model.named_modules()}
    return {prefixes[m] + key: value for m, sub in state.items() if m in prefixes for key, value in sub.items()}


@dataclass(frozen=True)
class _TensorMeta:
    shape: torch.Size
    dtype: torch.dtype


def _broadcast_from_rank0(state: dict[str, Any], cpu_offload: bool) -> dict[str, Any]:
    """Rank 0's full state dict on every rank: names, scalars and shapes first, then one tensor at a time (as
    torch's helper does, so that no rank needs a second copy of the whole dict in flight)."""
    is_src = dist.get_rank() == 0
    meta = (
        {
            k: _TensorMeta(v.shape, v.dtype) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
            for k, v in state.items()
        }
        if is_src
        else None
    )
    holder = [meta]
    dist.broadcast_object_list(holder, src=0)
    received = holder[0]
    assert received is not None, "rank 0 sends its state"
    device = collective_device(_get_default_group())
    result = {}
    for key, value in received.items():
        if isinstance(value, _TensorMeta):
            tensor = (
                state[key].detach().to(device) if is_src else torch.empty(value.shape, dtype=value.dtype, device=device)
            )
            dist.broadcast(tensor, src=0)
            value = tensor.cpu() if cpu_offload else tensor
        result[key] = value
    return result


# --------------------------------------------------------------------------------------------------------------------
# Optimizers


@torch.no_grad()
def _get_optim(
    model: nn.Module, optims: tuple[torch.optim.Optimizer, ...], options: StateDictOptions
) -> dict[str, Any]:
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for optim in optims:
        _init_state(optim)  # a DCP load target needs the state tensors to exist, as torch's helper ensures
        with _state_dict_type(model, options):
            osd = FSDP.optim_state_dict(model, optim)
        if osd:  # {} on the ranks other than 0 under rank0_only
            merged["state"].update(osd["state"])
            merged["param_groups"].extend(osd["param_groups"])
    if options.flatten_optimizer_state_dict:
        merged = _flatten(merged)
    if options.full_state_dict and options.cpu_offload and dist.is_initialized() and dist.get_rank() != 0:
        return {}  # torch's helper keeps nothing off rank 0 here, not even the empty skeleton
    return merged


@torch.no_grad()
def _set_optim(
    model: nn.Module, optims: tuple[torch.optim.Optimizer, ...], osd: dict[str, Any], options: StateDictOptions
) -> None:
    for optim in optims:
        _init_state(optim)  # unflattening reads the optimizer's state names
        own = {}  # ranks other than 0 under rank0_only receive rank 0's part
        if osd:
            own = _split(model, optim, osd, options.strict) if "state" in osd else _unflatten(model, optim, osd)
        with _state_dict_type(model, options):
            FSDP.optim_state_dict_to_load(model, optim, own, load_directly=True)


def _optim_fqns(model: nn.Module, optim: torch.optim.Optimizer) -> list[list[tuple[str, nn.Parameter]]]:
    """Per param group of `optim`, the (FQN, parameter) pairs it holds (a flat parameter stands for several)."""
    by_param = entries_by_param(model)
    return [[(fqn, p) for p in group["params"] for fqn in by_param[p].fqns] for group in optim.param_groups]


def _split(model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any], strict: bool) -> dict[str, Any]:
    """The part of a merged (several optimizers) state dict that belongs to `optim`."""
    mine = dict(pair for group in _optim_fqns(model, optim) for pair in group)
    state = {}
    for fqn, param in mine.items():
        if fqn in osd["state"]:
            state[fqn] = osd["state"][fqn]
        elif param.requires_grad and strict:
            raise RuntimeError(
                f"Missing optimizer state for parameter '{fqn}' in checkpoint. The parameter requires gradients but "
                "has no saved optimizer state. To load anyway, use StateDictOptions(strict=False)."
            )
    groups = [group for group in osd["param_groups"] if any(fqn in mine for fqn in group["params"])]
    return {"state": state, "param_groups": groups}


def _flatten(osd: dict[str, Any]) -> dict[str, Any]:
    """torch's flat form: "state.<fqn>.<name>[.<nested>]" and "param_groups.<fqn>.<hyperparameter>"."""
    flat: dict[str, Any] = {}

    def add(prefix: str, values: dict) -> None:
        for name, value in values.items():
            key = f"{prefix}.{name}"
            if isinstance(value, dict):
                add(key, value)
            elif isinstance(value, (torch.Tensor, int, float)):
                flat[key] = value
            else:
                raise NotImplementedError(
                    "Flattening optimizer state_dict only supports tensor, int, float, dict states now. "
                    f"Type is {type(value)}."
                )

    for fqn, values in osd["state"].items():
        add(f"state.{fqn}", values)
    for group in osd["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for fqn in group["params"]:
            flat.update({f"param_groups.{fqn}.{k}": v for k, v in hyper.items()})
    return flat


def _unflatten(model: nn.Module, optim: torch.optim.Optimizer, flat: dict[str, Any]) -> dict[str, Any]:
    """`optim`'s part of a flat state dict, nested back. Unlike torch's helper, the state names come from the dict
    rather than from the optimizer's local state, which is empty for a parameter with no elements on this rank
    (use_orig_params=True): torch's then loads nothing for it and the ranks' collectives disagree."""
    state: dict[str, Any] = {}
    groups = []
    for group, pairs in zip(optim.param_groups, _optim_fqns(model, optim), strict=True):
        fqns = [fqn for fqn, _ in pairs]
        for fqn in fqns:
            prefix = f"state.{fqn}."
            for key, value in flat.items():
                if key.startswith(prefix):
                    *path, name = key[len(prefix) :].split(".")
                    node = state.setdefault(fqn, {})
                    for part in path:
                        node = node.setdefault(part, {})
                    node[name] = value
        hyper = {k: flat[f"param_groups.{fqns[0]}.{k}"] for k in group if k != "params"}
        groups.append({**hyper, "params": fqns})
    return {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------------------------------------------------
# Shared


def _verify_options(options: StateDictOptions | None, submodules: set[nn.Module] | None = None) -> StateDictOptions:
    if submodules:
        warnings.warn(_SUBMODULES_DEPRECATED, FutureWarning, stacklevel=3)
    options = options or StateDictOptions()
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("full_state_dict must be True when broadcast_from_rank0 is True.")
    return options


def _verify_not_empty(
    options: StateDictOptions,
    model_sd: dict | None = None,
    optim_sd: dict | None = None,
    submodules: set[nn.Module] | None = None,
) -> None:
    """torch's sanity check: an empty dict is an error unless the options explain it."""
    explained = (options.cpu_offload and options.full_state_dict) or options.broadcast_from_rank0
    if (
        model_sd is not None
        and not model_sd
        and options.strict
        and not (explained or submodules or options.ignore_frozen_params)
    ):
        raise RuntimeError(
            f"The options require a model state dict to save or load, but it is empty (rank {dist.get_rank()})."
        )
    if optim_sd is not None and not optim_sd and not explained:
        raise RuntimeError(f"The options require an optimizer state dict to save or load, but it is empty: {optim_sd}.")


def _as_tuple(optimizers: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    return (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)


@contextlib.contextmanager
def _state_dict_type(model: nn.Module, options: StateDictOptions) -> Iterator[None]:
    """FULL (rank 0 only when offloading to CPU, and for optimizers when broadcasting from rank 0, as torch's helpers
    do) or SHARDED, without the deprecation warning that FSDP.state_dict_type() emits (torch's helpers suppress it
    too)."""
    offload = options.cpu_offload
    settings: tuple[StateDictType, Any, Any]
    if options.full_state_dict:
        settings = (
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload, offload),
            FullOptimStateDictConfig(offload, offload or options.broadcast_from_rank0),
        )
    else:
        settings = (
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload),
            ShardedOptimStateDictConfig(offload),
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with FSDP.state_dict_type(model, *settings):
            yield


def _init_state(optim: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily built state with a step that changes nothing (zero gradients, lr 0)."""
    params = [p for group in optim.param_groups for p in group["params"]]
    if optim.state or any(p.grad is not None for p in params):
        return
    for param in params:
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    lrs = [group.get("lr") for group in optim.param_groups]
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optim.step()
    for group, lr in zip(optim.param_groups, lrs, strict=True):
        if lr is not None:
            group["lr"] = lr
    optim.zero_grad(set_to_none=True)
