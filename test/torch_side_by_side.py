"""The side-by-side harness of test_torch_internal_checks*.py: one check run on each rank with torch's FSDP1, then with
ours through the switch (`fsdp_legacy.install()`), so that the very same code, which names only torch's modules,
builds the model and reads the internals; the observations must be equal."""

from __future__ import annotations

import contextlib
import importlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdp_legacy
from fsdp_utils import switched_on
from harness import run_on_ranks

WORLD_SIZE = 2


# ----------------------------------------------------------------------------------------------------------------------
# Side by side: the same check on torch's FSDP1, then on ours under torch's names


def _fsdp() -> Any:
    """torch.distributed.fsdp as code imports it: torch's FSDP1, or ours while the switch is on."""
    return importlib.import_module("torch.distributed.fsdp")


def _wrap_api() -> Any:
    return importlib.import_module("torch.distributed.fsdp.wrap")


def _traversal() -> Any:
    return importlib.import_module("torch.distributed.fsdp._traversal_utils")


def _FSDP(module: nn.Module, **kwargs: Any) -> nn.Module:
    """FullyShardedDataParallel(module, ...) on the CPU (torch's needs the device named there)."""
    return _fsdp().FullyShardedDataParallel(module, device_id=torch.device("cpu"), **kwargs)


def _units(model: nn.Module) -> list[nn.Module]:
    return _fsdp().FullyShardedDataParallel.fsdp_modules(model)


def _side_by_side(check: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """On each rank: `check(*args)` with torch's FSDP1, then with ours through the switch, from the same seed."""
    observed = {}
    for label in ("torch", "ours"):
        torch.manual_seed(0)
        with switched_on() if label == "ours" else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            is_ours = _fsdp().FullyShardedDataParallel is fsdp_legacy.FullyShardedDataParallel
            assert is_ours == (label == "ours"), label
            observed[label] = check(*args)
        dist.barrier()
    return observed


def _same(ours: Any, theirs: Any, where: str = "") -> None:
    """Equal observations; floats within float32 round-off."""
    assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} vs {type(theirs).__name__}"
    if isinstance(theirs, dict):
        assert ours.keys() == theirs.keys(), f"{where}: keys {sorted(ours)} vs {sorted(theirs)}"
        for key in theirs:
            _same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{where}: length {len(ours)} vs {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, float):
        assert math.isclose(ours, theirs, rel_tol=1e-5, abs_tol=1e-6), f"{where}: {ours} vs {theirs}"
    else:
        assert ours == theirs, f"{where}: ours {ours!r}, torch {theirs!r}"


def _without(observed: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in observed.items() if k != key}


def _run_both(check: Callable[..., Any], *args: Any) -> list[dict[str, Any]]:
    """Run `check` side by side on the ranks: {"torch": ..., "ours": ...} by rank."""
    return run_on_ranks(_side_by_side, WORLD_SIZE, check, *args)


def _switched(check: Callable[..., Any], *args: Any) -> Any:
    torch.manual_seed(0)
    with switched_on():
        return check(*args)


def _run_ours(check: Callable[..., Any], *args: Any) -> list[Any]:
    """Run `check` on the ranks with ours alone, through the switch (where torch's FSDP1 raises or has no twin)."""
    return run_on_ranks(_switched, WORLD_SIZE, check, *args)


def _each(check: Callable[..., Any], cases: list[tuple]) -> list[Any]:
    """`check` over several cases in one job (each from the same seed)."""
    seen = []
    for case in cases:
        torch.manual_seed(0)
        seen.append(check(*case))
    return seen


def _run(check: Callable[..., Any], *args: Any) -> list[Any]:
    """Run `check` side by side on the ranks; assert ours observed what torch's did; return torch's observations."""
    results = _run_both(check, *args)
    for rank, result in enumerate(results):
        _same(result["ours"], result["torch"], f"rank {rank}")
    return [result["torch"] for result in results]


def _flat(tensor: torch.Tensor) -> list[float]:
    return tensor.detach().float().flatten().tolist()


def _full_params(model: nn.Module) -> dict[str, list[float]]:
    """Every parameter of `model` gathered, by its name without FSDP's prefixes."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    with _fsdp().FullyShardedDataParallel.summon_full_params(model):
        return {clean_tensor_name(n): _flat(p) for n, p in model.named_parameters()}


def _freed(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().size() == 0
