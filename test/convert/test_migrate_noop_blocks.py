"""`fsdp-legacy migrate` on a state_dict_type block under which nothing reads the type, written in Lumina-T2X's
style: a consolidated FULL save, then each rank's optimizer state saved with `opt.state_dict()` inside `with
FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):`. FSDP1's type decides the model's state-dict calls
and its own optimizer-state API, never a torch optimizer's `state_dict()`, so the block does nothing and is taken
away whatever its type; FSDP2 has no LOCAL type, and before, the block kept the whole file FSDP1 (reported). A block
that calls anything the tool cannot see into, or the model's own state_dict(), still stays. The oracle is torch's
FSDP1 running the original beside the migrated program at 2 ranks: the same losses and consolidated dict, and each
program resuming from its own per-rank optimizer files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from fsdp_legacy.migrate.rewriter import migrate_source

_PROGRAM = """
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, FullStateDictConfig
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def build():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1))
    return FSDP(net, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), device_id=torch.device("cpu"))


def save(model, opt: torch.optim.Optimizer, ckpt_dir, other=None):
    # (offload_to_cpu=False: torch's FSDP1 fails to offload on a CPU device, ../shared/FSDP1_FACTS.md)
    config = FullStateDictConfig(rank0_only=True, offload_to_cpu=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        consolidated = model.state_dict()
        if dist.get_rank() == 0:
            torch.save(consolidated, os.path.join(ckpt_dir, "consolidated.pth"))
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        opt_path = os.path.join(ckpt_dir, f"optimizer.{dist.get_rank():05d}-of-{dist.get_world_size():05d}.pth")
        torch.save(opt.state_dict(), opt_path)
    dist.barrier()
    return consolidated


def train(ckpt_dir, resume):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if resume:
        opt_path = os.path.join(ckpt_dir, f"optimizer.{dist.get_rank():05d}-of-{dist.get_world_size():05d}.pth")
        opt.load_state_dict(torch.load(opt_path, weights_only=True))
    losses = []
    for step in range(2):
        data = torch.Generator().manual_seed(10 * step + dist.get_rank())
        loss = nn.functional.mse_loss(model(torch.randn(4, 8, generator=data)), torch.zeros(4, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, save(model, opt, ckpt_dir)
"""


def test_the_block_around_the_optimizers_save_is_taken_away() -> None:
    result = migrate_source(_PROGRAM)
    assert result.findings == [], [f.format("train.py") for f in result.findings]
    out = result.migrated
    assert "state_dict_type" not in out and "StateDictType" not in out
    assert "    torch.save(opt.state_dict(), opt_path)\n" in out  # (the block's body, one level out)
    again = migrate_source(out)
    assert (again.migrated, again.findings) == (out, [])


_STAYS = {
    "a call it cannot see into": "        persist(opt, opt_path)\n",
    "the model's own state_dict()": "        torch.save(model.state_dict(), opt_path)\n",
    "an object it cannot tell is an optimizer": "        torch.save(other.state_dict(), opt_path)\n",
}


@pytest.mark.parametrize("line", _STAYS.values(), ids=list(_STAYS))
def test_a_local_block_that_may_read_its_type_stays(line: str) -> None:
    source = _PROGRAM.replace("        torch.save(opt.state_dict(), opt_path)\n", line)
    result = migrate_source(source)
    assert result.migrated == source
    assert any("LOCAL" in f.why or "state_dict_type" in f.what for f in result.findings), [
        f.format("train.py") for f in result.findings
    ]


def _side_by_side(original: str, migrated: str, folder: str) -> dict[str, Any]:
    seen = {}
    for kind, source in (("fsdp1", original), ("fsdp2", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, f"{kind}.py", "exec"), namespace)
        where = os.path.join(folder, kind)
        os.makedirs(where, exist_ok=True)
        seen[kind] = namespace["train"](where, False), namespace["train"](where, True)
    return seen


def test_the_migrated_program_saves_and_resumes_as_fsdp1(ranks: Any, tmp_path: Path) -> None:
    migrated = migrate_source(_PROGRAM).migrated
    for rank, seen in enumerate(ranks(_side_by_side, 2, _PROGRAM, migrated, str(tmp_path))):
        for (losses1, full1), (losses2, full2) in zip(seen["fsdp1"], seen["fsdp2"], strict=True):
            assert losses2 == pytest.approx(losses1, rel=1e-5)
            assert full1.keys() == full2.keys() and bool(full1) == (rank == 0)
            assert all(torch.allclose(full1[k], full2[k], rtol=1e-5, atol=1e-7) for k in full1)
        first, resumed = seen["fsdp2"]
        assert first[0] != resumed[0]  # (the resumed run starts from the saved optimizer state)
