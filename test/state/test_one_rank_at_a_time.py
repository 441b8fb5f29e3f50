"""FSDP APIs that torch's FSDP1 runs without a collective, called one rank at a time as programs call them: OLMo's
full checkpointer restores the optimizer turn by turn (`for turn in range(world): if turn == rank:
optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, full_osd)); barrier()`). A collective of ours there
would wait for a rank sitting in the barrier: each pattern runs on torch's FSDP1 and on ours under a short
process-group timeout, so a hang fails in seconds, and both must complete with the same optimizer state."""

import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap
from parameterized import parameterized
from torch import nn

import fsdp_legacy
import fsdp_legacy.wrap
import models
from harness import run_on_ranks

_TIMEOUT = timedelta(seconds=20)


def _trained(implementation: Any, use_orig_params: bool, group: dist.ProcessGroup) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = implementation.FullyShardedDataParallel(
        models.Net(),
        auto_wrap_policy=implementation.wrap.ModuleWrapPolicy({models.Block}),
        use_orig_params=use_orig_params,
        process_group=group,
        device_id=torch.device("cpu"),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(2):
        model(models.Net.batch(step + dist.get_rank())).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _full_osd(implementation: Any, model: nn.Module, optim: Any) -> dict[str, Any]:
    fsdp = implementation.FullyShardedDataParallel
    full = implementation.StateDictType.FULL_STATE_DICT
    # offload_to_cpu=False: torch's FSDP1 returns aliased states with use_orig_params on the CPU otherwise
    with fsdp.state_dict_type(model, full, optim_state_dict_config=implementation.FullOptimStateDictConfig(False)):
        return fsdp.optim_state_dict(model, optim)


def _load_to_load(implementation: Any, model: nn.Module, optim: Any, osd: dict[str, Any]) -> None:
    optim.load_state_dict(implementation.FullyShardedDataParallel.optim_state_dict_to_load(model, optim, osd))


def _load_shard_full(implementation: Any, model: nn.Module, optim: Any, osd: dict[str, Any]) -> None:
    fsdp = implementation.FullyShardedDataParallel
    optim.load_state_dict(fsdp.shard_full_optim_state_dict(osd, model, optim=optim))


def _load_rekeyed(implementation: Any, model: nn.Module, optim: Any, osd: dict[str, Any]) -> None:
    fsdp = implementation.FullyShardedDataParallel
    by_id = fsdp.rekey_optim_state_dict(osd, implementation.OptimStateKeyType.PARAM_ID, model)
    by_name = fsdp.rekey_optim_state_dict(by_id, implementation.OptimStateKeyType.PARAM_NAME, model)
    optim.load_state_dict(fsdp.optim_state_dict_to_load(model, optim, by_name))


_PATTERNS: dict[str, Callable[..., None]] = {
    "optim_state_dict_to_load": _load_to_load,
    "shard_full_optim_state_dict": _load_shard_full,
    "rekey_then_load": _load_rekeyed,
}


def _restore_turn_by_turn(pattern: str, use_orig_params: bool) -> None:
    group = dist.new_group(backend="gloo", timeout=_TIMEOUT)
    restored = {}
    for implementation in (torch_fsdp, fsdp_legacy):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optim = _trained(implementation, use_orig_params, group)
            osd = _full_osd(implementation, model, optim)
            fresh_model, fresh_optim = _trained(implementation, use_orig_params, group)
            for turn in range(dist.get_world_size(group)):
                if turn == dist.get_rank(group):
                    _PATTERNS[pattern](implementation, fresh_model, fresh_optim, osd)
                dist.barrier(group=group)
        restored[implementation.__name__] = fresh_optim.state_dict()["state"]
        expected = optim.state_dict()["state"]
        for key, values in expected.items():  # the restore gives back what was saved (the fresh run stepped alike)
            for name, value in values.items():
                assert torch.equal(restored[implementation.__name__][key][name], value), (implementation, key, name)
    ours, theirs = restored["fsdp_legacy"], restored[torch_fsdp.__name__]
    assert ours.keys() == theirs.keys()
    for key in theirs:
        for name, value in theirs[key].items():
            assert torch.equal(ours[key][name], value), f"state {key} {name}: ours differs from torch's FSDP1"


# torch's rekey_optim_state_dict refuses a flat-parameter model ("Each parameter should only map to one parameter
# name"): rekeying is tested with use_orig_params only.
_CASES = [(pattern, uop) for pattern in _PATTERNS for uop in (False, True) if uop or pattern != "rekey_then_load"]


@parameterized.expand(_CASES)
def test_restore_one_rank_at_a_time_completes_as_torch(pattern: str, use_orig_params: bool) -> None:
    run_on_ranks(_restore_turn_by_turn, 2, pattern, use_orig_params, timeout=120)
