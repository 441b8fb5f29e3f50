"""Offline checkpoint conversion (fsdp_legacy.convert, `fsdp-legacy convert`): LOCAL (flat) <-> DCP in FSDP2's
layout <-> one full torch.save file, model and optimizer, run in the pytest process with no process group.

Oracles: the FULL model and optimizer state dicts of the model that saved the checkpoint (exact equality), torch's
FSDP1 for a checkpoint it saved, FSDP2 loading the converted checkpoint, and our model loading the converted LOCAL
checkpoint at another world size.
"""

import os
import subprocess
import weakref
import zipfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
from test_optim_state import adam, load_into_fsdp2, load_model, model_sd, osd, to_load, train
from torch.distributed.checkpoint import DefaultLoadPlanner

import fsdp_legacy
from cli_runner import run_cli
from fsdp_legacy.convert import CheckpointError, convert_checkpoint, open_checkpoint
from fsdp_legacy.convert.checkpoint import Checkpoint, Path
from fsdp_legacy.convert.dcp_files import write_dcp
from fsdp_legacy.convert.torch_file import write_torch_file
from fsdp_legacy.state import dcp_checkpoint
from fsdp_utils import MODELS, Config, build_ours, build_torch_fsdp
from harness import run_on_ranks

FULL, LOCAL = "FULL_STATE_DICT", "LOCAL_STATE_DICT"


# --------------------------------------------------------------------------------------------------------------------
# On the ranks


def _save_local(config: Config, path: str, impl: str = "ours", plain: bool = False) -> dict:
    """Train with Adam (ours or torch's FSDP1), save the LOCAL model and optimizer state dicts with DCP (ours through
    fsdp_legacy.dcp_checkpoint unless `plain`); return the FULL ones, the oracle."""
    lib = fsdp_legacy if impl == "ours" else torch_fsdp
    model = build_ours(config)[1] if impl == "ours" else build_torch_fsdp(config)
    optim = adam(model)
    train(model, optim, config, range(2))
    state = {"model": model_sd(model, lib, LOCAL), "optim": osd(model, optim, lib, LOCAL)}
    if impl == "ours" and not plain:  # through our path: the layout records go into the directory's side file
        dcp_checkpoint.save(state, path)
    else:
        dcp.save(state, checkpoint_id=path)
    # torch's default offload_to_cpu=True returns wrong values on CPU (FACTS CPU bug #2)
    return {
        "model": model_sd(model, lib, FULL),
        "optim": osd(model, optim, lib, FULL, lib.FullOptimStateDictConfig(offload_to_cpu=False)),
    }


def _load_local(config: Config, path: str) -> dict:
    """Our model at this world size loads a LOCAL checkpoint with dcp.load (use_orig_params' named per-rank views are
    not in converted checkpoints: allow_partial_load leaves them, they alias the flat shard anyway)."""
    _, model = build_ours(config, seed=1)
    optim = adam(model)
    train(model, optim, config, range(1))  # the optimizer needs its state before DCP can load into it
    state = {"model": model_sd(model, fsdp_legacy, LOCAL), "optim": osd(model, optim, fsdp_legacy, LOCAL)}
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    load_model(model, fsdp_legacy, LOCAL, state["model"])
    optim.load_state_dict(to_load(model, optim, fsdp_legacy, LOCAL, state["optim"]))
    return {"model": model_sd(model, fsdp_legacy, FULL), "optim": osd(model, optim, fsdp_legacy, FULL)}


def _fsdp2_model(config: Config) -> torch.nn.Module:
    """A fully_shard model: the blocks, then the root."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    model = MODELS[config.model][0]()
    for module in model.modules():
        if isinstance(module, MODELS[config.model][2]["block"]):
            fully_shard(module)
    fully_shard(model)
    return model


def _fsdp2_load(config: Config, path: str) -> dict:
    """A fully_shard model and Adam load a DCP checkpoint with torch's own helpers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    model = _fsdp2_model(config)
    optim = adam(model)
    load_into_fsdp2(model, optim, path)
    full = StateDictOptions(full_state_dict=True)
    return {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, optim, options=full),
    }


def _save_rank_files(config: Config, directory: str, impl: str = "ours", with_optim: bool = False) -> dict:
    """Train (ours or torch's FSDP1), then the common FSDP1 way of saving LOCAL checkpoints: one torch.save file of
    the LOCAL model state dict (with `with_optim`: {"model": ..., "optim": LOCAL optim_state_dict}) per rank, named
    here against the rank so that names cannot be what identifies it; return the FULL model state dict (and FULL
    optimizer state dict), the oracle."""
    lib = fsdp_legacy if impl == "ours" else torch_fsdp
    model = build_ours(config)[1] if impl == "ours" else build_torch_fsdp(config)
    optim = adam(model)
    train(model, optim, config, range(2))
    name = f"shard-{dist.get_world_size() - 1 - dist.get_rank()}.pt"
    if with_optim:
        torch.save(
            {"model": model_sd(model, lib, LOCAL), "optim": osd(model, optim, lib, LOCAL)},
            os.path.join(directory, name),
        )
        return {"model": model_sd(model, lib, FULL), "optim": osd(model, optim, lib, FULL)}
    torch.save(model_sd(model, lib, LOCAL), os.path.join(directory, name))
    return model_sd(model, lib, FULL)


def _fsdp2_load_model(config: Config, path: str) -> dict:
    """A fully_shard model loads the model section of a DCP checkpoint; its FULL state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model = _fsdp2_model(config)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


# --------------------------------------------------------------------------------------------------------------------
# Helpers (in the pytest process)


def assert_same(actual: Any, expected: Any, what: str) -> None:
    """Exactly equal nested state dicts: same keys, and tensors equal bit for bit with the same dtype."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (
            f"{what}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        )
        for key in expected:
            assert_same(actual[key], expected[key], f"{what}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), what
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{what}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, what
        assert torch.equal(actual, expected), what
    else:
        assert actual == expected, what


def as_tree(path: str) -> dict:
    """Every leaf of a stored checkpoint, read with our reader (no process group), nested again."""
    from fsdp_legacy.convert.checkpoint import TensorMeta, unflatten

    with open_checkpoint(path) as checkpoint:
        return unflatten(
            {p: checkpoint.read(p) if isinstance(v, TensorMeta) else v for p, v in checkpoint.leaves.items()}
        )


def without_layout(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k != "layout"}


CONFIGS = [Config("transformer", use_orig_params=uop) for uop in (False, True)]
IDS = ["flat", "uop"]


# --------------------------------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.heavy  # four conversions of a checkpoint, about 25 s: CI runs it after the README's tests
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_round_trip_local_dcp_full_local(tmp_path, config: Config) -> None:
    """flat (W=2) -> DCP -> full -> flat (W=2) reproduces every tensor of the original checkpoint, flat parameters
    and their records included; -> flat (W=4) loads into our model at 4 ranks, model and Adam state exact."""
    local, sharded, full = str(tmp_path / "local"), str(tmp_path / "dcp"), str(tmp_path / "full.pt")
    expected = run_on_ranks(_save_local, 2, config, local)[0]
    assert not dist.is_initialized(), "the conversion runs without a process group"
    reports = [
        convert_checkpoint(local, sharded, to="dcp"),
        convert_checkpoint(sharded, full, to="full"),
        convert_checkpoint(full, str(tmp_path / "local2"), to="local"),
        convert_checkpoint(full, str(tmp_path / "local4"), to="local", world_size=4),
    ]
    assert [(r.source_format, r.target_format) for r in reports] == [
        ("local", "dcp"),
        ("dcp", "full"),
        ("full", "local"),
        ("full", "local"),
    ]
    assert all(r.verified == r.tensors > 0 for r in reports)

    stored = torch.load(full, weights_only=True)  # what users load: original FQNs, FULL formats
    assert_same(stored["model"], expected["model"], "full file model")
    assert_same(stored["optim"], expected["optim"], "full file optimizer")
    assert zipfile.ZipFile(full).testzip() is None, "the CRC-32 of every record is right"
    assert_same(without_layout(as_tree(sharded)), {"model": expected["model"], "optim": expected["optim"]}, "DCP")

    original, again = as_tree(local), as_tree(str(tmp_path / "local2"))
    flat_keys = [k for k in original["model"] if k.endswith(("_flat_param", "_flat_param_meta"))]
    assert len(flat_keys) == 4  # root + 3 blocks; their records are outside the keys (the side file)
    with open_checkpoint(local) as first, open_checkpoint(str(tmp_path / "local2")) as second:
        assert len(first.side_records) == 4 and first.side_records == second.side_records
    assert_same(again["optim"], original["optim"], "optimizer after the round trip")
    for key, value in again["model"].items():
        assert_same(value, original["model"][key], f"model.{key} after the round trip")
    if not config.use_orig_params:  # with use_orig_params DCP kept one rank's per-rank views too: those are dropped
        assert set(again["model"]) == set(original["model"])

    for loaded in run_on_ranks(_load_local, 4, config, str(tmp_path / "local4")):
        assert_same(loaded["model"], expected["model"], "model at 4 ranks")
        assert_same(loaded["optim"], expected["optim"], "optimizer at 4 ranks")


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_local_checkpoint_loads_into_fsdp2(tmp_path, config: Config, world_size: int) -> None:
    """Our LOCAL checkpoint saved at 2 ranks, converted to DCP, loads into fully_shard models at 1 and 2 ranks:
    parameters and Adam state equal the saving model's."""
    local, sharded = str(tmp_path / "local"), str(tmp_path / "dcp")
    expected = run_on_ranks(_save_local, 2, config, local)[0]
    convert_checkpoint(local, sharded, to="dcp")
    for loaded in run_on_ranks(_fsdp2_load, world_size, config, sharded):
        assert_same(loaded["model"], expected["model"], f"FSDP2 model at {world_size} ranks")
        assert_same(loaded["optim"]["state"], expected["optim"]["state"], f"FSDP2 Adam state at {world_size} ranks")
        assert loaded["optim"]["param_groups"][0]["lr"] == expected["optim"]["param_groups"][0]["lr"]


def test_torch_fsdp1_local_checkpoint_converts_with_an_inferred_or_a_given_layout(tmp_path) -> None:
    """torch's FSDP1 writes no layout record: the layout is inferred from the optimizer state beside the model
    (test_inferred_layout.py), or taken from our checkpoint of the same model (saved at another world size); both
    convert to torch's own FULL state dicts."""
    config = Config("transformer", use_orig_params=True)
    theirs, ours = str(tmp_path / "torch_local"), str(tmp_path / "ours_local")
    expected = run_on_ranks(_save_local, 2, config, theirs, "torch")[0]
    run_on_ranks(_save_local, 4, config, ours)
    for name, layout_from in (("inferred", None), ("given", ours)):
        convert_checkpoint(theirs, str(tmp_path / f"{name}.pt"), to="full", layout_from=layout_from)
        stored = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert_same(stored["model"], expected["model"], f"torch FSDP1 LOCAL -> full, model, {name} layout")
        assert_same(stored["optim"], expected["optim"], f"torch FSDP1 LOCAL -> full, optimizer, {name} layout")


def test_torch_fsdp1_per_rank_local_files(tmp_path) -> None:
    """torch's FSDP1 saves one torch.save file of its LOCAL state dict per rank (ShardedTensors, no layout records):
    with the layout of our LOCAL checkpoint of the same model and wrapping (saved at another world size), the
    directory converts to exactly torch's FULL model state dict, with no process group; without it, the error says
    so."""
    config = Config("transformer", use_orig_params=True)
    theirs, ours = tmp_path / "torch_ranks", str(tmp_path / "ours_local")
    theirs.mkdir()
    expected = run_on_ranks(_save_rank_files, 2, config, str(theirs), "torch")[0]
    run_on_ranks(_save_local, 4, config, ours)
    assert not dist.is_initialized()
    with pytest.raises(
        CheckpointError,
        match=r"model\.blocks\.0\._flat_param in .*torch_ranks is a flat parameter "
        r"without a layout record.*--layout-from",
    ):
        convert_checkpoint(str(theirs), str(tmp_path / "full.pt"), to="full")
    report = convert_checkpoint(str(theirs), str(tmp_path / "full.pt"), to="full", layout_from=ours)
    assert report.source_format == "local" and report.verified == report.tensors > 0
    stored = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_same(stored["model"], expected, "torch FSDP1 per-rank LOCAL files -> full")
    # a glob and a list of the files name the same checkpoint
    convert_checkpoint(str(theirs / "shard-*.pt"), str(tmp_path / "glob.pt"), to="full", layout_from=ours)
    convert_checkpoint(sorted(str(f) for f in theirs.iterdir()), str(tmp_path / "list.pt"), to="full", layout_from=ours)
    for other in ("glob.pt", "list.pt"):
        assert_same(torch.load(tmp_path / other, weights_only=True)["model"], expected, other)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_our_per_rank_local_files(tmp_path, config: Config) -> None:
    """Our per-rank torch.save LOCAL files (with layout records) convert by themselves: to full, equal to our FULL
    state dict; and through the command line to DCP, which a fully_shard model loads at 1 rank."""
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    expected = run_on_ranks(_save_rank_files, 2, config, str(ranks))[0]
    convert_checkpoint(str(ranks), str(tmp_path / "full.pt"), to="full")
    assert_same(torch.load(tmp_path / "full.pt", weights_only=True)["model"], expected, "per-rank files -> full")

    done = run_cli("convert", str(ranks), str(tmp_path / "dcp"), "--to", "dcp", "--quiet")
    assert done.returncode == 0 and "(local) -> " in done.stdout, done.stderr
    assert_same(run_on_ranks(_fsdp2_load_model, 1, config, str(tmp_path / "dcp"))[0], expected, "FSDP2 at 1 rank")


def test_our_per_rank_files_with_optimizer_state(tmp_path) -> None:
    """Per-rank files of {"model": LOCAL, "optim": optim_state_dict under LOCAL} (ShardedTensor chunks of every
    optimizer state): the optimizer state is assembled from all ranks too, equal to the FULL optim_state_dict."""
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    expected = run_on_ranks(_save_rank_files, 2, Config("transformer"), str(ranks), "ours", True)[0]
    convert_checkpoint(str(ranks), str(tmp_path / "full.pt"), to="full")
    stored = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_same(stored["model"], expected["model"], "per-rank files -> full, model")
    assert_same(stored["optim"], expected["optim"], "per-rank files -> full, optimizer")


def test_full_file_loads_into_the_plain_model(tmp_path) -> None:
    """The full file's model section is the unwrapped model's state dict (strict load), also for a bare
    torch.save(model.state_dict()) converted to DCP and back."""
    config = Config("net")
    expected = run_on_ranks(_save_local, 2, config, str(tmp_path / "local"))[0]
    convert_checkpoint(str(tmp_path / "local"), str(tmp_path / "full.pt"), to="full")
    model = MODELS["net"][0]()
    model.load_state_dict(torch.load(tmp_path / "full.pt", weights_only=True)["model"])
    assert_same(model.state_dict(), expected["model"], "plain model")

    torch.save(model.state_dict(), tmp_path / "bare.pt")
    convert_checkpoint(str(tmp_path / "bare.pt"), str(tmp_path / "bare_dcp"), to="dcp")
    convert_checkpoint(str(tmp_path / "bare_dcp"), str(tmp_path / "bare_full.pt"), to="full")
    assert_same(torch.load(tmp_path / "bare_full.pt", weights_only=True), {"model": expected["model"]}, "bare")


# --------------------------------------------------------------------------------------------------------------------
# Streaming


class _Counted(Checkpoint):
    """A source that counts how many of the tensors it returned are alive at once (their storages: a writer may keep
    other tensors on the same memory)."""

    def __init__(self, source: Checkpoint) -> None:
        self.location, self.leaves, self._source = source.location, source.leaves, source
        self.alive = self.peak = 0

    def read(self, path: Path) -> torch.Tensor:
        tensor = self._source.read(path).clone()
        self.alive += 1
        self.peak = max(self.peak, self.alive)
        weakref.finalize(tensor.untyped_storage(), self._release)
        return tensor

    def _release(self) -> None:
        self.alive -= 1


@pytest.mark.parametrize("target", ["dcp", "full"])
def test_writers_hold_one_source_tensor_at_a_time(tmp_path, target: str) -> None:
    torch.manual_seed(0)
    state = {
        "model": {f"layer{i}.weight": torch.randn(64, 32) for i in range(12)},
        "optim": {
            "state": {"layer0.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 32)}},
            "param_groups": [{"lr": 0.1, "params": ["layer0.weight"]}],
        },
    }
    torch.save(state, tmp_path / "source.pt")
    with open_checkpoint(str(tmp_path / "source.pt")) as stored:
        source = _Counted(stored)
        written = []
        if target == "dcp":
            write_dcp(source, str(tmp_path / "out"), {}, lambda path, _: written.append(path))
        else:
            write_torch_file(source, str(tmp_path / "out"), lambda path, _: written.append(path))
    assert len(written) == 12 + 2
    assert source.peak <= 2, f"{source.peak} source tensors were alive at once"
    assert_same(as_tree(str(tmp_path / "out")), state, f"{target} output")


# --------------------------------------------------------------------------------------------------------------------
# The command line


def test_command_line(tmp_path) -> None:
    config = Config("net", use_orig_params=True)
    expected = run_on_ranks(_save_local, 2, config, str(tmp_path / "local"))[0]

    def convert(*args: str) -> subprocess.CompletedProcess:
        return run_cli("convert", *args)

    done = convert(str(tmp_path / "local"), str(tmp_path / "full.pt"), "--to", "full")
    assert done.returncode == 0, done.stderr
    assert "(local) -> " in done.stdout and "verified" in done.stdout, done.stdout
    assert_same(torch.load(tmp_path / "full.pt", weights_only=True)["model"], expected["model"], "CLI output")
    again = convert(str(tmp_path / "local"), str(tmp_path / "full.pt"), "--to", "full")
    assert again.returncode == 2 and "exists" in again.stderr and "--overwrite" in again.stderr
    bad = convert(str(tmp_path / "nothing"), str(tmp_path / "x.pt"), "--to", "full")
    assert bad.returncode == 2 and "nothing does not exist" in bad.stderr and "Traceback" not in bad.stderr
