"""The handle's `unshard_grad()` / `reshard_grad()` (torch's summon_full_params(with_grads=True) steps), driven by
hand between steps: `_runtime_utils._unshard(state, handle, ...)`, `handle.unshard_grad()`, read the whole gradients
(`flat_param.grad`, or with use_orig_params=True the parameters' `.grad`), change them,
`_reshard(state, handle, free)`, `handle.reshard_grad()`, then train on. On ours next to torch's FSDP1 (through the
switch, the same code), and against the oracle of the model's own gradients without FSDP (every rank computes on the
same batch)."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import pytest
import torch
from torch import nn

from torch_side_by_side import _FSDP, _flat, _fsdp, _full_params, _run


def _whole_grads(strategy: str, uop: bool) -> dict[str, Any]:
    fsdp = _fsdp()
    runtime_utils = importlib.import_module("torch.distributed.fsdp._runtime_utils")
    clean = importlib.import_module("torch.distributed.fsdp._common_utils").clean_tensor_name
    plain = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))
    reference = copy.deepcopy(plain)
    model = _FSDP(
        plain,
        auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Linear}),
        sharding_strategy=getattr(fsdp.ShardingStrategy, strategy),
        use_orig_params=uop,
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    batch = torch.randn(3, 6, generator=generator)
    model(batch).square().sum().backward()
    reference(batch).square().sum().backward()
    oracle = {name: _flat(param.grad) for name, param in reference.named_parameters()}
    seen: dict[str, Any] = {}
    unit_names = {id(module): name for name, module in model.named_modules()}
    for unit in fsdp.FullyShardedDataParallel.fsdp_modules(model):
        handle = unit._handle
        if handle is None:
            continue
        free = handle.needs_unshard()  # (as torch's summon_full_params: NO_SHARD keeps its storage)
        runtime_utils._unshard(unit, handle, unit._unshard_stream, unit._pre_unshard_stream)
        handle.unshard_grad()
        numel = handle.flat_param._unpadded_unsharded_size.numel()
        seen[f"flat {len(seen)}"] = _flat(handle.flat_param.grad[:numel])
        if uop:
            prefix = unit_names[id(unit)]
            for name, param in unit.named_parameters():
                if param.grad is not None:
                    seen.setdefault(clean(f"{prefix}.{name}" if prefix else name), _flat(param.grad))
            for param in unit.parameters():
                if param.grad is not None:
                    param.grad.zero_()  # dropped by reshard_grad(), as in torch
        else:
            handle.flat_param.grad.zero_()
        runtime_utils._reshard(unit, handle, free)
        handle.reshard_grad()  # (after the reshard, as torch's summon_full_params: the shard's size again)
    optim.step()
    optim.zero_grad()
    model(torch.randn(3, 6, generator=generator)).square().sum().backward()
    optim.step()
    return {"oracle": oracle, "seen": seen, "params": _full_params(model)}


@pytest.mark.parametrize("uop", [False, True], ids=["flat", "uop"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_whole_gradients_shown_and_put_back_as_torch(strategy: str, uop: bool) -> None:
    for observed in _run(_whole_grads, strategy, uop):
        flat = [x for key, values in observed["seen"].items() if key.startswith("flat ") for x in values]
        expected = [x for values in observed["oracle"].values() for x in values]
        torch.testing.assert_close(flat, expected, rtol=1e-5, atol=1e-6)
        for name, values in observed["seen"].items():
            if not name.startswith("flat "):
                torch.testing.assert_close(values, observed["oracle"][name], rtol=1e-5, atol=1e-6, msg=name)
