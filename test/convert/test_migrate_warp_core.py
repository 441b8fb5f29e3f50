"""`fsdp-legacy migrate` on a trainer base class in StableCascade's style (its `WarpCore`): FSDP1's keywords and
a FULL config as class attributes (`fsdp_defaults = {...}`, `fsdp_fullstate_save_policy = FullStateDictConfig(...)`
in the class body), `save_model(model, is_fsdp)` with the FULL block on one branch and a plain `model.state_dict()`
on the other, the optimizer saved with `FSDP.full_optim_state_dict` and resumed with
`FSDP.scatter_full_optim_state_dict(osd, fsdp_model)` (no `optim=`) loaded and then deleted, and the model loaded
from a file, moved, then wrapped with `FSDP(model, **self.fsdp_defaults, ...)`. Before, the plain module's loads
ahead of the wrapping took an isinstance guard, the plain branch's save became FSDP2's alone, the class body's
config was reported as left in place and the resume was reported. The oracle is torch's FSDP1 running the original
beside the migrated trainer at 2 ranks: the same losses, full checkpoints and resumed training."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from fsdp_legacy.migrate.rewriter import migrate_source

_WARP_CORE = """
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, FullStateDictConfig, ShardingStrategy
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def forward(self, x):
        return x + self.inner(x)


class WarpCore:
    fsdp_defaults = {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP, "cpu_offload": None}
    # (offload_to_cpu=False: torch's FSDP1 fails to offload on a CPU device, ../shared/FSDP1_FACTS.md)
    fsdp_fullstate_save_policy = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)

    def __init__(self, folder, use_fsdp=True):
        self.folder, self.use_fsdp = folder, use_fsdp
        self.is_main_node = dist.get_rank() == 0

    def setup_models(self, checkpoint=None):
        torch.manual_seed(0)
        generator = nn.Sequential(Block(), Block(), nn.Linear(8, 2))
        if checkpoint is not None:
            generator.load_state_dict(torch.load(checkpoint, weights_only=True))
        generator = generator.to(torch.float32)
        if self.use_fsdp:
            policy = ModuleWrapPolicy({Block})
            generator = FSDP(generator, **self.fsdp_defaults, auto_wrap_policy=policy, device_id=torch.device("cpu"))
        self.generator = generator

    def save_model(self, model, full_path, is_fsdp=False):
        if is_fsdp:
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, self.fsdp_fullstate_save_policy):
                checkpoint = model.state_dict()
            if self.is_main_node:
                torch.save(checkpoint, full_path)
            del checkpoint
        else:
            if self.is_main_node:
                checkpoint = model.state_dict()
                torch.save(checkpoint, full_path)
                del checkpoint
        dist.barrier()

    def save_optimizer(self, optim, full_path, fsdp_model=None):
        optim_statedict = FSDP.full_optim_state_dict(fsdp_model, optim)
        if self.is_main_node:
            torch.save(optim_statedict, full_path)
        dist.barrier()

    def load_optimizer(self, optim, full_path, fsdp_model=None):
        checkpoint = torch.load(full_path, weights_only=True) if self.is_main_node else None
        if fsdp_model is not None:
            sharded_optimizer_state_dict = FSDP.scatter_full_optim_state_dict(
                checkpoint if self.is_main_node else None, fsdp_model
            )
            optim.load_state_dict(sharded_optimizer_state_dict)
            del checkpoint, sharded_optimizer_state_dict
        else:
            optim.load_state_dict(checkpoint)
        return optim

    def train(self, resume_from=None):
        checkpoint = None if resume_from is None else os.path.join(resume_from, "generator.pt")
        self.setup_models(checkpoint)
        generator = self.generator
        optim = torch.optim.AdamW(generator.parameters(), lr=0.01)
        if resume_from is not None:
            optim = self.load_optimizer(optim, os.path.join(resume_from, "optim.pt"), fsdp_model=generator)
        losses = []
        for step in range(2):
            data = torch.Generator().manual_seed(10 * step + dist.get_rank())
            loss = nn.functional.mse_loss(generator(torch.randn(4, 8, generator=data)), torch.zeros(4, 2))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        self.save_model(generator, os.path.join(self.folder, "generator.pt"), is_fsdp=self.use_fsdp)
        self.save_optimizer(optim, os.path.join(self.folder, "optim.pt"), fsdp_model=generator)
        return losses
"""


def test_the_trainer_migrates_whole() -> None:
    result = migrate_source(_WARP_CORE)
    assert result.findings == [], [f.format("core.py") for f in result.findings]
    out = result.migrated
    # the plain module's load ahead of the wrapping, with a move in between, stays as written
    assert "            generator.load_state_dict(torch.load(checkpoint, weights_only=True))\n" in out
    # the plain branch's save keeps both forms; the block's config (the class body's) is the helper's data
    guarded = (
        "(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) if isinstance(model, FSDPModule)"
    )
    assert guarded in out
    assert "state_dict_config=self.fsdp_fullstate_save_policy)" in out
    # the scatter without optim= loads into the optimizer that loads its result
    loaded = "sharded_optimizer_state_dict = loaded_optim_state_dict(fsdp_model, optim, checkpoint if self.is_main_node"
    assert loaded in out and "del checkpoint, sharded_optimizer_state_dict" in out
    again = migrate_source(out)
    assert (again.migrated, again.findings) == (out, [])


def _side_by_side(original: str, migrated: str, folder: str) -> dict[str, Any]:
    seen = {}
    for kind, source in (("fsdp1", original), ("fsdp2", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, f"{kind}.py", "exec"), namespace)
        where = os.path.join(folder, kind)
        os.makedirs(where, exist_ok=True)
        first = namespace["WarpCore"](where).train()
        saved = (
            torch.load(os.path.join(where, "generator.pt"), weights_only=True)
            if namespace["dist"].get_rank() == 0
            else {}
        )
        resumed = namespace["WarpCore"](os.path.join(where, "again")).train(resume_from=os.path.join(folder, "fsdp1"))
        seen[kind] = first, saved, resumed
    return seen


def test_the_migrated_trainer_trains_saves_and_resumes_from_fsdp1s_checkpoint(ranks: Any, tmp_path: Path) -> None:
    migrated = migrate_source(_WARP_CORE).migrated
    for folder in ("fsdp1/again", "fsdp2/again"):
        (tmp_path / folder).mkdir(parents=True)
    for seen in ranks(_side_by_side, 2, _WARP_CORE, migrated, str(tmp_path)):
        (first1, saved1, resumed1), (first2, saved2, resumed2) = seen["fsdp1"], seen["fsdp2"]
        assert first2 == pytest.approx(first1, rel=1e-5)
        assert saved1.keys() == saved2.keys()
        assert all(torch.allclose(saved1[k], saved2[k], rtol=1e-5, atol=1e-7) for k in saved1)
        assert resumed2 == pytest.approx(resumed1, rel=1e-5) and resumed1 != first1
