"""Drop-ins for torch.distributed.checkpoint.state_dict (get_/set_model_state_dict, get_/set_optimizer_state_dict,
get_/set_state_dict) that work on fsdp_legacy models.

torch's helpers recognise only torch's own FSDP1 class, so on our models they would see raw flat parameters. These
take the same arguments (StateDictOptions included) and do what torch's do for FSDP1: the sharded state dicts by
default, the full ones with `full_state_dict=True` (on rank 0 only with `cpu_offload=True`), keyed by the original
names, so what they return saves with DCP and loads into FSDP2 and back.
"""

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from .api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from .fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]


def get_model_state_dict(
    model: nn.Module, *, submodules: Optional[set[nn.Module]] = None, options: Optional[StateDictOptions] = None
) -> dict[str, Any]:
    options = _supported(options, submodules)
    with _state_dict_type(model, options):
        return model.state_dict()


def set_model_state_dict(
    model: nn.Module, model_state_dict: dict[str, Any], *, options: Optional[StateDictOptions] = None
) -> Any:
    options = _supported(options)
    with _state_dict_type(model, options):
        return model.load_state_dict(model_state_dict, strict=options.strict)


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: Optional[set[nn.Module]] = None,
    options: Optional[StateDictOptions] = None,
) -> dict[str, Any]:
    options = _supported(options, submodules)
    optim = _single(optimizers)
    _init_state(optim)  # a DCP load target needs the state tensors to exist, as torch's helper ensures
    with _state_dict_type(model, options):
        return FSDP.optim_state_dict(model, optim)


def set_optimizer_state_dict(
    model: nn.Module, optimizers: Optimizers, optim_state_dict: dict[str, Any], *, options: Optional[StateDictOptions] = None
) -> None:
    options = _supported(options)
    optim = _single(optimizers)
    with _state_dict_type(model, options):
        FSDP.optim_state_dict_to_load(model, optim, optim_state_dict, load_directly=True)


def get_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: Optional[set[nn.Module]] = None,
    options: Optional[StateDictOptions] = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    return (
        get_model_state_dict(model, submodules=submodules, options=options),
        get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options),
    )


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: Optional[StateDictOptions] = None,
) -> Any:
    incompatible = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return incompatible


def _supported(options: Optional[StateDictOptions], submodules: Optional[set[nn.Module]] = None) -> StateDictOptions:
    options = options or StateDictOptions()
    unsupported = {
        "submodules": submodules is not None,
        "ignore_frozen_params": options.ignore_frozen_params,
        "keep_submodule_prefixes=False": not options.keep_submodule_prefixes,
        "broadcast_from_rank0": options.broadcast_from_rank0,
        "flatten_optimizer_state_dict": options.flatten_optimizer_state_dict,
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise NotImplementedError(
            f"fsdp_legacy.checkpoint does not support {', '.join(named)} yet; use the defaults, or the FSDP "
            "state_dict_type API directly."
        )
    return options


def _single(optimizers: Optimizers) -> torch.optim.Optimizer:
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers
    optimizers = list(optimizers)
    if len(optimizers) != 1:
        raise NotImplementedError(f"fsdp_legacy.checkpoint handles one optimizer, got {len(optimizers)}")
    return optimizers[0]


@contextlib.contextmanager
def _state_dict_type(model: nn.Module, options: StateDictOptions) -> Iterator[None]:
    """FULL (rank 0 only when offloading to CPU, as torch's helpers do) or SHARDED, without the deprecation warning
    that FSDP.state_dict_type() emits (torch's helpers suppress it too)."""
    offload = options.cpu_offload
    if options.full_state_dict:
        settings = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload, offload),
                    FullOptimStateDictConfig(offload, offload))
    else:
        settings = (StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload),
                    ShardedOptimStateDictConfig(offload))
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
    for group, lr in zip(optim.param_groups, lrs):
        if lr is not None:
            group["lr"] = lr
    optim.zero_grad(set_to_none=True)
