"""LOCAL state dicts with exactly torch's keys and values (issue 20 part 9), the layout records carried outside the
keys (the state dict's _metadata, a DCP side file), and the save identity and checksums of our saves (issue 18
part 4).

Oracles: torch's FSDP1 LOCAL state dict of the same model (keys, shards, values), torch's FSDP1 loading ours
strictly, the FULL state dict of the model that saved (conversions and loads, bit for bit), and files of a second
save (which must be refused).
"""

import contextlib
import os
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
from test_convert import assert_same
from test_optim_state import adam, load_model, model_sd, train
from torch.distributed._shard.sharded_tensor import ShardedTensor

import fsdp_legacy
from fsdp_legacy.cli.inspect_checkpoint import describe
from fsdp_legacy.convert import CheckpointError, convert_checkpoint
from fsdp_legacy.convert.loading import load_rank_file
from fsdp_legacy.convert.record import METADATA_KEY, records_in_metadata
from fsdp_legacy.convert.side_file import SIDE_FILE
from fsdp_legacy.state import dcp_checkpoint
from fsdp_utils import Config, build_ours, build_torch_fsdp, layout_keys
from harness import run_on_ranks

FULL, LOCAL = "FULL_STATE_DICT", "LOCAL_STATE_DICT"
CONFIGS = [Config("transformer", use_orig_params=uop) for uop in (False, True)]
IDS = ["flat", "uop"]


def _described(state: dict) -> dict:
    """Every entry of a LOCAL state dict as plain data: a ShardedTensor by its global size, every shard's metadata
    and the local shards' tensors."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, ShardedTensor):
            metadata = [[m.shard_offsets, m.shard_sizes, str(m.placement)] for m in value.metadata().shards_metadata]
            local = [[s.metadata.shard_offsets, s.tensor.clone()] for s in value.local_shards()]
            out[key] = ["sharded", list(value.size()), value.dtype, metadata, local]
        else:
            out[key] = ["tensor", value.clone()]
    return out


# --------------------------------------------------------------------------------------------------------------------
# LOCAL state dicts equal torch's


def _local_like_torch(config: Config) -> None:
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    for model in (ours, theirs):
        train(model, adam(model), config, range(2))
    mine = model_sd(ours, fsdp_legacy, LOCAL)
    expected = model_sd(theirs, torch_fsdp, LOCAL)
    assert list(mine) == list(expected), "exactly torch's keys, in torch's order"
    assert_same(_described(mine), _described(expected), "LOCAL state dict")
    records = records_in_metadata(mine._metadata, "ours")  # the layout rides in _metadata
    assert sorted(r.flat_key for r in records) == sorted(k for k in mine if k.endswith("_flat_param"))
    assert all(r.save_id for r in records)
    # torch's FSDP1 loads ours strictly as it loads its own (with use_orig_params it refuses its own too, reporting
    # the flat parameters as unexpected: the same error for ours), and then holds our values
    outcomes = []
    for state in (expected, mine):
        fresh = build_torch_fsdp(config, seed=1)
        try:
            load_model(fresh, torch_fsdp, LOCAL, state)
            outcomes.append(None)
        except RuntimeError as error:
            outcomes.append(str(error))
    assert outcomes[0] == outcomes[1], outcomes
    if outcomes[1] is None:
        assert_same(_described(model_sd(fresh, torch_fsdp, LOCAL)), _described(mine), "torch after loading ours")


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_local_state_dict_equals_torchs(config: Config) -> None:
    run_on_ranks(_local_like_torch, 2, config)


def test_local_state_dict_equals_torchs_at_4_ranks() -> None:
    run_on_ranks(_local_like_torch, 4, CONFIGS[1])


# --------------------------------------------------------------------------------------------------------------------
# Each carrier of the records converts; a plain dcp.save says what is missing; earlier versions' files still work


def _save(config: Config, path: str, how: str, steps: int = 2) -> dict:
    """Train, save the LOCAL model state dict `how` ("dcp": plain dcp.save; "ours": dcp_checkpoint.save; "old":
    plain dcp.save with the records as tensor keys, as earlier versions saved; "rank": a torch.save file per rank;
    "old-rank": per-rank files with the tensor keys);
    return the FULL model state dict."""
    _, model = build_ours(config)
    train(model, adam(model), config, range(steps))
    with layout_keys() if how.startswith("old") else contextlib.nullcontext():
        state = {"model": model_sd(model, fsdp_legacy, LOCAL)}
    if how == "ours":
        dcp_checkpoint.save(state, path)
    elif how in ("rank", "old-rank"):
        torch.save(state["model"], os.path.join(path, f"rank{dist.get_rank()}.pt"))
    else:
        dcp.save(state, checkpoint_id=path)
    return model_sd(model, fsdp_legacy, FULL)


def _load_dcp(config: Config, path: str, ours: bool) -> dict:
    """A fresh model (another initialisation) loads a LOCAL DCP checkpoint; its FULL state dict."""
    _, model = build_ours(config, seed=1)
    state = {"model": model_sd(model, fsdp_legacy, LOCAL)}
    if ours:
        dcp_checkpoint.load(state, path)
    else:
        dcp.load(state, checkpoint_id=path)
    load_model(model, fsdp_legacy, LOCAL, state["model"])
    return model_sd(model, fsdp_legacy, FULL)


def test_plain_dcp_save_needs_a_layout(tmp_path) -> None:
    """A plain dcp.save drops _metadata: the converter and inspect say what is missing and the fix; --layout-from
    (our DCP save of the same model at another world size) converts it exactly."""
    config = CONFIGS[0]  # (use_orig_params' per-rank views do not dcp.load at all: a LOCAL DCP limit, as torch's)
    plain, ours = str(tmp_path / "plain"), str(tmp_path / "ours")
    expected = run_on_ranks(_save, 2, config, plain, "dcp")[0]
    run_on_ranks(_save, 4, config, ours, "ours")
    with pytest.raises(CheckpointError, match=r"without a layout record.*plain dcp\.save.*--layout-from"):
        convert_checkpoint(plain, str(tmp_path / "full.pt"), to="full")
    assert not os.path.exists(tmp_path / "full.pt")
    assert any("have no layout record" in note for note in describe(plain, quiet=True)["notes"])
    convert_checkpoint(plain, str(tmp_path / "full.pt"), to="full", layout_from=ours)
    assert_same(torch.load(tmp_path / "full.pt", weights_only=True)["model"], expected, "with --layout-from")
    # and it still loads into a model with plain dcp.load, as torch's
    assert_same(run_on_ranks(_load_dcp, 2, config, plain, False)[0], expected, "plain dcp.load")


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_checkpoints_of_earlier_versions_still_load_and_convert(tmp_path, config: Config) -> None:
    """The records as `<flat key>_meta` tensors (earlier versions, and the opt-in): a fresh model's state dict (no
    such keys) loads them with dcp.load and our loader, and the converter reads the records from them. (With
    use_orig_params only the conversion: its per-rank views do not dcp.load, as with torch's LOCAL.)"""
    old = str(tmp_path / "old")
    expected = run_on_ranks(_save, 2, config, old, "old")[0]
    assert any(
        key.endswith("_flat_param_meta") for key in dcp.FileSystemReader(old).read_metadata().state_dict_metadata
    )
    loads = not config.use_orig_params
    if loads:
        assert_same(run_on_ranks(_load_dcp, 2, config, old, False)[0], expected, "dcp.load of an old checkpoint")
        assert_same(run_on_ranks(_load_dcp, 2, config, old, True)[0], expected, "our load of an old checkpoint")
    convert_checkpoint(old, str(tmp_path / "full.pt"), to="full")
    assert_same(torch.load(tmp_path / "full.pt", weights_only=True)["model"], expected, "old -> full")
    # back to LOCAL: the records now in the side file, and the result converts (and loads) like the original
    convert_checkpoint(str(tmp_path / "full.pt"), str(tmp_path / "local"), to="local")
    assert os.path.isfile(tmp_path / "local" / SIDE_FILE)
    convert_checkpoint(str(tmp_path / "local"), str(tmp_path / "again.pt"), to="full")
    assert_same(torch.load(tmp_path / "again.pt", weights_only=True)["model"], expected, "old -> full -> local -> full")
    if loads:
        loaded = run_on_ranks(_load_dcp, 2, config, str(tmp_path / "local"), True)[0]
        assert_same(loaded, expected, "old -> full -> local -> our load")


def _load_rank_file(config: Config, directory: str) -> dict:
    """A fresh model loads this rank's torch.save file (in memory, strict); its FULL state dict."""
    _, model = build_ours(config, seed=1)
    saved = torch.load(os.path.join(directory, f"rank{dist.get_rank()}.pt"), weights_only=False)
    load_model(model, fsdp_legacy, LOCAL, saved)
    return model_sd(model, fsdp_legacy, FULL)


def test_per_rank_files_of_earlier_versions_still_load_and_convert(tmp_path) -> None:
    config = CONFIGS[0]
    expected = run_on_ranks(_save, 2, config, str(tmp_path), "old-rank")[0]
    assert any(key.endswith("_flat_param_meta") for key in load_rank_file(str(tmp_path / "rank0.pt")))
    for loaded in run_on_ranks(_load_rank_file, 2, config, str(tmp_path)):
        assert_same(loaded, expected, "an old per-rank file loaded in memory")
    convert_checkpoint(str(tmp_path), str(tmp_path / "full.pt"), to="full")
    assert_same(torch.load(tmp_path / "full.pt", weights_only=True)["model"], expected, "old per-rank files -> full")


def test_per_rank_files_carry_the_records_in_metadata(tmp_path) -> None:
    """torch.save keeps _metadata and unpickling restores it: the files' keys are torch's, and they convert by
    themselves."""
    config = CONFIGS[0]
    expected = run_on_ranks(_save, 2, config, str(tmp_path), "rank")[0]
    stored = load_rank_file(str(tmp_path / "rank0.pt"))  # (ShardedTensors: weights_only refuses them)
    assert not any(key.endswith("_meta") for key in stored)
    assert any(METADATA_KEY in entry for entry in stored._metadata.values())
    convert_checkpoint(str(tmp_path), str(tmp_path / "full.pt"), to="full")
    assert_same(torch.load(tmp_path / "full.pt", weights_only=True)["model"], expected, "per-rank files -> full")


# --------------------------------------------------------------------------------------------------------------------
# Save identity: files of two saves are refused, naming them


def _two_saves(config: Config, directory: str, extra_calls: int) -> dict:
    """Two saves of per-rank files with a training step between (first/, second/); rank 0 calls state_dict()
    `extra_calls` more times than the others before each save and steps an optimizer of another model as often
    (neither may change anything). The FULL state dicts of both."""
    _, model = build_ours(config)
    optim = adam(model)
    probe = torch.nn.Linear(2, 2)
    probe_optim = torch.optim.SGD(probe.parameters(), lr=0.1)
    expected = {}
    for name, steps in (("first", range(1)), ("second", range(1, 2))):
        train(model, optim, config, steps)
        for _ in range(extra_calls if dist.get_rank() == 0 else 0):
            model_sd(model, fsdp_legacy, LOCAL)
            probe(torch.ones(2)).sum().backward()
            probe_optim.step()
        os.makedirs(os.path.join(directory, name), exist_ok=True)
        torch.save(model_sd(model, fsdp_legacy, LOCAL), os.path.join(directory, name, f"rank{dist.get_rank()}.pt"))
        expected[name] = model_sd(model, fsdp_legacy, FULL)
    return expected


@pytest.mark.parametrize("world_size", [2, 4])
def test_per_rank_files_of_two_saves_are_refused(tmp_path, world_size: int) -> None:
    config = CONFIGS[1]
    expected = run_on_ranks(_two_saves, world_size, config, str(tmp_path), 3)[0]
    for name in ("first", "second"):  # each save by itself converts bit for bit, whatever rank 0 called in between
        convert_checkpoint(str(tmp_path / name), str(tmp_path / f"{name}.pt"), to="full")
        assert_same(torch.load(tmp_path / f"{name}.pt", weights_only=True)["model"], expected[name], name)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for rank in range(world_size):
        shutil.copy(tmp_path / ("second" if rank == 1 else "first") / f"rank{rank}.pt", mixed / f"rank{rank}.pt")
    message = r"mixes the files of different saves \(.*rank0\.pt.*: save .*; .*rank1\.pt: save .*\)"
    with pytest.raises(CheckpointError, match=message):
        convert_checkpoint(str(mixed), str(tmp_path / "mixed.pt"), to="full")
    with pytest.raises(CheckpointError, match=message):
        describe(str(mixed), quiet=True)


def _save_twice_dcp(config: Config, directory: str) -> dict:
    """Two saves through our DCP path (a training step between); the FULL state dict of the first."""
    _, model = build_ours(config)
    optim = adam(model)
    train(model, optim, config, range(1))
    dcp_checkpoint.save({"model": model_sd(model, fsdp_legacy, LOCAL)}, os.path.join(directory, "first"))
    expected = model_sd(model, fsdp_legacy, FULL)
    train(model, optim, config, range(1, 2))
    dcp_checkpoint.save({"model": model_sd(model, fsdp_legacy, LOCAL)}, os.path.join(directory, "second"))
    return expected


def _refused_load(config: Config, path: str) -> str:
    """Our loader's error on this rank; the model must be untouched."""
    _, model = build_ours(config, seed=1)
    before = model_sd(model, fsdp_legacy, FULL)
    state = {"model": model_sd(model, fsdp_legacy, LOCAL)}
    with pytest.raises(CheckpointError) as error:
        dcp_checkpoint.load(state, path)
    assert_same(model_sd(model, fsdp_legacy, FULL), before, "nothing loaded")
    return str(error.value)


def test_dcp_saves_carry_identity_and_checksums(tmp_path) -> None:
    config = CONFIGS[0]
    expected = run_on_ranks(_save_twice_dcp, 2, config, str(tmp_path))[0]
    first = tmp_path / "first"
    data = sorted(name for name in os.listdir(first) if name.endswith(".distcp"))
    assert len(data) == 2 and (first / SIDE_FILE).is_file()
    # the same save loads bit for bit
    for loaded in run_on_ranks(_load_dcp, 2, config, str(first), True):
        assert_same(loaded, expected, "our load of our save")

    # into a model wrapped otherwise: refused on every rank before DCP touches it, saying what to do
    other = Config(config.model, policy="none", use_orig_params=config.use_orig_params)
    for message in run_on_ranks(_refused_load, 2, other, str(first)):
        assert "was saved with another flat-parameter layout" in message and "--layout-from" in message, message

    # one rank's file from the other save: refused on every rank, naming it; the converter refuses it too
    mixed = tmp_path / "mixed"
    shutil.copytree(first, mixed)
    shutil.copy(tmp_path / "second" / data[1], mixed / data[1])
    for message in run_on_ranks(_refused_load, 2, config, str(mixed)):
        assert "mixes the files of different saves" in message and data[1] in message, message
    with pytest.raises(CheckpointError, match=rf"mixes the files of different saves.*{data[1]}"):
        convert_checkpoint(str(mixed), str(tmp_path / "mixed.pt"), to="full")
    with pytest.raises(CheckpointError, match=rf"mixes the files of different saves.*{data[1]}"):
        describe(str(mixed), quiet=True)

    # a flipped byte in the middle of a data file: refused on every rank by the CRC-32, naming the file
    flipped = tmp_path / "flipped"
    shutil.copytree(first, flipped)
    with open(flipped / data[0], "r+b") as file:
        size = file.seek(0, os.SEEK_END)
        file.seek(size // 2)
        byte = file.read(1)
        file.seek(size // 2)
        file.write(bytes([byte[0] ^ 0x10]))
    messages = run_on_ranks(_refused_load, 2, config, str(flipped))
    assert messages[0] == messages[1] and f"{data[0]} is corrupted" in messages[0] and "CRC-32" in messages[0]
    with pytest.raises(CheckpointError, match=rf"{data[0]}.*(corrupted|CRC-32)"):
        convert_checkpoint(str(flipped), str(tmp_path / "flipped.pt"), to="full")


# --------------------------------------------------------------------------------------------------------------------
# In-memory loads check the records in _metadata, as those of the keys


def _metadata_records_are_checked(config: Config) -> None:
    _, model = build_ours(config)
    sd = model_sd(model, fsdp_legacy, LOCAL)
    load_model(model, fsdp_legacy, LOCAL, sd)  # its own records are accepted (strict)
    nested = next(key for key, entry in sd._metadata.items() if key and METADATA_KEY in entry)  # the block unit's
    assert METADATA_KEY in sd._metadata[""], "the root unit's records, in its own entry"
    for entry, message in (
        (sd._metadata[nested][METADATA_KEY], r"_flat_param: the checkpoint's flat parameter holds \[fc1\.weight"),
        (["{not json"], r"_flat_param \(its layout record in _metadata\): the flat-parameter layout record is not"),
    ):
        changed = type(sd)(sd)
        changed._metadata = type(sd._metadata)((k, dict(v)) for k, v in sd._metadata.items())
        changed._metadata[""][METADATA_KEY] = entry
        with pytest.raises(RuntimeError, match=message):
            load_model(model, fsdp_legacy, LOCAL, changed)


def test_in_memory_loads_check_the_records_in_metadata() -> None:
    run_on_ranks(_metadata_records_are_checked, 2, Config("net", use_orig_params=True))
