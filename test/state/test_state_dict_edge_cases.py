"""State dicts in less common shapes: a module reached by two paths that also shares a parameter with another module
(oracle: torch's FSDP1's keys, in order, and the saved model, which the loaded one must equal), and fp16 mixed
precision with parameter CPU offload and use_orig_params=True (torch's FSDP1 cannot offload on a CPU-only machine:
oracle, the same model without offload, and the round trip)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import fsdp_legacy
import models
from harness import run_on_ranks

RECORD_SUFFIX = "_meta"


class SharedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = self.first  # the same module under two names
        self.tied = nn.Linear(3, 3)
        self.tied.weight = self.first.weight  # and its parameter shared with another module
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tied(self.second(self.first(x))))


def _round_trip(lib: Any, kind: str, use_orig_params: bool) -> tuple[list[str], bool]:
    fsdp = lib.FullyShardedDataParallel
    extra = {"device_id": torch.device("cpu")} if lib is torch_fsdp else {}
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(dist.get_rank()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        source = fsdp(SharedTwice(), use_orig_params=use_orig_params, **extra)
        opt = torch.optim.SGD(source.parameters(), lr=0.1)
        source(x).sum().backward()
        opt.step()
        with fsdp.state_dict_type(source, lib.StateDictType[kind]):
            saved = source.state_dict()
        keys = [k for k in saved if not k.endswith(RECORD_SUFFIX)]
        if lib is torch_fsdp and kind == "LOCAL_STATE_DICT" and use_orig_params:
            return keys, True  # torch's FSDP1 cannot load its own LOCAL dict with use_orig_params=True
        torch.manual_seed(1)
        destination = fsdp(SharedTwice(), use_orig_params=use_orig_params, **extra)
        with fsdp.state_dict_type(destination, lib.StateDictType[kind]):
            result = destination.load_state_dict(saved)
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        return keys, torch.equal(source(x), destination(x))


def _as_torch(kind: str, use_orig_params: bool) -> None:
    ours, our_exact = _round_trip(fsdp_legacy, kind, use_orig_params)
    theirs, _ = _round_trip(torch_fsdp, kind, use_orig_params)
    assert ours == theirs, (ours, theirs)
    assert our_exact, "the loaded model computes as the saved one"


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"])
def test_shared_module_with_a_tied_parameter_saves_and_loads(kind: str, use_orig_params: bool) -> None:
    run_on_ranks(_as_torch, 2, kind, use_orig_params)


def _fp16_offload_round_trip(kind: str) -> None:
    from fsdp_utils import Config, batch, build_ours, loss_of, optimizer

    mixed = ("float16", "float16", "float16")
    states = []
    for offload in (True, False):
        extra = {"cpu_offload": fsdp_legacy.CPUOffload(offload_params=True)} if offload else {}
        config = Config("transformer", use_orig_params=True, mixed_precision=mixed, extra=extra)
        source = build_ours(config)[1]
        opt = optimizer(source)
        for step in range(2):
            loss_of(source(batch(config, step))).backward()
            opt.step()
            opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with fsdp_legacy.FullyShardedDataParallel.state_dict_type(source, fsdp_legacy.StateDictType[kind]):
                saved = source.state_dict()
            destination = build_ours(config, seed=1)[1]
            with fsdp_legacy.FullyShardedDataParallel.state_dict_type(destination, fsdp_legacy.StateDictType[kind]):
                result = destination.load_state_dict(saved)
        assert not result.missing_keys and not result.unexpected_keys
        with torch.no_grad():
            assert torch.equal(source(batch(config, 9)), destination(batch(config, 9))), "round trip"
        states.append(saved)
    offloaded, on_device = states
    parameters = {name for name, _ in models.Transformer().named_parameters()}
    assert list(offloaded) == list(on_device)
    for key, value in offloaded.items():
        local = value.local_shards()[0].tensor if hasattr(value, "local_shards") and value.local_shards() else value
        other = on_device[key]
        other = other.local_shards()[0].tensor if hasattr(other, "local_shards") and other.local_shards() else other
        if isinstance(local, torch.Tensor) and isinstance(other, torch.Tensor):
            if key in parameters or key.endswith("_flat_param"):
                assert local.dtype == torch.float32, f"{key}: the full-precision master"
            torch.testing.assert_close(local, other, msg=key)


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"])
def test_fp16_mixed_precision_with_cpu_offload_and_orig_params_saves_and_loads(kind: str) -> None:
    run_on_ranks(_fp16_offload_round_trip, 2, kind)


@pytest.mark.parametrize("world_size", [1, 4])
def test_shared_module_with_a_tied_parameter_at_one_and_four_ranks(world_size: int) -> None:
    run_on_ranks(_as_torch, world_size, "SHARDED_STATE_DICT", True)
