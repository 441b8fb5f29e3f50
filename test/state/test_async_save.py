"""Saves in the background (fsdp_legacy.checkpoint.save_full_model_async, dcp_checkpoint.async_save): the files hold
the state of the moment of the call, bit for bit what the synchronous save of that moment writes, while training
goes on (its collectives beside the save's own group); a failure is raised by wait() on every rank and leaves the
previous checkpoint; one save is in flight at a time.

The oracles: the synchronous save of the same step (save_full_model, itself checked against torch's FSDP1
FULL_STATE_DICT in test_hf_checkpoint.py; dcp_checkpoint.save) and the byte count of the local shards.
"""

import contextlib
import os
import signal
import time
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import harness
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import StateDictType, dcp_checkpoint
from fsdp_legacy.checkpoint import latest, save_full_model, save_full_model_async
from fsdp_legacy.state import async_save, hf_checkpoint
from fsdp_utils import Config, batch, build_ours, loss_of
from harness import RankError, run_on_ranks


def _slowly(seconds: float):
    """_write_piece made slow, so that the training steps after the call run while the save writes."""
    write = hf_checkpoint._write_piece

    def slow(*args) -> None:
        time.sleep(seconds)
        write(*args)

    return mock.patch.object(hf_checkpoint, "_write_piece", slow)


def _steps(model, opt, config: Config, first: int, count: int) -> None:
    for step in range(first, first + count):
        loss_of(model(batch(config, step))).backward()
        opt.step()
        opt.zero_grad()


def _read(directory: str) -> dict[str, torch.Tensor]:
    return {k: v for name in sorted(os.listdir(directory)) for k, v in load_file(os.path.join(directory, name)).items()}


def _state_now(model, opt, kind: str = "SHARDED") -> dict:
    """The model's and the optimizer's state dicts of `kind` (SHARDED or LOCAL), as the synchronous saves take them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(model, StateDictType[f"{kind}_STATE_DICT"]):
            return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}


def _assert_same_sharded(actual, expected, where: str = "") -> None:
    """Equal trees, ShardedTensors equal in their global metadata and local shards."""
    if isinstance(expected, dict):
        assert sorted(actual, key=str) == sorted(expected, key=str), f"{where}: {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            _assert_same_sharded(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where
        for i, (a, b) in enumerate(zip(actual, expected, strict=True)):
            _assert_same_sharded(a, b, f"{where}[{i}]")
    elif hasattr(expected, "local_shards"):
        assert hasattr(actual, "local_shards"), where
        mine, theirs = actual.metadata(), expected.metadata()
        assert mine.size == theirs.size and mine.tensor_properties.dtype == theirs.tensor_properties.dtype, where
        shape = [(m.shard_offsets, m.shard_sizes) for m in mine.shards_metadata]
        assert shape == [(m.shard_offsets, m.shard_sizes) for m in theirs.shards_metadata], where
        for a, b in zip(actual.local_shards(), expected.local_shards(), strict=True):
            assert a.metadata.shard_offsets == b.metadata.shard_offsets and torch.equal(a.tensor, b.tensor), where
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert torch.equal(actual.cpu(), expected.cpu()), where
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _full_async(directory: str, model_name: str) -> tuple[float, int, int]:
    config = Config(model_name)
    _, model = build_ours(config)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, config, 0, 2)
    save_full_model(model, f"{directory}/sync")
    with _slowly(0.01):
        pending = save_full_model_async(model, f"{directory}/async")
        assert not pending.done(), "the call returned before the files were written"
        _steps(model, opt, config, 2, 3)  # the parameters change while the save runs
        assert pending.wait() is None
    save_full_model(model, f"{directory}/later")
    shards = sum(h.local_shard.nbytes for h in model._all_handles)
    whole = sum(b.nbytes for b in model.buffers() if not b.is_meta) if dist.get_rank() == 0 else 0
    return pending.stall_s, pending.host_bytes, shards + whole


@pytest.mark.parametrize("model_name", ["net", "transformer"])
def test_full_weights_saved_in_the_background_are_the_moment_of_the_call(tmp_path, model_name: str) -> None:
    results = run_on_ranks(_full_async, 2, str(tmp_path), model_name)
    sync, done, later = (_read(str(tmp_path / name)) for name in ("sync", "async", "later"))
    assert list(done) == list(sync)
    for key in sync:
        assert torch.equal(done[key], sync[key]), key
    assert any(not torch.equal(later[k], sync[k]) for k in sync), "training went on during the save"
    for _, host_bytes, expected in results:
        assert host_bytes == expected, "the copy held: this rank's local shards (rank 0: and the buffers)"


def _dcp_async(directory: str, kind: str) -> int:
    config = Config("transformer")
    _, model = build_ours(config)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, config, 0, 2)
    dcp_checkpoint.save(_state_now(model, opt, kind), f"{directory}/step_000002.sync")
    pending = dcp_checkpoint.async_save(_state_now(model, opt, kind), f"{directory}/step_000002.async")
    _steps(model, opt, config, 2, 3)
    metadata = pending.wait()
    assert metadata is not None and metadata.state_dict_metadata
    found = latest(directory)
    assert found is not None and not found.skipped, "both directories complete, with their side files"

    loaded = {}
    for name in ("sync", "async"):
        target = _state_now(model, opt, kind)
        dcp_checkpoint.load(target, f"{directory}/step_000002.{name}")
        loaded[name] = target
    _assert_same_sharded(loaded["async"], loaded["sync"])
    return 1


@pytest.mark.parametrize("kind", ["SHARDED", "LOCAL"])
def test_dcp_saved_in_the_background_equals_the_synchronous_save(tmp_path, kind: str) -> None:
    run_on_ranks(_dcp_async, 2, str(tmp_path), kind)


def _failing(directory: str) -> list[str]:
    config = Config("net")
    _, model = build_ours(config)
    save_full_model(model, f"{directory}/out")
    before = sorted(os.listdir(f"{directory}/out"))
    messages = []

    def broken(*_args) -> None:
        raise OSError(28, "No space left on device")

    with mock.patch.object(
        hf_checkpoint, "_write_piece", broken if dist.get_rank() == 0 else hf_checkpoint._write_piece
    ):
        pending = save_full_model_async(model, f"{directory}/out")
        try:
            pending.wait()
        except OSError as error:
            messages.append(str(error))
        save_full_model_async(model, f"{directory}/out")  # not waited for: the next call raises its error
        try:
            save_full_model_async(model, f"{directory}/other")
        except OSError as error:
            messages.append(str(error))
    assert sorted(os.listdir(f"{directory}/out")) == before, "the previous directory is in place"
    save_full_model_async(model, f"{directory}/other").wait()  # the failure has been raised once: this one runs
    assert os.path.isdir(f"{directory}/other")
    return messages


def test_a_failed_background_save_raises_on_every_rank(tmp_path) -> None:
    messages = run_on_ranks(_failing, 2, str(tmp_path))
    assert messages[0] == messages[1] and len(messages[0]) == 2, messages
    for message in messages[0]:
        assert "No space left on device" in message and "Nothing was replaced" in message, message


# --------------------------------------------------------------------------------------------------------------------
# A rank killed while a save runs in the background


def _killed_in_the_background(root: str, fmt: str, victim: int) -> None:
    """A complete save at step 2, then a background save at step 4 during which `victim` is SIGKILLed from the save's
    own thread (full weights: at rank 0's first write or the victim's first send; DCP: after DCP's files, before the
    side file); the survivor raises at wait()."""
    from fsdp_legacy.state import async_save as async_module
    from fsdp_legacy.state import peers

    config = Config("transformer")
    _, model = build_ours(config)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, config, 0, 2)
    if fmt == "full":
        save_full_model(model, f"{root}/export")
    else:
        dcp_checkpoint.save(_state_now(model, opt), f"{root}/step_000002.dcp")
    _steps(model, opt, config, 2, 2)

    def die(original):
        def dying(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        return dying

    me = dist.get_rank()
    with contextlib.ExitStack() as patches:
        if me == victim and fmt == "full":
            target = (hf_checkpoint, "_write_piece") if me == 0 else (peers.Peers, "send")
            patches.enter_context(mock.patch.object(*target, die(getattr(*target))))
        elif me == victim:
            patches.enter_context(mock.patch.object(async_module, "finish_save", die(async_module.finish_save)))
        if fmt == "full":
            pending = save_full_model_async(model, f"{root}/export")
        else:
            pending = dcp_checkpoint.async_save(_state_now(model, opt), f"{root}/step_000004.dcp")
        pending.wait()  # (training's own collectives would fail too, with gloo's error, once a rank is gone)


@pytest.mark.heavy  # ranks are killed: CI runs it after the README's tests (pytest -m heavy)
@pytest.mark.parametrize("fmt,victim", [("full", 0), ("full", 1), ("dcp", 1)])
def test_a_rank_killed_during_a_background_save_leaves_the_last_good_checkpoint(
    tmp_path, monkeypatch, fmt: str, victim: int
) -> None:
    monkeypatch.setattr(harness, "FAILURE_GRACE", 90.0)  # wait for every survivor's answer
    root = str(tmp_path)
    with pytest.raises(RankError) as caught:
        run_on_ranks(_killed_in_the_background, 2, root, fmt, victim, timeout=90.0)
    lines = {rank: text.strip().splitlines()[-1] for rank, text in caught.value.errors.items()}
    assert lines.pop(victim).startswith("process died")
    survivor = lines.popitem()[1]
    if fmt == "full":
        assert f"save_full_model could not save {root}/export: rank {victim} stopped answering" in survivor, survivor
        assert load_file(f"{root}/export/model.safetensors"), "the step-2 export is in place"
        assert sorted(os.listdir(root))[-1] == "export"
    else:
        assert "RuntimeError" in survivor, survivor
        found = latest(root)
        assert found is not None and found.path == f"{root}/step_000002.dcp", found
        assert [os.path.basename(s.path) for s in found.skipped] == ["step_000004.dcp"]
        assert "unfinished" in found.skipped[0].reason, found.skipped[0].reason


# --------------------------------------------------------------------------------------------------------------------
# SHARDED state dicts built in the background


def _built_in_the_background(config: Config) -> bool:
    from fsdp_legacy.state import background_state
    from fsdp_legacy.state.async_save import side_group

    _, model = build_ours(config)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, config, 0, 2)
    expected = _state_now(model, opt)
    captured = background_state.capture(model, opt, lambda t: t.clone())
    if captured is None:
        return False
    _steps(model, opt, config, 2, 1)  # training moves on; the copies do not
    model_state, optim_state = background_state.build(captured, side_group())
    _assert_same_sharded({"model": model_state, "optim": optim_state}, expected)
    return True


@pytest.mark.parametrize(
    "config",
    [
        Config("transformer"),
        Config("transformer", mixed_precision=("bfloat16",) * 3),
        Config("net", use_orig_params=True),
        Config("frozen", "FULL_SHARD", "block", True),
        Config("net", strategy="NO_SHARD"),
    ],
    ids=["transformer", "transformer_bf16", "net_uop", "frozen_uop", "net_no_shard"],
)
def test_sharded_dicts_built_in_the_background_equal_the_synchronous_ones(config: Config) -> None:
    built = run_on_ranks(_built_in_the_background, 2, config)
    assert built == [config.strategy != "NO_SHARD"] * 2, "NO_SHARD units build in the call instead"


def _sharded_async(directory: str, config: Config) -> float:
    _, model = build_ours(config)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, config, 0, 2)
    dcp_checkpoint.save(_state_now(model, opt), f"{directory}/sync")
    pending = dcp_checkpoint.async_save_sharded(model, opt, f"{directory}/async")
    _steps(model, opt, config, 2, 3)
    pending.wait()
    loaded = {}
    for name in ("sync", "async"):
        target = _state_now(model, opt)
        dcp_checkpoint.load(target, f"{directory}/{name}")
        loaded[name] = target
    _assert_same_sharded(loaded["async"], loaded["sync"])
    return pending.host_bytes


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_sharded_save_in_the_background_loads_as_the_synchronous_one(tmp_path, strategy: str) -> None:
    held = run_on_ranks(_sharded_async, 2, str(tmp_path / strategy), Config("transformer", strategy=strategy))
    assert all(h > 0 for h in held)


def _thread_nices() -> dict[int, int]:
    nices = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as stat:
            nices[int(tid)] = int(stat.read().rsplit(")", 1)[1].split()[16])
    return nices


def _side_group_threads() -> dict[str, list[int]]:
    before = _thread_nices()
    group = async_save.made_at_background_priority(lambda: dist.new_group(backend="gloo"))
    dist.barrier(group=group)
    started = {tid: nice for tid, nice in _thread_nices().items() if tid not in before}
    return {"started": sorted(started.values()), "training": [os.getpriority(os.PRIO_PROCESS, 0)]}


def _side_group_after_it_was_destroyed() -> bool:
    group = async_save.side_group()
    assert async_save.side_group() is group  # made once
    dist.destroy_process_group(group)
    again = async_save.side_group()
    dist.barrier(group=again)  # a live group: a collective over it completes
    return again is not group


def test_a_destroyed_side_group_is_made_anew() -> None:
    """A program (or a harness between jobs) that destroys its subgroups gets a new side group at the next background
    save, not the destroyed one."""
    assert run_on_ranks(_side_group_after_it_was_destroyed, 2) == [True, True]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice values are Linux's")
def test_the_save_groups_threads_run_below_training() -> None:
    """gloo starts its worker and transport threads when a group is made: made for the background saves, they take
    the saves' nice value (Linux threads inherit their maker's), so the save's collectives yield the cores to
    training as its writing does (they ran at training's priority before: steps during a DCP save were 1.4x)."""
    for observed in run_on_ranks(_side_group_threads, 2):
        assert observed["started"] and set(observed["started"]) == {async_save.BACKGROUND_NICE}
        assert observed["training"] == [0]
