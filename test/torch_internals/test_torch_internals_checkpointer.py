"""A research trainer's own checkpointer written against torch's FSDP1 internals (the pattern of OLMo's local
sharded checkpointer, written out here): each rank saves its flat parameters' local data with the metadata
attributes that exist (`_fqns`, `_shapes`, `_numels`, `_shard_param_infos`, ...), checks them on restore and copies
the data back; offline, the full parameters are rebuilt from the files through `_shard_param_infos`. The same code
runs on torch's FSDP1 and, through the switch, on ours: a checkpoint written by either restores into the other, and
both rebuild the model's parameters."""

import os
import tempfile
import warnings

import torch
import torch.distributed as dist
from parameterized import parameterized
from torch import nn

import fsdp_legacy
from harness import run_on_ranks

METADATA = ("_fqns", "_numels", "_numels_with_padding", "_shapes", "_shard_numel_padded", "_shard_param_infos")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(7, 6), nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)), nn.Linear(3, 7))


def _wrap(model: nn.Module, use_orig_params: bool) -> nn.Module:
    """Wrapped through torch's names: fsdp_legacy's when the switch is on, torch's FSDP1 otherwise."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs = {} if fsdp_legacy.installed() else {"device_id": torch.device("cpu")}
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=use_orig_params, **kwargs)


def _handles(model: nn.Module) -> list:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._runtime_utils import _lazy_init

    _lazy_init(model, model)  # as the checkpointer does before reading the handles
    return [m._handle for m in model.modules() if isinstance(m, FSDP) and m._handle is not None]


@torch.no_grad()
def _save(model: nn.Module, path: str) -> None:
    data = []
    for handle in _handles(model):
        flat = handle.flat_param
        entry = {"data": flat.detach().clone()}
        entry.update({key: getattr(flat, key) for key in METADATA if hasattr(flat, key)})
        data.append(entry)
    torch.save(data, path)


@torch.no_grad()
def _restore(model: nn.Module, path: str) -> None:
    data = torch.load(path, weights_only=False)  # (the checkpointer's own file: named tuples inside)
    handles = _handles(model)
    assert len(handles) == len(data)
    for handle, entry in zip(handles, data, strict=True):
        for key in METADATA:
            assert hasattr(handle.flat_param, key), key  # a checkpoint that lacks it could not be rebuilt
            assert getattr(handle.flat_param, key) == entry[key], (key, getattr(handle.flat_param, key), entry[key])
        handle.flat_param.copy_(entry["data"])


def _rebuild(paths: list[str]) -> dict[str, torch.Tensor]:
    """The full parameters from every rank's file (each flat parameter's pieces copied into place), no model."""
    full: dict[str, torch.Tensor] = {}
    for path in paths:
        for index, entry in enumerate(torch.load(path, weights_only=False)):
            for fqn, shape, info in zip(entry["_fqns"], entry["_shapes"], entry["_shard_param_infos"], strict=True):
                target = full.setdefault(f"{index}:{fqn}", torch.zeros(shape))
                if info.in_shard:
                    piece = entry["data"][info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
                    target.view(-1)[info.intra_param_start_idx : info.intra_param_end_idx + 1].copy_(piece)
    return full


def _expected() -> dict[str, torch.Tensor]:
    """What the rebuilt files must hold: each unit's parameters (the root first, as modules() finds the units),
    by the same keys, from the unwrapped model."""
    model = _model()
    units = [model, model[1][0], model[1][1], model[2]]  # ModuleWrapPolicy({nn.Linear}) under the root
    wrapped_below = {id(p) for unit in units[1:] for p in unit.parameters()}
    out = {}
    for index, unit in enumerate(units):
        for name, param in unit.named_parameters():
            if index > 0 or id(param) not in wrapped_below:
                out[f"{index}:{name}"] = param.detach()
    return out


def _round_trip(write_ours: bool, use_orig_params: bool, directory: str) -> list:
    """One library writes after a step, the other restores into a fresh model: the restored full parameters equal the
    writer's."""
    path = os.path.join(directory, f"rank{dist.get_rank()}.pt")
    results = []
    for ours in (write_ours, not write_ours):
        if ours:
            fsdp_legacy.install()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = _wrap(_model(), use_orig_params)
                if ours == write_ours:
                    optim = torch.optim.SGD(model.parameters(), lr=0.1)
                    model(torch.tensor([[1, 2, 3]])).sum().backward()
                    optim.step()
                    _save(model, path)
                else:
                    dist.barrier()
                    _restore(model, path)
                with type(model).summon_full_params(model):
                    results.append({name: p.detach().clone() for name, p in model.named_parameters()})
        finally:
            if ours:
                fsdp_legacy.uninstall()
    dist.barrier()
    return results


@parameterized.expand([(w, u) for w in (False, True) for u in (False, True)])
def test_a_checkpointer_on_internals_moves_checkpoints_both_ways(write_ours: bool, use_orig_params: bool) -> None:
    with tempfile.TemporaryDirectory() as directory:
        for written, restored in run_on_ranks(_round_trip, 2, write_ours, use_orig_params, directory):
            assert written.keys() == restored.keys()
            for name in written:
                torch.testing.assert_close(written[name], restored[name], rtol=0, atol=0)


def _write(ours: bool, use_orig_params: bool, directory: str) -> None:
    if ours:
        fsdp_legacy.install()
    try:
        _save(_wrap(_model(), use_orig_params), os.path.join(directory, f"rank{dist.get_rank()}.pt"))
    finally:
        if ours:
            fsdp_legacy.uninstall()


@parameterized.expand([(o, u) for o in (False, True) for u in (False, True)])
def test_files_rebuild_the_full_parameters_offline(ours: bool, use_orig_params: bool) -> None:
    with tempfile.TemporaryDirectory() as directory:
        run_on_ranks(_write, 2, ours, use_orig_params, directory)
        rebuilt = _rebuild([os.path.join(directory, f"rank{r}.pt") for r in range(2)])
    expected = _expected()
    assert rebuilt.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(rebuilt[name], value, rtol=0, atol=0)
