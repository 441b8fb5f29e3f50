"""`fsdp-legacy migrate` on a training strategy class in prismatic-vlms' style: `__init__` keeps the state-dict type
it is given and FSDP1's configs as attributes (`self.fsdp_state_dict_type = state_dict_type`, `self.fsdp_save_policy
= FullStateDictConfig(...)`), and `save_checkpoint` opens `with FSDP.state_dict_type(self.vlm,
self.fsdp_state_dict_type, self.fsdp_save_policy):`. Before, the blocks kept the whole file FSDP1 (a type and configs
it could not read); now each block is decided at run time by state_dict_type_options, the configs staying as the
data it reads. The oracle is torch's FSDP1 running the original beside the migrated class at 2 ranks: the same
losses, rank 0's full model dict and the full optimizer state."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from fsdp_legacy.migrate.rewriter import migrate_source

_STRATEGY = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class FSDPStrategy:
    def __init__(self, vlm, state_dict_type=StateDictType.FULL_STATE_DICT):
        assert state_dict_type == StateDictType.FULL_STATE_DICT, "Sharded state saving is not yet implemented!"
        self.fsdp_state_dict_type = state_dict_type
        # (offload_to_cpu=False: torch's FSDP1 fails to offload on a CPU device, ../shared/FSDP1_FACTS.md)
        self.fsdp_save_policy = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        self.fsdp_save_optimizer_policy = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)
        policy = ModuleWrapPolicy({nn.Sequential})
        self.vlm = FSDP(vlm, auto_wrap_policy=policy, device_id=torch.device("cpu"))
        self.optimizer = torch.optim.AdamW(self.vlm.parameters(), lr=0.01)

    def run_training(self, steps):
        losses = []
        for step in range(steps):
            data = torch.Generator().manual_seed(10 * step + dist.get_rank())
            loss = nn.functional.mse_loss(self.vlm(torch.randn(4, 8, generator=data)), torch.zeros(4, 1))
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    def save_checkpoint(self, only_trainable=True):
        with FSDP.state_dict_type(self.vlm, self.fsdp_state_dict_type, self.fsdp_save_policy):
            full_vlm_state_dict = self.vlm.state_dict()
            model_state_dicts = {key: param for key, param in full_vlm_state_dict.items() if only_trainable}
        with FSDP.state_dict_type(self.vlm, self.fsdp_state_dict_type, None, self.fsdp_save_optimizer_policy):
            optimizer_state_dict = FSDP.optim_state_dict(self.vlm, self.optimizer)
        return model_state_dicts, optimizer_state_dict


def run():
    torch.manual_seed(0)
    strategy = FSDPStrategy(nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1)))
    return strategy.run_training(3), *strategy.save_checkpoint()
"""


def test_the_blocks_are_decided_at_run_time_with_the_attributes_as_configs() -> None:
    result = migrate_source(_STRATEGY)
    assert result.findings == [], [f.format("fsdp.py") for f in result.findings]
    out = result.migrated
    decided = (
        "state_dict_options, optim_state_dict_options = state_dict_type_options("
        "state_dict_type=self.fsdp_state_dict_type, state_dict_config=self.fsdp_save_policy)"
    )
    assert decided in out and "get_model_state_dict(self.vlm, options=state_dict_options)" in out
    assert "get_optimizer_state_dict(self.vlm, self.optimizer, options=optim_state_dict_options)" in out
    # the configs stay as written: the data the helper reads
    assert "self.fsdp_save_policy = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)" in out
    again = migrate_source(out)
    assert (again.migrated, again.findings) == (out, [])


_STAYS = {
    "the config read elsewhere": ("        return model_state_dicts, optimizer_state_dict\n",
                                  "        return model_state_dicts, optimizer_state_dict, self.fsdp_save_policy\n"),
    "the config assigned twice": ("    def run_training(self, steps):\n",
                                  "    def reset(self):\n        self.fsdp_save_policy = FullStateDictConfig()\n\n"
                                  "    def run_training(self, steps):\n"),
}  # fmt: skip


@pytest.mark.parametrize("change", _STAYS.values(), ids=list(_STAYS))
def test_an_attribute_config_it_cannot_follow_keeps_the_file(change: tuple[str, str]) -> None:
    source = _STRATEGY.replace(*change)
    result = migrate_source(source)
    assert result.migrated == source and any("state_dict_type" in f.what for f in result.findings)


def _side_by_side(original: str, migrated: str) -> list[Any]:
    out = []
    for name, source in (("fsdp1.py", original), ("fsdp2.py", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, name, "exec"), namespace)
        out.append(namespace["run"]())
    return out


def test_the_migrated_strategy_trains_and_saves_as_fsdp1(ranks: Any) -> None:
    migrated = migrate_source(_STRATEGY).migrated
    for rank, ((losses1, model1, optim1), (losses2, model2, optim2)) in enumerate(
        ranks(_side_by_side, 2, _STRATEGY, migrated)
    ):
        assert losses2 == pytest.approx(losses1, rel=1e-5)
        assert model1.keys() == model2.keys() and bool(model1) == (rank == 0)
        assert all(torch.allclose(model1[k], model2[k], rtol=1e-5, atol=1e-7) for k in model1)
        if rank == 0:
            state1, state2 = optim1["state"], optim2["state"]
            assert state1.keys() == state2.keys() and len(state1) == 4
            for key in state1:
                assert torch.allclose(state1[key]["exp_avg"], state2[key]["exp_avg"], rtol=1e-5, atol=1e-8)


# Accelerate's style: the type and configs come on a plugin object made elsewhere (`accelerator.state.fsdp_plugin`)
_PLUGIN = """
import types
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def save_model(fsdp_plugin, model, optimizer):
    with FSDP.state_dict_type(
        model, fsdp_plugin.state_dict_type, fsdp_plugin.state_dict_config, fsdp_plugin.optim_state_dict_config
    ):
        return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}


def run():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))  # (a shard on each rank)
    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(dist.get_rank())
    nn.functional.mse_loss(model(torch.randn(4, 8, generator=data)), torch.zeros(4, 2)).backward()
    optimizer.step()
    plugins = [  # (made by the launcher's configuration; offload_to_cpu=False: torch's FSDP1 cannot offload on CPU)
        types.SimpleNamespace(
            state_dict_type=StateDictType.FULL_STATE_DICT,
            state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        ),
        types.SimpleNamespace(
            state_dict_type=StateDictType.SHARDED_STATE_DICT,
            state_dict_config=ShardedStateDictConfig(offload_to_cpu=False),
            optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=False),
        ),
    ]
    return [save_model(plugin, model, optimizer)["model"] for plugin in plugins]
"""


def test_a_plugins_type_and_configs_are_read_at_run_time(ranks: Any) -> None:
    """The block is decided by state_dict_type_options from the plugin's attributes, whatever they hold: per rank,
    rank 0's full tensors under FULL (nothing elsewhere) and each rank's shards under SHARDED, as FSDP1 gives them."""
    from test_migrate_state_dict_type import _equal, _under_the_set_type

    result = migrate_source(_PLUGIN)
    out = result.migrated
    assert "state_dict_type_options(state_dict_type=fsdp_plugin.state_dict_type" in out, out
    assert "get_model_state_dict(model, options=state_dict_options)" in out
    for rank, (fsdp1, fsdp2) in enumerate(ranks(_under_the_set_type, 2, _PLUGIN, out)):
        full, sharded = fsdp1[1]
        assert full[0] == "dict" and bool(full[1]) == (rank == 0) and {k for k, _ in sharded[1].values()} == {"shard"}
        assert _equal(fsdp2, fsdp1)
