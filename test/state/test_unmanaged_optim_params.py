"""Optimizer state for a model with parameters no FSDP unit manages beside its units (model parallelism: torch's
test_shard_full_optim_state_dict_unmanaged_params), side by side with torch's FSDP1. The state dict saved from the
model without the extra parameter, turned into this rank's state by every legacy function and
optim_state_dict_to_load for the model with it, must equal torch's (groups list only the saved parameters' ids), and
load once the caller adds the extra parameter's entry, as torch's test does."""

import bisect
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from parameterized import parameterized
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

import fsdp_legacy
import models
from harness import run_on_ranks


def _model(implementation: Any, unmanaged: bool, use_orig_params: bool) -> nn.Module:
    """models.Net whose block is a unit and whose root is not (its layers are no unit's), optionally with a
    parameter registered on the root after the others."""
    torch.manual_seed(0)
    model = models.Net()
    if unmanaged:
        model.register_parameter("unmanaged", nn.Parameter(torch.randn(5, 5)))
    model.block = implementation.FullyShardedDataParallel(
        model.block, use_orig_params=use_orig_params, device_id=torch.device("cpu")
    )
    return model


def _trained(implementation: Any, use_orig_params: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(implementation, False, use_orig_params)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(models.Net.batch(dist.get_rank())).sum().backward()
    optim.step()
    return model, optim


def _saved(implementation: Any, kind: str, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    fsdp = implementation.FullyShardedDataParallel
    if kind == "sharded":
        return fsdp.sharded_optim_state_dict(model, optim)
    return fsdp.full_optim_state_dict(model, optim, rank0_only=False)


def _to_load(implementation: Any, function: str, osd: dict[str, Any], model: nn.Module, optim: Any) -> dict:
    fsdp = implementation.FullyShardedDataParallel
    if function == "shard_full_optim_state_dict":
        return fsdp.shard_full_optim_state_dict(osd, model, optim=optim)
    if function == "scatter_full_optim_state_dict":
        return fsdp.scatter_full_optim_state_dict(osd if dist.get_rank() == 0 else None, model, optim=optim)
    if function == "flatten_sharded_optim_state_dict":
        return fsdp.flatten_sharded_optim_state_dict(osd, model, optim=optim)
    return fsdp.optim_state_dict_to_load(model, optim, osd)


def _add_unmanaged_entry(osd: dict[str, Any], param: nn.Parameter) -> None:
    """The entry of the one parameter the saved dict does not name: its id is the one the group skips."""
    ids = osd["param_groups"][0]["params"]
    missing = next((i for i, key in enumerate(ids) if key != i), len(ids))
    osd["state"][missing] = {"step": torch.tensor(1.0), "exp_avg": torch.ones(5, 5), "exp_avg_sq": torch.ones(5, 5)}
    bisect.insort(osd["param_groups"][0]["params"], missing)


def _copy(value: Any) -> Any:
    if isinstance(value, ShardedTensor):
        return [shard.tensor.clone() for shard in value.local_shards()]
    return value.clone() if isinstance(value, torch.Tensor) else value


def _load_with_unmanaged(function: str, kind: str, use_orig_params: bool) -> None:
    results = {}
    for implementation in (torch_fsdp, fsdp_legacy):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # Saved by ours for both (the same training each time; loading steps on its tensors): torch's FSDP1
            # saves wrong values here on a CPU (use_orig_params with its legacy full_optim_state_dict's
            # offload_to_cpu=True; ../shared/FSDP1_FACTS.md), and an FQN-keyed dict loads into either.
            osd = _saved(fsdp_legacy, kind, *_trained(fsdp_legacy, use_orig_params))
            model = _model(implementation, True, use_orig_params)
            optim = torch.optim.Adam(model.parameters(), lr=1e-3)
            loaded = _to_load(implementation, function, osd, model, optim)
        results[implementation is fsdp_legacy] = {
            "param_groups": [dict(group) for group in loaded["param_groups"]],
            "state": {key: {n: _copy(v) for n, v in values.items()} for key, values in loaded["state"].items()},
        }
        _add_unmanaged_entry(loaded, model.unmanaged)
        optim.load_state_dict(loaded)  # torch's test: it loads once the unmanaged entry is there
        model(models.Net.batch(dist.get_rank())).sum().backward()
        optim.step()
        dist.barrier()
    ours, theirs = results[True], results[False]
    assert ours["param_groups"] == theirs["param_groups"], f"{ours['param_groups']} vs {theirs['param_groups']}"
    assert ours["state"].keys() == theirs["state"].keys()
    for key, values in theirs["state"].items():
        assert ours["state"][key].keys() == values.keys(), key
        for name, value in values.items():
            assert torch.equal(ours["state"][key][name], value), f"state {key} {name}: ours differs from torch's"


CASES = [
    (function, kind, uop)
    for function, kind in (
        ("shard_full_optim_state_dict", "full"),
        ("scatter_full_optim_state_dict", "full"),
        ("flatten_sharded_optim_state_dict", "sharded"),
    )
    for uop in (False, True)
]


@parameterized.expand(CASES)
def test_unmanaged_parameters_load_as_torch(function: str, kind: str, use_orig_params: bool) -> None:
    run_on_ranks(_load_with_unmanaged, 2, function, kind, use_orig_params)
