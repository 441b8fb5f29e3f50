"""`fsdp-legacy migrate` on a program that wraps its model with FSDP on some runs and with DDP on the others, written
in open_lm's style: `model = FSDP(model, ...)` under `if args.fsdp:`, `model = DDP(model)` under its `else:`, a
`load_model(args, model)` ahead of the wrapping, a `save_checkpoint(args, model, ...)` whose FULL block runs under
the flag while its `model.state_dict()` outside it serves the DDP runs, and a `load_optimizer` that converts the
optimizer state under the flag (`osd = FSDP.optim_state_dict_to_load(...)`) and loads either form after it.

Before, the `model.state_dict()` became `get_model_state_dict(model, ...)`, which on DDP's runs saved the keys
without DDP's `module.` (a checkpoint unlike the original's, silently); the plain module's load ahead of the
wrapping became `set_model_state_dict`; the optimizer's conversion was reported. The oracle is the original program
(torch's FSDP1, and DDP) run beside the migrated one at 2 ranks, both ways: the same losses and checkpoints, and
each program resuming from the original's checkpoint."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from fsdp_legacy.migrate.program import migrate_program

_PROGRAM = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, FullStateDictConfig


def load_model(args, model):
    sd = torch.load(args.resume, weights_only=True)["state_dict"]
    if next(iter(sd)).startswith("module."):
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    model.load_state_dict(sd)


def load_optimizer(args, model, optimizer):
    osd = torch.load(args.resume, weights_only=True)["optimizer"]
    if args.fsdp:
        osd = FSDP.optim_state_dict_to_load(model=model, optim=optimizer, optim_state_dict=osd)
    optimizer.load_state_dict(osd)


def save_checkpoint(args, model, optimizer, path):
    cpu_state, optim_state = None, None
    if args.fsdp:
        # (offload_to_cpu=False: torch's FSDP1 fails to offload on a CPU device, ../shared/FSDP1_FACTS.md)
        policy = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, policy):
            cpu_state = model.state_dict()
            optim_state = FSDP.optim_state_dict(model, optimizer)
    checkpoint = {
        "state_dict": cpu_state if args.fsdp else model.state_dict(),
        "optimizer": optim_state if args.fsdp else optimizer.state_dict(),
    }
    if dist.get_rank() == 0:
        torch.save(checkpoint, path)
    dist.barrier()
    return checkpoint


def main(args):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    if args.resume is not None:
        load_model(args, model)
    if args.fsdp:
        model = FSDP(model, device_id=torch.device("cpu"))
    else:
        model = DDP(model)
    width = model.module[0].in_features
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    if args.resume is not None:
        load_optimizer(args, model, optimizer)
    losses = []
    for step in range(2):
        data = torch.Generator().manual_seed(10 * step + dist.get_rank())
        loss = nn.functional.mse_loss(model(torch.randn(4, width, generator=data)), torch.zeros(4, 1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, save_checkpoint(args, model, optimizer, args.path)
"""


def _migrated() -> str:
    result = migrate_program({"main.py": _PROGRAM}).results["main.py"]
    assert result.findings == [], [f.format("main.py") for f in result.findings]
    return result.migrated


def test_the_calls_that_serve_both_wrappers_keep_both_forms() -> None:
    out = _migrated()
    assert "    model.load_state_dict(sd)\n" in out  # (the plain module, ahead of its wrapping)
    guarded = (
        "cpu_state if args.fsdp else (get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) "
        "if isinstance(model, FSDPModule) else model.state_dict())"
    )
    assert guarded in out
    full = "cpu_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))"
    assert full in out  # (inside the flag's branch: FSDP's alone)
    assert "width = (model if isinstance(model, FSDPModule) else model.module)[0].in_features" in out
    assert "        model = DDP(model)\n" in out and "        fully_shard(model)\n" in out
    # the converted optimizer state, loaded by the line after the branch either way: loaded at once under FSDP2
    to_load = "osd = loaded_optim_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))"
    assert to_load in out and "    optimizer.load_state_dict(osd)\n" in out
    again = migrate_program({"main.py": out}).results["main.py"]
    assert (again.migrated, again.findings) == (out, [])


def _both_ways(original: str, migrated: str, folder: str) -> dict[tuple[str, bool, bool], Any]:
    seen = {}
    for kind, source in (("fsdp1", original), ("fsdp2", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, f"{kind}.py", "exec"), namespace)
        for fsdp in (True, False):
            for resume in (False, True):
                first = f"{folder}/fsdp1-{fsdp}-False.pt"  # (each program resumes from the original's checkpoint)
                path = f"{folder}/{kind}-{fsdp}-{resume}.pt"
                args = types.SimpleNamespace(fsdp=fsdp, resume=first if resume else None, path=path)
                seen[kind, fsdp, resume] = namespace["main"](args)
    return seen


def test_both_wrappers_train_save_and_resume_as_the_original(ranks: Any, tmp_path: Path) -> None:
    for rank, seen in enumerate(ranks(_both_ways, 2, _PROGRAM, _migrated(), str(tmp_path))):
        for fsdp in (True, False):
            for resume in (False, True):
                (losses1, saved1), (losses2, saved2) = seen["fsdp1", fsdp, resume], seen["fsdp2", fsdp, resume]
                assert losses2 == pytest.approx(losses1, rel=1e-5)
                model1, model2 = saved1["state_dict"], saved2["state_dict"]
                assert model1.keys() == model2.keys()
                assert all(torch.allclose(model1[k], model2[k], rtol=1e-5, atol=1e-7) for k in model1)
                if not fsdp:  # DDP's own dict on every rank, its keys under `module.` as the original saved them
                    assert model1 and all(k.startswith("module.") for k in model1)
                else:
                    assert bool(model1) == (rank == 0)
                optim1, optim2 = saved1["optimizer"]["state"], saved2["optimizer"]["state"]
                assert optim1.keys() == optim2.keys() and len(optim1) == 4
                for key in optim1:
                    assert torch.allclose(optim1[key]["exp_avg_sq"], optim2[key]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
            assert seen["fsdp2", fsdp, True][0] != seen["fsdp2", fsdp, False][0]  # (it did resume)


_SHAPES = {  # how the model reaches `return model.state_dict()` -> whether it is surely the wrapped model there
    "compiled after the wrapping": ("model = FSDP(model)\n    if flag:\n        model = torch.compile(model)\n", True),
    "on both branches": ("if flag:\n        model = FSDP(model)\n    else:\n        model = FSDP(model.half())\n",
                                 True),
    "wrapped on one branch": ("if flag:\n        model = FSDP(model)\n", False),
    "wrapped, then replaced on one branch": ("model = FSDP(model)\n    if flag:\n        model = nn.Identity()\n",
                                             True),
}  # fmt: skip


@pytest.mark.parametrize("shape,surely", _SHAPES.values(), ids=list(_SHAPES))
def test_only_a_model_that_may_be_another_module_is_guarded(shape: str, surely: bool) -> None:
    """A binding after the wrapping is a transformation of the wrapped model (torch.compile's module, which
    get_model_state_dict takes as it is): the call stays FSDP2's alone. (The last shape is a program replacing its
    model after wrapping it, which the tool takes as a transformation too: FSDP1 would give the Identity's dict.)"""
    source = (
        "import torch\nimport torch.nn as nn\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        f"def main(flag):\n    model = nn.Linear(4, 4)\n    {shape}    return model.state_dict()\n"
    )
    out = migrate_program({"main.py": source}).results["main.py"].migrated
    fsdp2 = "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))"
    assert fsdp2 in out and ("isinstance(model, FSDPModule)" in out) == (not surely), out
