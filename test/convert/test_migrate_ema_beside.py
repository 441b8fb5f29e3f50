"""`fsdp-legacy migrate` on a trainer in Infinity's style: the trainer is handed its model and an EMA copy, both FSDP
models (`self.gpt`, `self.gpt_ema`), and saves and loads both inside one `FSDP.state_dict_type(self.gpt,
FULL_STATE_DICT, ...)` block with module-level rank0_only configs, the optimizer through
`FSDP.optim_state_dict(model=..., optim=..., optim_state_dict=optim.state_dict())` and the to-load by keywords.
Before, the EMA's calls kept both blocks (FSDP1 gives another model its own type there, which the text cannot tell
from the block's), and the passed-in optimizer dict was reported. Now they become `state_dict_beside` /
`load_state_dict_beside` (decided at run time) and the optimizer's own dict is FSDP1's default. The oracle is torch's
FSDP1 running the original beside the migrated trainer at 2 ranks: the same losses, checkpoints and resumed training;
beside_runtime's choices are checked against torch's FSDP1 on each kind of object."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

pytest.importorskip("libcst")

from fsdp_legacy.migrate.rewriter import migrate_source

_TRAINER = """
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.api import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

# (offload_to_cpu=False: torch's FSDP1 fails to offload on a CPU device, ../shared/FSDP1_FACTS.md)
fullstate_save_policy = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
fulloptstate_save_policy = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def forward(self, x):
        return x + self.inner(x)


class AmpOptimizer:
    def __init__(self, params):
        self.optimizer = torch.optim.AdamW(params, lr=0.02)
        self.scaler = None


def update_ema(ema, model, decay=0.5):
    with torch.no_grad():
        for p_ema, p in zip(ema.parameters(), model.parameters()):
            p_ema.mul_(decay).add_(p, alpha=1 - decay)


class InfinityTrainer(object):
    def __init__(self, gpt, gpt_opt, zero=1, gpt_ema=None, use_fsdp_model_ema=False):
        self.gpt, self.gpt_opt, self.zero = gpt, gpt_opt, zero
        self.gpt_ema, self.use_fsdp_model_ema = gpt_ema, use_fsdp_model_ema

    def train_step(self, step):
        data = torch.Generator().manual_seed(10 * step + dist.get_rank())
        loss = nn.functional.mse_loss(self.gpt(torch.randn(4, 8, generator=data)), torch.zeros(4, 2))
        loss.backward()
        self.gpt_opt.optimizer.step()
        self.gpt_opt.optimizer.zero_grad()
        if self.use_fsdp_model_ema:
            update_ema(self.gpt_ema, self.gpt)
        return loss.item()

    def state_dict(self):
        state = {}
        if self.zero:
            state['gpt_fsdp'] = None
            with FSDP.state_dict_type(
                self.gpt, StateDictType.FULL_STATE_DICT, fullstate_save_policy, fulloptstate_save_policy
            ):
                state['gpt_fsdp'] = self.gpt.state_dict()
                if self.use_fsdp_model_ema:
                    state['gpt_ema_fsdp'] = self.gpt_ema.state_dict()
                state['gpt_fsdp_opt'] = FSDP.optim_state_dict(
                    model=self.gpt, optim=self.gpt_opt.optimizer, optim_state_dict=self.gpt_opt.optimizer.state_dict()
                )
        return state

    def load_state_dict(self, state):
        if self.zero:
            with FSDP.state_dict_type(
                self.gpt, StateDictType.FULL_STATE_DICT, fullstate_save_policy, fulloptstate_save_policy
            ):
                self.gpt.load_state_dict(state['gpt_fsdp'])
                if self.use_fsdp_model_ema:
                    self.gpt_ema.load_state_dict(state['gpt_ema_fsdp'])
                one_group_opt_state = state['gpt_fsdp_opt']
                optim_state_dict = FSDP.optim_state_dict_to_load(
                    model=self.gpt, optim=self.gpt_opt.optimizer, optim_state_dict=one_group_opt_state
                )
                self.gpt_opt.optimizer.load_state_dict(optim_state_dict)


def build():
    torch.manual_seed(0)
    net = nn.Sequential(Block(), Block(), nn.Linear(8, 2))
    ema = copy.deepcopy(net)
    policy = ModuleWrapPolicy({Block})
    gpt = FSDP(net, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    gpt_ema = FSDP(ema, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    return InfinityTrainer(gpt, AmpOptimizer(gpt.parameters()), zero=1, gpt_ema=gpt_ema, use_fsdp_model_ema=True)
"""


def test_the_trainer_migrates_whole() -> None:
    result = migrate_source(_TRAINER)
    assert result.findings == [], [f.format("trainer.py") for f in result.findings]
    out = result.migrated
    beside = "state_dict_beside(self.gpt_ema, self.gpt, StateDictOptions(full_state_dict=True, cpu_offload=True))"
    assert f"state['gpt_ema_fsdp'] = {beside}" in out
    # (the model given by keyword: the block's rank0_only optimizer config still decides the options)
    saved = "get_optimizer_state_dict(self.gpt, self.gpt_opt.optimizer, options=StateDictOptions("
    saved += "full_state_dict=True, cpu_offload=True))"
    assert saved in out
    assert "set_optimizer_state_dict(self.gpt, self.gpt_opt.optimizer, unshared_optim_state(one_group_opt_state)" in out
    assert "FullStateDictConfig" not in out  # the configs went with both blocks
    again = migrate_source(out)
    assert (again.migrated, again.findings) == (out, [])


def _side_by_side(original: str, migrated: str, folder: str) -> dict[str, Any]:
    import torch.distributed as dist

    seen = {}
    for kind, source in (("fsdp1", original), ("fsdp2", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, f"{kind}.py", "exec"), namespace)
        trainer = namespace["build"]()
        losses = [trainer.train_step(step) for step in range(2)]
        state = trainer.state_dict()
        if kind == "fsdp1" and dist.get_rank() == 0:
            torch.save(state, os.path.join(folder, "fsdp1.pt"))
        dist.barrier()
        again = namespace["build"]()
        again.load_state_dict(torch.load(os.path.join(folder, "fsdp1.pt"), weights_only=True))
        resumed = [again.train_step(step) for step in range(2, 4)]
        seen[kind] = losses, state if dist.get_rank() == 0 else {}, resumed
    return seen


def test_the_migrated_trainer_saves_its_ema_and_resumes_from_fsdp1s_checkpoint(ranks: Any, tmp_path: Path) -> None:
    migrated = migrate_source(_TRAINER).migrated
    for rank, seen in enumerate(ranks(_side_by_side, 2, _TRAINER, migrated, str(tmp_path))):
        (losses1, state1, resumed1), (losses2, state2, resumed2) = seen["fsdp1"], seen["fsdp2"]
        assert losses2 == pytest.approx(losses1, rel=1e-5)
        assert resumed2 == pytest.approx(resumed1, rel=1e-5) and resumed1 != losses1
        if rank == 0:
            for key in ("gpt_fsdp", "gpt_ema_fsdp"):
                assert state1[key].keys() == state2[key].keys()
                assert all(torch.allclose(state1[key][k], state2[key][k], rtol=1e-5, atol=1e-7) for k in state1[key])
            moments1, moments2 = state1["gpt_fsdp_opt"]["state"], state2["gpt_fsdp_opt"]["state"]
            assert moments1.keys() == moments2.keys()
            for name in moments1:
                for field in ("exp_avg", "exp_avg_sq"):
                    assert torch.allclose(moments1[name][field], moments2[name][field], rtol=1e-5, atol=1e-8)


class _RunConfig:
    """switti's run arguments: an object with a state_dict() of its own and no model among its attributes."""

    def __init__(self) -> None:
        self.lr, self.names = 0.1, ["a", "b"]

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "names": list(self.names)}


class _Trainer:
    """An object whose state_dict() may call its model's, under the type the block set."""

    def __init__(self, model: nn.Module) -> None:
        self.parts = {"model": model}

    def state_dict(self) -> dict[str, Any]:
        return self.parts["model"].state_dict()


def _beside_choices() -> dict[str, Any]:
    """What beside_runtime gives each kind of object inside a FULL rank0_only block on one FSDP2 model, beside what
    torch's FSDP1 gives the same objects inside the same block on its model."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.api import FullStateDictConfig, StateDictType

    from fsdp_legacy.migrate.runtime import state_dict_beside

    def nets() -> tuple[nn.Module, nn.Module, nn.Module]:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), nn.Linear(4, 3), nn.Linear(2, 2)

    main, other, plain = nets()
    fsdp1_main = FSDP(main, device_id=torch.device("cpu"))
    fsdp1_other = FSDP(other, device_id=torch.device("cpu"))
    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with FSDP.state_dict_type(fsdp1_main, StateDictType.FULL_STATE_DICT, config):
        theirs = {"other": fsdp1_other.state_dict(), "plain": plain.state_dict(), "config": _RunConfig().state_dict()}
    main, other, plain = nets()
    inner = main[0]
    fully_shard(inner)
    fully_shard(main)
    fully_shard(other)
    assert isinstance(other, FSDPModule)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    ours = {
        "other": state_dict_beside(other, main, options),  # FSDP1's default for another model: full on every rank
        "plain": state_dict_beside(plain, main, options),
        "inner": state_dict_beside(inner, main, options),  # inside the block's model: rank 0 only
        "optimizer": state_dict_beside(torch.optim.SGD(plain.parameters(), lr=0.1), main, options),
        "config": state_dict_beside(_RunConfig(), main, options),  # no module among its attributes: its own call
    }
    errors = {}
    cases = (("holder", nn.Sequential(main), NotImplementedError), ("object", _Trainer(other), TypeError))
    for what, obj, exception in cases:
        try:
            state_dict_beside(obj, main, options)
        except exception as error:
            errors[what] = str(error)
    return {"theirs": theirs, "ours": ours, "errors": errors, "rank": dist.get_rank()}


def test_state_dict_beside_gives_each_object_what_torchs_fsdp1_gives_it(ranks: Any) -> None:
    for seen in ranks(_beside_choices, 2):
        theirs, ours = seen["theirs"], seen["ours"]
        for what in ("other", "plain"):
            assert theirs[what].keys() == ours[what].keys()
            assert all(torch.equal(theirs[what][k], ours[what][k]) for k in theirs[what])
        assert all(not hasattr(v, "device_mesh") for v in ours["other"].values())  # full on every rank
        assert bool(ours["inner"]) == (seen["rank"] == 0)  # the block's rank0_only
        assert "state" in ours["optimizer"] and "param_groups" in ours["optimizer"]
        assert ours["config"] == theirs["config"]
        assert "holds the model of the state_dict_type block" in seen["errors"]["holder"]
        assert "_Trainer.state_dict() inside FSDP1's state_dict_type block" in seen["errors"]["object"]
