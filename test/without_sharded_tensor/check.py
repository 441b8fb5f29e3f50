"""Runs on the ranks of `torch.distributed.run` with torch's ShardedTensor hidden, as a torch that has removed it will
be: `torch.distributed._shard.sharded_tensor` no longer imports. fsdp_legacy's SHARDED model and optimizer state dicts
without a device mesh then hold DTensors, Shard(0) on a 1-D mesh over the process group; they must equal torch FSDP1's
SHARDED state dicts with a 1-D `device_mesh` (the oracle, the format it has for DTensors), save and load through DCP,
load into FSDP2 and convert offline with fsdp_legacy's converter. Rank 0 writes what it found to --out as JSON for
test_without_sharded_tensor.py.

    python -m torch.distributed.run --nproc-per-node=2 check.py --out results.json --dir SCRATCH
"""

import argparse
import importlib
import json
import os
import sys
import warnings
from importlib.abc import MetaPathFinder
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp  # torch 2.13's DCP imports ShardedTensor itself: loaded before it goes
import torch.distributed.fsdp as torch_fsdp  # the oracle, loaded while torch still has what it needs
import torch.distributed.fsdp.wrap as torch_wrap
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

HIDDEN = "torch.distributed._shard.sharded_tensor"


class _WithoutShardedTensor(MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == HIDDEN or name.startswith(HIDDEN + "."):
            raise ModuleNotFoundError(f"No module named {name!r} (this torch has no ShardedTensor)", name=name)
        return None


def hide_sharded_tensor() -> None:
    for name in [n for n in sys.modules if n == HIDDEN or n.startswith(HIDDEN + ".")]:
        del sys.modules[name]
    import torch.distributed._shard as shard_package

    shard_package.__dict__.pop("sharded_tensor", None)
    sys.meta_path.insert(0, _WithoutShardedTensor())


hide_sharded_tensor()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # test/: the shared test models
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: fsdp_legacy
import fsdp_legacy  # noqa: E402
import fsdp_legacy.wrap  # noqa: E402
import models  # noqa: E402
from fsdp_legacy.state import sharded_tensor_compat  # noqa: E402


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a) if a else 0.0


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for step in range(steps):
        model(models.Net.batch(100 * step + dist.get_rank())).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _describe(value: Any) -> Any:
    """What must match torch's: container, global shape, placements, mesh ranks, the local piece."""
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_describe(v) for v in value]
    if isinstance(value, DTensor):
        return ["DTensor", list(value.shape), [str(p) for p in value.placements], value.device_mesh.mesh.tolist()]
    if isinstance(value, torch.Tensor):
        return ["Tensor", list(value.shape)]
    return repr(value)


def _locals(value: Any) -> list[torch.Tensor]:
    if isinstance(value, dict):
        return [t for v in value.values() for t in _locals(v)]
    if isinstance(value, DTensor):
        return [value.to_local()]
    return [value] if isinstance(value, torch.Tensor) else []


def _sharded(lib: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    fsdp = lib.FullyShardedDataParallel
    with fsdp.state_dict_type(model, lib.StateDictType.SHARDED_STATE_DICT):
        return {"model": model.state_dict(), "optim": fsdp.optim_state_dict(model, optimizer)}


def _full(lib: Any, model: torch.nn.Module) -> dict:
    with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType.FULL_STATE_DICT):
        return {k: v.clone() for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True, help="scratch directory shared by the ranks")
    parser.add_argument("--use-orig-params", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    found: dict[str, Any] = {}
    try:
        importlib.import_module(HIDDEN)
        found["sharded_tensor_hidden"] = False
    except ModuleNotFoundError:
        found["sharded_tensor_hidden"] = True
    found["fsdp_legacy_sees_sharded_tensor"] = sharded_tensor_compat.AVAILABLE
    uop = args.use_orig_params

    def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = fsdp_legacy.FullyShardedDataParallel(
            models.Net(), auto_wrap_policy=fsdp_legacy.wrap.ModuleWrapPolicy({models.Block}), use_orig_params=uop
        )
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    ours, ours_optimizer = build()
    torch.manual_seed(0)
    theirs = torch_fsdp.FullyShardedDataParallel(
        models.Net(),
        auto_wrap_policy=torch_wrap.ModuleWrapPolicy({models.Block}),
        use_orig_params=uop,
        device_id=torch.device("cpu"),
        device_mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
    )
    theirs_optimizer = torch.optim.Adam(theirs.parameters(), lr=0.01)
    _train(ours, ours_optimizer)
    _train(theirs, theirs_optimizer)
    sharded, expected = _sharded(fsdp_legacy, ours, ours_optimizer), _sharded(torch_fsdp, theirs, theirs_optimizer)
    # torch's mesh and ours (over the same ranks) print alike; their keys, containers and pieces must be torch's.
    found["same_layout_as_torch_with_a_mesh"] = _describe(sharded) == _describe(expected)
    found["layout"] = _describe(sharded)
    mine, oracle = _locals(sharded), _locals(expected)
    found["vs_torch_with_a_mesh"] = max(
        float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(mine, oracle, strict=True)
    )
    full = _full(fsdp_legacy, ours)

    path = str(args.dir / "SHARDED_STATE_DICT")
    dcp.save(sharded, checkpoint_id=path)
    other, other_optimizer = build(seed=1)
    _train(other, other_optimizer, steps=1)
    state = _sharded(fsdp_legacy, other, other_optimizer)
    dcp.load(state, checkpoint_id=path)
    with fsdp_legacy.FullyShardedDataParallel.state_dict_type(other, fsdp_legacy.StateDictType.SHARDED_STATE_DICT):
        other.load_state_dict(state["model"])
        other_optimizer.load_state_dict(
            fsdp_legacy.FullyShardedDataParallel.optim_state_dict_to_load(other, other_optimizer, state["optim"])
        )
    found["dcp_round_trip"] = _max_difference(_full(fsdp_legacy, other), full)
    found["dcp_round_trip_optim"] = max(
        float((a - b).abs().max()) if a.numel() else 0.0
        for a, b in zip(_locals(_sharded(fsdp_legacy, other, other_optimizer)), mine, strict=True)
    )
    with fsdp_legacy.FullyShardedDataParallel.state_dict_type(ours, fsdp_legacy.StateDictType.LOCAL_STATE_DICT):
        try:
            ours.state_dict()
            found["local_state_dict"] = "saved"
        except RuntimeError as error:
            found["local_state_dict"] = str(error)

    # FSDP2 loads the checkpoint.
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    fsdp2 = models.Net()
    fully_shard(fsdp2.block)
    fully_shard(fsdp2)
    fsdp2_state = fsdp2.state_dict()
    dcp.load({"model": fsdp2_state}, checkpoint_id=path)
    fsdp2.load_state_dict(fsdp2_state)
    found["fsdp2_load"] = _max_difference(
        {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in fsdp2.state_dict().items()}, full
    )

    dist.barrier()
    if dist.get_rank() == 0:
        from fsdp_legacy.convert import convert_checkpoint

        converted = str(args.dir / "full.pt")
        convert_checkpoint(path, converted, to="full")
        found["converted"] = _max_difference(torch.load(converted, weights_only=True)["model"], full)
        args.out.write_text(json.dumps(found, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown after gloo collectives (tools/process_exit.py)


if __name__ == "__main__":
    main()
