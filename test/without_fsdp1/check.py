"""Runs on 2 ranks with this folder's sitecustomize.py (a torch without FSDP1): trains with fsdp_legacy against DDP,
round-trips FULL / SHARDED / LOCAL state dicts and the optimizer state through DCP, converts the LOCAL checkpoint
offline and loads the SHARDED one into FSDP2. With --switched (FSDP_LEGACY=1), everything goes through torch's FSDP1
names, as code written for torch's FSDP1 does, and torch's own DSD helpers are used too. Rank 0 writes what it found
to --out as JSON for test_without_fsdp1.py.

    python -m torch.distributed.run --nproc-per-node=2 check.py --out results.json [--switched]
"""

import argparse
import copy
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # test/: the shared test models
import models


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _train(model: torch.nn.Module, steps: int = 3, optimizer: torch.optim.Optimizer | None = None) -> None:
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        model(models.Net.batch(100 * step + dist.get_rank())).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--switched", action="store_true")
    parser.add_argument("--dir", type=Path, required=True, help="scratch directory shared by the ranks")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    found: dict[str, Any] = {}

    torch_fsdp = importlib.import_module("torch.distributed.fsdp")
    try:  # a file of torch's, or (switched) the stand-in module fsdp_legacy.install() registers, or nothing
        module = importlib.import_module("torch.distributed.fsdp.fully_sharded_data_parallel")
        found["torch_fsdp1_module"] = "torch's" if getattr(module, "__file__", None) else "stand-in"
    except ModuleNotFoundError:
        found["torch_fsdp1_module"] = "gone"
    if args.switched:  # code written for torch's FSDP1, unchanged
        api = torch_fsdp
        wrap = importlib.import_module("torch.distributed.fsdp.wrap")
    else:
        found["torch_has_fsdp1_class"] = hasattr(torch_fsdp, "FullyShardedDataParallel")
        api = importlib.import_module("fsdp_legacy")
        wrap = importlib.import_module("fsdp_legacy.wrap")
    FSDP = api.FullyShardedDataParallel
    found["fsdp_class"] = f"{FSDP.__module__}.{FSDP.__qualname__}"

    def build(seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        return FSDP(models.Net(), auto_wrap_policy=wrap.ModuleWrapPolicy({models.Block}))

    torch.manual_seed(0)
    reference = DDP(copy.deepcopy(models.Net()))
    model = build()
    _train(model)
    _train(reference)
    with FSDP.state_dict_type(model, api.StateDictType.FULL_STATE_DICT):
        full = {k: v.clone() for k, v in model.state_dict().items()}
    found["vs_ddp"] = _max_difference(full, reference.module.state_dict())

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model(models.Net.batch(7)).sum().backward()
    optimizer.step()
    with FSDP.state_dict_type(model, api.StateDictType.FULL_STATE_DICT):
        full = {k: v.clone() for k, v in model.state_dict().items()}
    legacy = FSDP.full_optim_state_dict(model, optimizer)  # (rank 0 only, by default)
    found["legacy_full_optim_state_dict"] = sorted(legacy["state"]) if dist.get_rank() == 0 else None

    from fsdp_legacy.state import dcp_checkpoint  # dcp.save + the side file the converter reads LOCAL layouts from

    for kind in ("SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        path = str(args.dir / kind)
        with FSDP.state_dict_type(model, api.StateDictType[kind]):
            dcp_checkpoint.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}, path)
        other = build(seed=1)
        other_optimizer = torch.optim.SGD(other.parameters(), lr=0.05, momentum=0.9)
        _train(other, steps=1, optimizer=other_optimizer)  # (an optimizer with state: its entries are loaded into)
        with FSDP.state_dict_type(other, api.StateDictType[kind]):
            state = {"model": other.state_dict(), "optim": FSDP.optim_state_dict(other, other_optimizer)}
            dcp_checkpoint.load(state, path)
            other.load_state_dict(state["model"])
            other_optimizer.load_state_dict(FSDP.optim_state_dict_to_load(other, other_optimizer, state["optim"]))
        with FSDP.state_dict_type(other, api.StateDictType.FULL_STATE_DICT):
            found[f"{kind}_round_trip"] = _max_difference(other.state_dict(), full)

    if args.switched:  # torch's own DSD helpers, through the switch
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        other = build(seed=2)
        other_optimizer = torch.optim.SGD(other.parameters(), lr=0.05, momentum=0.9)
        set_state_dict(other, other_optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        with FSDP.state_dict_type(other, api.StateDictType.FULL_STATE_DICT):
            found["torch_dsd_helpers_round_trip"] = _max_difference(other.state_dict(), full)

    # FSDP2 loads the SHARDED checkpoint.
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    fsdp2 = models.Net()
    fully_shard(fsdp2.block)
    fully_shard(fsdp2)
    state = fsdp2.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(args.dir / "SHARDED_STATE_DICT"))
    fsdp2.load_state_dict(state)
    found["fsdp2_load"] = _max_difference(
        {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in fsdp2.state_dict().items()}, full
    )

    dist.barrier()
    if dist.get_rank() == 0:
        from fsdp_legacy.convert import convert_checkpoint

        converted = str(args.dir / "full.pt")
        convert_checkpoint(str(args.dir / "LOCAL_STATE_DICT"), converted, to="full")
        found["converted_local"] = _max_difference(torch.load(converted, weights_only=True)["model"], full)
        args.out.write_text(json.dumps(found, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown after gloo collectives (tools/process_exit.py)


if __name__ == "__main__":
    main()
