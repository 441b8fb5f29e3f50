"""`fsdp-legacy migrate` on eric-mitchell/direct-preference-optimization's trainers, written again in its style: an
FSDPTrainer beside a BasicTrainer it derives from and a TensorParallelTrainer that does not, both models wrapped as
`FSDP(policy, **shared_fsdp_kwargs, mixed_precision=...)`, a config name bound twice (`save_policy =
FullStateDictConfig(...)`, a block, then `save_policy = FullOptimStateDictConfig(...)`, another block), and
`model.no_sync` taken as a value (open_lm: `maybe_no_sync = model.no_sync`). The oracle is torch's FSDP1 running the
original beside the migrated program at 2 ranks: the same losses, gradient norms and saved full state dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from fsdp_legacy.migrate.rewriter import migrate_source

_TRAINERS = """
import contextlib
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, StateDictType, BackwardPrefetch
from torch.distributed.fsdp import ShardingStrategy, CPUOffload
from torch.distributed.fsdp.api import FullStateDictConfig, FullOptimStateDictConfig
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x):
        return x + self.inner(x) * self.scale.to(x.dtype)


def net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(Block(8), Block(8), nn.Linear(8, 1))


class BasicTrainer:
    def __init__(self, policy, reference_model):
        self.policy = policy
        self.reference_model = reference_model

    def batch(self, step):
        data = torch.Generator().manual_seed(10 * step + dist.get_rank())
        return torch.randn(2, 4, 8, generator=data), torch.randn(2, 4, 1, generator=data)

    def train(self, steps):
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=0.01)
        losses, norms = [], []
        for step in range(steps):
            x, y = self.batch(step)
            for micro in range(2):
                maybe_no_sync = self.policy.no_sync if micro == 0 and self.accumulates() else contextlib.nullcontext
                with maybe_no_sync():
                    with torch.no_grad():
                        target = y[micro] + 0.1 * self.reference_model(x[micro])
                    loss = nn.functional.mse_loss(self.policy(x[micro]), target)
                    loss.backward()
            norms.append(self.clip_gradient())
            self.optimizer.step()
            self.optimizer.zero_grad()
            losses.append(loss.item())
        return losses, norms

    def accumulates(self):
        return False

    def clip_gradient(self):
        return torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0).item()

    def save(self):
        return self.policy.state_dict(), self.optimizer.state_dict()  # (a plain module's: left as written)


class FSDPTrainer(BasicTrainer):
    def __init__(self, policy, reference_model):
        super().__init__(policy, reference_model)
        shared_fsdp_kwargs = dict(
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            cpu_offload=CPUOffload(offload_params=False),
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            device_id=torch.device("cpu"),
            limit_all_gathers=False,
            use_orig_params=False,
        )
        mp_policy = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float64)
        self.policy = FSDP(policy, **shared_fsdp_kwargs, mixed_precision=mp_policy)
        self.reference_model = FSDP(reference_model, **shared_fsdp_kwargs)

    def accumulates(self):
        return True

    def clip_gradient(self):
        return self.policy.clip_grad_norm_(1.0).item()

    def save(self):
        # (offload_to_cpu=False: torch's FSDP1 fails to offload on a CPU device, ../shared/FSDP1_FACTS.md)
        save_policy = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(self.policy, StateDictType.FULL_STATE_DICT, state_dict_config=save_policy):
            policy_state_dict = self.policy.state_dict()
        dist.barrier()
        save_policy = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(self.policy, StateDictType.FULL_STATE_DICT, optim_state_dict_config=save_policy):
            optimizer_state_dict = FSDP.optim_state_dict(self.policy, self.optimizer)
        return policy_state_dict, optimizer_state_dict


class TensorParallelTrainer(BasicTrainer):
    def save(self):
        return self.policy.state_dict(), None  # (not a wrapped model here either)


def run(trainer_class):
    trainer = trainer_class(net(0), net(1))
    losses, norms = trainer.train(3)
    model, optim = trainer.save()
    buffers = sorted({str(b.dtype) for b in trainer.policy.buffers()})
    return losses, norms, model, optim, buffers
"""


def test_the_trainers_migrate_to_the_text_expected() -> None:
    result = migrate_source(_TRAINERS)
    assert result.findings == [], [f.format("trainers.py") for f in result.findings]
    out = result.migrated
    assert "self.policy = fully_shard_fsdp1(policy, **shared_fsdp_kwargs, mixed_precision=mp_policy)" in out
    assert "self.reference_model = fully_shard_fsdp1(reference_model, **shared_fsdp_kwargs)" in out
    # the policies the dict and the call hand fully_shard_fsdp1 stay FSDP1's, which it maps at run time
    assert "MixedPrecision(param_dtype=torch.float32" in out and "CPUOffload(offload_params=False)" in out
    # each `save_policy` is the config the block after it reads
    model = "get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))"
    assert model in out  # (rank0_only: DSD's cpu_offload)
    optim = "get_optimizer_state_dict(self.policy, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu"
    assert optim in out  # (rank0_only: DSD's cpu_offload, FSDP1's offload_to_cpu=False notwithstanding)
    # the other classes' `self.policy` is not the wrapped model
    assert out.count("return self.policy.state_dict(), ") == 2
    assert "functools.partial(without_gradient_sync, self.policy) if micro == 0" in out
    again = migrate_source(out)
    assert (again.migrated, again.findings) == (out, [])


def _side_by_side(original: str, migrated: str) -> list[Any]:
    out = []
    for name, source in (("fsdp1.py", original), ("fsdp2.py", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, name, "exec"), namespace)
        out.append(namespace["run"](namespace["FSDPTrainer"]))
    return out


def test_the_fsdp_trainer_trains_and_saves_as_fsdp1(ranks: Any, tmp_path: Path) -> None:
    migrated = migrate_source(_TRAINERS).migrated
    for rank, (fsdp1, fsdp2) in enumerate(ranks(_side_by_side, 2, _TRAINERS, migrated)):
        (losses1, norms1, model1, optim1, buffers1), (losses2, norms2, model2, optim2, buffers2) = fsdp1, fsdp2
        assert losses2 == pytest.approx(losses1, rel=1e-5) and norms2 == pytest.approx(norms1, rel=1e-5)
        assert buffers1 == buffers2 == ["torch.float64"]  # (buffer_dtype: fully_shard_fsdp1 casts them)
        assert model1.keys() == model2.keys() and (rank == 0) == bool(model1)
        assert all(torch.allclose(model1[k].double(), model2[k].double(), rtol=1e-5, atol=1e-7) for k in model1)
        if rank == 0:
            state1, state2 = optim1["state"], optim2["state"]
            assert state1.keys() == state2.keys() and len(state1) == len(model1) - 2  # (the two buffers)
            for key in state1:
                assert torch.allclose(state1[key]["exp_avg"], state2[key]["exp_avg"], rtol=1e-4, atol=1e-7)
