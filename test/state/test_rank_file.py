"""load_rank_state: one rank's torch.save file of a LOCAL or SHARDED state dict read back without running pickled code,
checked against what torch.load(weights_only=False) gives for the same file (ours and torch's FSDP1), and loaded into
a fresh model and optimizer that then train on exactly as the saved one does."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import StateDictType
from fsdp_legacy.checkpoint import load_rank_state
from fsdp_legacy.convert import CheckpointError
from fsdp_utils import Config, batch, build_ours, build_torch_fsdp, full_params, loss_of, train
from harness import run_on_ranks

KINDS = {"LOCAL": StateDictType.LOCAL_STATE_DICT, "SHARDED": StateDictType.SHARDED_STATE_DICT}


def _same(loaded, pickled, where: str = "") -> None:
    """The tree load_rank_state gave equals the one the unrestricted torch.load gave, ShardedTensors shard by shard."""
    assert type(loaded) is type(pickled), where
    if isinstance(pickled, ShardedTensor):
        assert loaded.size() == pickled.size() and loaded.dtype == pickled.dtype, where
        mine, theirs = loaded.local_shards(), pickled.local_shards()
        assert [s.metadata.shard_offsets for s in mine] == [s.metadata.shard_offsets for s in theirs], where
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a.tensor, b.tensor), where
        assert loaded.metadata().shards_metadata == pickled.metadata().shards_metadata, where
    elif isinstance(pickled, torch.Tensor):
        assert torch.equal(loaded, pickled), where
    elif isinstance(pickled, dict):
        assert list(loaded) == list(pickled), where
        for key in pickled:
            _same(loaded[key], pickled[key], f"{where}.{key}")
    elif isinstance(pickled, list | tuple):
        assert len(loaded) == len(pickled), where
        for i, (a, b) in enumerate(zip(loaded, pickled, strict=True)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert loaded == pickled, where


def _state(model, opt, kind: str, fsdp_class) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp_class.state_dict_type(model, KINDS[kind]):
            return {"model": model.state_dict(), "optim": fsdp_class.optim_state_dict(model, opt)}


def _load(model, opt, state: dict, kind: str, fsdp_class) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp_class.state_dict_type(model, KINDS[kind]):
            model.load_state_dict(state["model"])
            opt.load_state_dict(fsdp_class.optim_state_dict_to_load(model, opt, state["optim"]))


def _round_trip(directory: str, kind: str, implementation: str) -> None:
    config = Config("net", steps=2)
    if implementation == "ours":
        fsdp_class, build = FSDP, lambda seed: build_ours(config, seed)[1]
    else:
        import torch.distributed.fsdp as tfsdp

        fsdp_class, build = tfsdp.FullyShardedDataParallel, lambda seed: build_torch_fsdp(config, seed)
    model = build(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):
        loss_of(model(batch(config, step))).backward()
        opt.step()
        opt.zero_grad()
    path = os.path.join(directory, f"{kind}-{implementation}-rank{dist.get_rank()}.pt")
    torch.save(_state(model, opt, kind, fsdp_class), path)

    loaded = load_rank_state(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same(loaded, torch.load(path, weights_only=False))

    fresh = build(1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    loss_of(fresh(batch(config, 0))).backward()  # Adam's state exists, to be overwritten
    fresh_opt.step()
    fresh_opt.zero_grad()
    _load(fresh, fresh_opt, loaded, kind, fsdp_class)
    for trained, opt_of in ((model, opt), (fresh, fresh_opt)):  # both go on by the same step
        loss_of(trained(batch(config, 5))).backward()
        opt_of.step()
        opt_of.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, actual = full_params(model), full_params(fresh)
    assert list(actual) == list(expected)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name
    dist.barrier()


@pytest.mark.parametrize("implementation", ["ours", "torch"])
@pytest.mark.parametrize("kind", ["LOCAL", "SHARDED"])
def test_rank_file_round_trip(tmp_path, kind: str, implementation: str) -> None:
    run_on_ranks(_round_trip, 2, str(tmp_path), kind, implementation)


def _other_rank(directory: str) -> str:
    config = Config("net", steps=1)
    model = build_ours(config)[1]
    train(model, config)
    rank = dist.get_rank()
    torch.save(_state(model, torch.optim.SGD(model.parameters(), lr=0.1), "LOCAL", FSDP), f"{directory}/r{rank}.pt")
    dist.barrier()
    try:
        load_rank_state(f"{directory}/r{1 - rank}.pt")
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_a_file_of_another_rank_is_refused(tmp_path) -> None:
    messages = run_on_ranks(_other_rank, 2, str(tmp_path))
    for rank, message in enumerate(messages):
        assert f"saved by rank {1 - rank} of 2; this is rank {rank} of 2" in message, message
        assert "fsdp-legacy convert" in message
