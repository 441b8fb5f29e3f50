"""The converter's sources in the layouts FSDP1 users have, and its safetensors target (fsdp_legacy.convert,
`fsdp-legacy convert --from / --to safetensors`).

Inputs are written by the libraries themselves: verl's per-rank files with torch's own calls, as verl's
FSDPCheckpointManager makes them (torch's FSDP1 under SHARDED_STATE_DICT, or FSDP2; torch.save of the model's and
the optimizer's state dicts on every rank), and Accelerate's and Lightning's checkpoints by the real libraries
(`frameworks` tests, test/frameworks/write_layouts.py, with torch's FSDP1). Oracles: the saving model's FULL state
dicts (torch's own, bit for bit), the safetensors package and transformers reading the safetensors output, and
fully_shard models loading the converted DCP output.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from test_convert import _fsdp2_load, _fsdp2_model, _save_local, assert_same, without_layout
from test_optim_state import adam, load_into_fsdp2, model_sd, osd, train

import repo_paths
from cli_runner import run_cli
from fsdp_legacy.convert import CheckpointError, convert_checkpoint, detect_layout
from fsdp_legacy.convert.loading import load_rank_file
from fsdp_utils import Config, build_torch_fsdp
from harness import run_on_ranks
from torchrun import torchrun

REPO = repo_paths.REPO
FULL, SHARDED = "FULL_STATE_DICT", "SHARDED_STATE_DICT"


# --------------------------------------------------------------------------------------------------------------------
# verl's per-rank files, made with torch's calls as verl makes them (on the ranks)


def _save_verl(directory: str, fsdp: str, use_orig_params: bool = False) -> dict:
    """verl's FSDPCheckpointManager.save_checkpoint: every rank torch.saves model.state_dict() (FSDP1: under
    SHARDED_STATE_DICT, offload_to_cpu=False off CUDA, as verl sets it), optimizer.state_dict() and its extra state.
    Returns the FULL model and optimizer state dicts (torch's own), the oracle."""
    config = Config("transformer", use_orig_params=use_orig_params)
    model = _fsdp2_model(config) if fsdp == "fsdp2" else build_torch_fsdp(config)
    optim = adam(model)
    train(model, optim, config, range(2))
    world_size, rank = dist.get_world_size(), dist.get_rank()
    name = f"world_size_{world_size}_rank_{rank}.pt"
    if fsdp == "fsdp2":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        state = model.state_dict()
        full = StateDictOptions(full_state_dict=True)
        expected = {
            "model": get_model_state_dict(model, options=full),
            "optim": get_optimizer_state_dict(model, optim, options=full),
        }
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch_fsdp.FullyShardedDataParallel.state_dict_type(
                model,
                torch_fsdp.StateDictType.SHARDED_STATE_DICT,
                torch_fsdp.ShardedStateDictConfig(offload_to_cpu=False),
                torch_fsdp.ShardedOptimStateDictConfig(offload_to_cpu=False),
            ):
                state = model.state_dict()
        # torch's default offload_to_cpu=True returns wrong values on CPU (FACTS CPU bug #2)
        full_optim = torch_fsdp.FullOptimStateDictConfig(offload_to_cpu=False)
        expected = {
            "model": model_sd(model, torch_fsdp, FULL),
            "optim": osd(model, optim, torch_fsdp, FULL, full_optim),
        }
    torch.save(state, os.path.join(directory, f"model_{name}"))
    torch.save(optim.state_dict(), os.path.join(directory, f"optim_{name}"))
    torch.save(
        {"lr_scheduler": None, "rng": {"cpu": torch.get_rng_state()}}, os.path.join(directory, f"extra_state_{name}")
    )
    return expected


def _verl(tmp_path: Path, fsdp: str, use_orig_params: bool = False) -> tuple[Path, dict]:
    directory = tmp_path / f"verl_{fsdp}_{'uop' if use_orig_params else 'flat'}"
    directory.mkdir()
    return directory, run_on_ranks(_save_verl, 2, str(directory), fsdp, use_orig_params)[0]


def _full(path: Path) -> dict:
    return torch.load(path, weights_only=True)


# --------------------------------------------------------------------------------------------------------------------
# verl


def test_verl_fsdp2_files_convert_bit_for_bit(tmp_path: Path) -> None:
    """FSDP2 (DTensors) per-rank files, tied weights and a buffer included: model and Adam state equal torch's FULL
    state dicts; the DCP output loads into fully_shard models (model and optimizer)."""
    directory, expected = _verl(tmp_path, "fsdp2")
    assert detect_layout(str(directory)) == "verl"
    report = convert_checkpoint(str(directory), str(tmp_path / "full.pt"), to="full")
    assert report.source_format == "verl" and report.verified == report.tensors > 0
    assert_same(_full(tmp_path / "full.pt"), expected, "verl FSDP2 -> full")

    convert_checkpoint(str(directory), str(tmp_path / "dcp"), to="dcp")
    for loaded in run_on_ranks(_fsdp2_load, 2, Config("transformer"), str(tmp_path / "dcp")):
        assert_same(loaded["model"], expected["model"], "FSDP2 model loaded from the converted verl checkpoint")
        assert_same(loaded["optim"]["state"], expected["optim"]["state"], "FSDP2 Adam state")


def test_verl_fsdp1_use_orig_params_files(tmp_path: Path) -> None:
    """torch's FSDP1 with use_orig_params=True: ShardedTensors for the model, and the optimizer's own per-rank pieces
    of each parameter, assembled without a layout."""
    directory, expected = _verl(tmp_path, "fsdp1", use_orig_params=True)
    convert_checkpoint(str(directory), str(tmp_path / "full.pt"), to="full")
    assert_same(_full(tmp_path / "full.pt"), expected, "verl FSDP1 use_orig_params -> full")


def test_verl_fsdp1_flat_optimizer_needs_a_layout(tmp_path: Path) -> None:
    """torch's FSDP1 without use_orig_params (verl's default): the optimizer files hold the flat parameters' shards.
    Without a layout the error says what to pass; the model alone converts; with the layout of our LOCAL
    checkpoint of the same model and wrapping the optimizer state equals torch's FULL one (its tied weight, saved by
    torch under both names, told apart)."""
    directory, expected = _verl(tmp_path, "fsdp1")
    with pytest.raises(CheckpointError, match=r"flat parameters \(use_orig_params=False: 4 of them\).*--layout-from"):
        convert_checkpoint(str(directory), str(tmp_path / "full.pt"), to="full")
    assert not (tmp_path / "full.pt").exists()

    convert_checkpoint(str(directory / "model_world_size_*_rank_*.pt"), str(tmp_path / "model.pt"), to="full")
    assert_same(_full(tmp_path / "model.pt"), {"model": expected["model"]}, "the model files alone")
    convert_checkpoint(str(directory), str(tmp_path / "model_only.pt"), to="full", model_only=True)
    assert_same(_full(tmp_path / "model_only.pt"), {"model": expected["model"]}, "--model-only")

    layout = tmp_path / "layout"
    run_on_ranks(_save_local, 2, Config("transformer"), str(layout))
    convert_checkpoint(str(directory), str(tmp_path / "full.pt"), to="full", layout_from=str(layout))
    assert_same(_full(tmp_path / "full.pt"), expected, "verl FSDP1 flat -> full")


def test_verl_files_errors(tmp_path: Path) -> None:
    """A missing rank's file, files of two saves, and a flipped bit in a rank's model file (found by its CRC-32, which
    torch.load does not check) are refused, naming the files."""
    directory, _ = _verl(tmp_path, "fsdp2")
    (directory / "optim_world_size_2_rank_1.pt").rename(tmp_path / "aside.pt")
    with pytest.raises(CheckpointError, match=r"the optim file of rank\(s\) \[1\] is missing"):
        convert_checkpoint(str(directory), str(tmp_path / "out.pt"), to="full")
    (tmp_path / "aside.pt").rename(directory / "optim_world_size_4_rank_1.pt")
    with pytest.raises(CheckpointError, match=r"verl files of several world sizes \(\[2, 4\]\)"):
        convert_checkpoint(str(directory), str(tmp_path / "out.pt"), to="full")
    (directory / "optim_world_size_4_rank_1.pt").rename(directory / "optim_world_size_2_rank_1.pt")

    path = directory / "model_world_size_2_rank_1.pt"
    stored = load_rank_file(str(path))["tok.weight"].pieces[0][1].contiguous().numpy().tobytes()
    data = bytearray(path.read_bytes())
    data[data.index(stored) + 3] ^= 0x10
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=r"rank_1\.pt is corrupted: its record .* does not match the CRC-32"):
        convert_checkpoint(str(directory), str(tmp_path / "out.pt"), to="full")
    assert not (tmp_path / "out.pt").exists()


def test_lightning_trainer_file_keyed_by_index(tmp_path: Path) -> None:
    """A Trainer checkpoint's optimizer state is keyed by parameter index (as FSDPStrategy saves full checkpoints):
    matched to the model's names when every tensor of the model is a parameter, with the shapes checked; refused,
    saying what to do, when buffers make the match unknowable or the shapes contradict it."""
    model = {"a.weight": torch.randn(3, 2), "b.weight": torch.randn(4)}
    adam = {"step": torch.tensor(1.0), "exp_avg": torch.randn(3, 2)}
    optim = {"state": {0: adam, 1: {"step": torch.tensor(1.0), "exp_avg": torch.randn(4)}}, "param_groups": []}
    optim["param_groups"] = [{"lr": 0.1, "params": [0, 1]}]
    trainer = {"epoch": 0, "global_step": 1, "pytorch-lightning_version": "2.6.6", "state_dict": model}
    torch.save({**trainer, "optimizer_states": [optim]}, tmp_path / "ok.ckpt")
    assert detect_layout(str(tmp_path / "ok.ckpt")) == "lightning"
    convert_checkpoint(str(tmp_path / "ok.ckpt"), str(tmp_path / "ok.pt"), to="full")
    keyed = {"state": {"a.weight": optim["state"][0], "b.weight": optim["state"][1]}, "param_groups": []}
    keyed["param_groups"] = [{"lr": 0.1, "params": ["a.weight", "b.weight"]}]
    assert_same(_full(tmp_path / "ok.pt"), {"model": model, "optim": keyed}, "Trainer file keyed by index")

    torch.save({**trainer, "state_dict": {**model, "buf": torch.zeros(2)}, "optimizer_states": [optim]}, tmp_path / "b")
    with pytest.raises(
        CheckpointError, match=r"keyed by parameter index \(2 indices\) but the model has 3.*--model-only"
    ):
        convert_checkpoint(str(tmp_path / "b"), str(tmp_path / "b.pt"), to="full")
    convert_checkpoint(str(tmp_path / "b"), str(tmp_path / "b.pt"), to="full", model_only=True)

    swapped = {"state": {0: optim["state"][1], 1: adam}, "param_groups": optim["param_groups"]}
    torch.save({**trainer, "optimizer_states": [swapped]}, tmp_path / "swapped.ckpt")
    with pytest.raises(CheckpointError, match=r"exp_avg of a\.weight has the shape \(4,\) but the parameter \(3, 2\)"):
        convert_checkpoint(str(tmp_path / "swapped.ckpt"), str(tmp_path / "s.pt"), to="full")


# --------------------------------------------------------------------------------------------------------------------
# The safetensors target


def _torch_file(tmp_path: Path) -> tuple[Path, dict]:
    """A full checkpoint with an optimizer, a non-floating buffer and a bfloat16 tensor."""
    torch.manual_seed(0)
    model = {
        "embed.weight": torch.randn(40, 16),
        "layers.0.weight": torch.randn(16, 16),
        "layers.0.bias": torch.randn(16).to(torch.bfloat16),
        "steps": torch.arange(3),
        "mask": torch.tensor([True, False]),
    }
    optim = {
        "state": {"embed.weight": {"step": torch.tensor(2.0), "exp_avg": torch.randn(40, 16)}},
        "param_groups": [{"lr": 0.1, "params": ["embed.weight"]}],
    }
    torch.save({"model": model, "optim": optim}, tmp_path / "full.pt")
    return tmp_path / "full.pt", model


def _read_directory(directory: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Every tensor of a safetensors directory with the safetensors package; the index, checked against the files."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        part = load_file(file)
        assert not part.keys() & tensors.keys()
        tensors.update(part)
    index_path = directory / "model.safetensors.index.json"
    if not index_path.exists():
        assert [f.name for f in files] == ["model.safetensors"]
        return tensors, None
    index = json.loads(index_path.read_text())
    assert index["weight_map"] == {key: f.name for f in files for key in load_file(f)}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors, index


def test_safetensors_target_single_file_sharded_and_cast(tmp_path: Path) -> None:
    """One file by default; with --max-shard-size, transformers' file names and index; --dtype casts floating tensors
    only. The safetensors package reads exactly the source's tensors (cast as torch casts them)."""
    source, model = _torch_file(tmp_path)
    report = convert_checkpoint(str(source), str(tmp_path / "one"), to="safetensors")
    assert report.verified == report.tensors == len(model)
    assert report.notes and "optimizer state was not carried" in report.notes[0]
    tensors, index = _read_directory(tmp_path / "one")
    assert index is None
    assert_same(tensors, model, "safetensors, one file")

    convert_checkpoint(str(source), str(tmp_path / "bf16"), to="safetensors", dtype=torch.bfloat16, max_shard_size=520)
    tensors, index = _read_directory(tmp_path / "bf16")
    assert index is not None and len(set(index["weight_map"].values())) == 3
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    cast = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.items()}
    assert_same(tensors, cast, "safetensors, cast to bfloat16")
    assert tensors["steps"].dtype == torch.int64 and tensors["mask"].dtype == torch.bool


def test_safetensors_output_loads_into_transformers_and_our_model(tmp_path: Path) -> None:
    """A tiny Llama's state dict in a full checkpoint, converted to safetensors and sharded: transformers'
    from_pretrained loads it to the same weights; converted back (--from safetensors), it equals the source."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save({"model": state}, tmp_path / "llama.pt")
    convert_checkpoint(str(tmp_path / "llama.pt"), str(tmp_path / "hf"), to="safetensors", max_shard_size="4KB")
    config.save_pretrained(tmp_path / "hf")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert_same(dict(loaded.state_dict().items()), state, "from_pretrained")

    assert detect_layout(str(tmp_path / "hf")) == "safetensors"
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "back.pt"), to="full")
    assert_same(_full(tmp_path / "back.pt"), {"model": state}, "safetensors -> full")


def _load_into_ours(directory: str) -> dict:
    from fsdp_legacy.checkpoint import load_full_model
    from fsdp_utils import build_ours, full_params

    _, model = build_ours(Config("transformer"), seed=7)
    load_full_model(model, directory)
    return full_params(model)


def test_safetensors_from_verl_loads_with_load_full_model(tmp_path: Path) -> None:
    """verl (FSDP2) -> safetensors through the command line, loaded by fsdp_legacy.checkpoint.load_full_model into a
    wrapped model at 2 ranks: its parameters equal the saving model's. (The tied head is written under both names,
    as stored; load_full_model accepts that.)"""
    directory, expected = _verl(tmp_path, "fsdp2")
    done = run_cli(
        "convert", str(directory), str(tmp_path / "hf"), "--to", "safetensors", "--max-shard-size", "2KB", "--quiet"
    )
    assert done.returncode == 0, done.stderr
    assert "(verl) -> " in done.stdout and "optimizer state was not carried" in done.stdout
    for params in run_on_ranks(_load_into_ours, 2, str(tmp_path / "hf")):
        assert_same(params, {k: v for k, v in expected["model"].items() if k in params}, "load_full_model")


# --------------------------------------------------------------------------------------------------------------------
# Detection and errors


def test_detection_and_errors(tmp_path: Path) -> None:
    """--from forces a layout; a directory that looks like two layouts, an unknown layout, an unknown dtype target and
    corrupt safetensors are refused with errors saying what to do."""
    source, _ = _torch_file(tmp_path)
    assert detect_layout(str(source)) == "full"
    with pytest.raises(CheckpointError, match="Unknown source layout 'megatron'"):
        convert_checkpoint(str(source), str(tmp_path / "x"), to="full", source_layout="megatron")
    with pytest.raises(CheckpointError, match="is not a DCP checkpoint directory"):
        convert_checkpoint(str(source), str(tmp_path / "x"), to="full", source_layout="dcp")
    with pytest.raises(CheckpointError, match="apply to --to safetensors only"):
        convert_checkpoint(str(source), str(tmp_path / "x"), to="full", dtype=torch.float16)
    with pytest.raises(CheckpointError, match="max_shard_size='lots'"):
        convert_checkpoint(str(source), str(tmp_path / "x"), to="safetensors", max_shard_size="lots")

    both = tmp_path / "both"
    convert_checkpoint(str(source), str(both), to="safetensors")
    (both / "pytorch_model_fsdp.bin").write_bytes(source.read_bytes())
    with pytest.raises(CheckpointError, match=r"several layouts \(accelerate, safetensors\): pass --from"):
        convert_checkpoint(str(both), str(tmp_path / "x.pt"), to="full")
    convert_checkpoint(str(both), str(tmp_path / "x.pt"), to="full", source_layout="safetensors")
    command = ["convert", str(both), str(tmp_path / "cli")]
    done = run_cli(*command, "--to", "safetensors", "--from", "safetensors", "--dtype", "fp16", "--quiet")
    assert done.returncode == 0 and "(safetensors) -> " in done.stdout, done.stderr
    assert _read_directory(tmp_path / "cli")[0]["embed.weight"].dtype == torch.float16
    done = run_cli(*command, "--to", "safetensors", "--dtype", "int8")
    assert done.returncode == 2 and "'int8' is not a floating-point dtype" in done.stderr

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="without a DCP .metadata file.*--from"):
        convert_checkpoint(str(empty), str(tmp_path / "x.pt"), to="full")

    data = bytearray((both / "model.safetensors").read_bytes())
    (both / "model.safetensors").write_bytes(data[: len(data) - 8])  # truncated
    with pytest.raises(CheckpointError, match=r"is cut short: .*bytes \[.*\) of its data lie past the end.*truncated"):
        convert_checkpoint(str(both), str(tmp_path / "y.pt"), to="full", source_layout="safetensors")
    (both / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="header length .* runs past the end"):
        convert_checkpoint(str(both), str(tmp_path / "y.pt"), to="full", source_layout="safetensors")
    assert not (tmp_path / "y.pt").exists()


# --------------------------------------------------------------------------------------------------------------------
# Accelerate and Lightning, by the real libraries


def _write_layouts(library: str, out: Path) -> Path:
    """test/frameworks/write_layouts.py on 2 ranks, with torch's own FSDP1."""
    done = torchrun("write_layouts.py", ["--library", library, "--out", str(out)], ours=False)
    assert done.returncode == 0, f"{library}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return out


@pytest.fixture(scope="module")
def accelerate_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("accelerate")
    return _write_layouts("accelerate", tmp_path_factory.mktemp("accelerate"))


@pytest.fixture(scope="module")
def lightning_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("lightning")
    return _write_layouts("lightning", tmp_path_factory.mktemp("lightning"))


def _load_net_into_fsdp2(path: str) -> dict:
    """test/frameworks' Net under fully_shard (blocks, then the root) and AdamW load a DCP checkpoint with torch's
    helpers; their FULL state dicts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    if str(REPO / "test" / "frameworks") not in sys.path:
        sys.path.insert(0, str(REPO / "test" / "frameworks"))
    from common import Block, Net

    torch.manual_seed(1)  # another initialisation: everything must come from the checkpoint
    model = Net()
    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_into_fsdp2(model, optim, path)
    full = StateDictOptions(full_state_dict=True)
    return {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, optim, options=full),
    }


def _expected(directory: Path) -> dict[str, Any]:
    return torch.load(directory / "expected.pt", weights_only=True)


@pytest.mark.frameworks
@pytest.mark.parametrize("name", ["full", "sharded", "sharded_per_rank"])
def test_accelerate_checkpoints(accelerate_out: Path, tmp_path: Path, name: str) -> None:
    """Accelerate's save_state under FULL_STATE_DICT (pytorch_model_fsdp.bin, optimizer.bin) and SHARDED_STATE_DICT
    (pytorch_model_fsdp_0/ and optimizer_0/ with DCP; per-rank files without): detected, converted to a full file equal
    to torch's FULL model and optimizer state dicts, and to safetensors."""
    source = accelerate_out / name
    assert detect_layout(str(source)) == "accelerate"
    report = convert_checkpoint(str(source), str(tmp_path / "full.pt"), to="full")
    assert report.source_format == "accelerate" and report.verified == report.tensors
    assert_same(_full(tmp_path / "full.pt"), _expected(source), f"Accelerate {name} -> full")
    convert_checkpoint(str(source), str(tmp_path / "hf"), to="safetensors", dtype=torch.bfloat16)
    tensors, _ = _read_directory(tmp_path / "hf")
    assert_same(tensors, {k: v.bfloat16() for k, v in _expected(source)["model"].items()}, "-> safetensors")


@pytest.mark.frameworks
def test_accelerate_local_checkpoint_with_a_layout(accelerate_out: Path, tmp_path: Path) -> None:
    """LOCAL_STATE_DICT: torch's flat parameters per rank (no layout record) and optimizer_0/; with --layout-from our
    LOCAL checkpoint of the same model and wrapping (written by the same script with fsdp_legacy), or with the layout
    inferred from optimizer_0/, equal to torch's FULL state dicts; with the model alone, the error names the option."""
    source = accelerate_out / "local"
    with pytest.raises(CheckpointError, match="without a layout record.*--layout-from.*no optimizer state"):
        convert_checkpoint(str(source), str(tmp_path / "full.pt"), to="full", model_only=True)
    for name, layout_from in (("given", str(accelerate_out / "layout")), ("inferred", None)):
        convert_checkpoint(str(source), str(tmp_path / f"{name}.pt"), to="full", layout_from=layout_from)
        stored = _full(tmp_path / f"{name}.pt")
        assert_same(without_layout(stored), _expected(source), f"Accelerate LOCAL -> full, {name} layout")
        assert len(stored["layout"]) == 3, "the records travel along (the root and two blocks)"


@pytest.mark.frameworks
@pytest.mark.parametrize("name", ["fabric_sharded", "fabric_full", "trainer_sharded", "trainer_full"])
def test_lightning_checkpoints(lightning_out: Path, tmp_path: Path, name: str) -> None:
    """Fabric's save (the user's keys) and the Trainer's save_checkpoint (its optimizer keyed by parameter index in
    full files), sharded (DCP with meta.pt) and full: converted to a full file equal to torch's FULL model and
    optimizer state dicts; --model-only leaves the optimizer out; --strip-prefix takes the LightningModule's attribute
    off the Trainer's names; Fabric's sharded one also to DCP, which a fully_shard model loads."""
    source = lightning_out / name / "checkpoint.ckpt"
    report = convert_checkpoint(str(source), str(tmp_path / "full.pt"), to="full")
    assert report.source_format == "lightning" and report.verified == report.tensors
    assert_same(_full(tmp_path / "full.pt"), _expected(lightning_out / name), f"Lightning {name} -> full")
    model_only = convert_checkpoint(str(source), str(tmp_path / "model.pt"), to="full", model_only=True)
    assert model_only.tensors == len(_expected(lightning_out / name)["model"])
    if name.startswith("trainer"):  # the LightningModule's keys: its attribute `net` in front of Net's own names
        convert_checkpoint(str(source), str(tmp_path / "hf"), to="safetensors", strip_prefix="net.")
        model = {k.removeprefix("net."): v for k, v in _expected(lightning_out / name)["model"].items()}
        assert_same(_read_directory(tmp_path / "hf")[0], model, "Trainer -> safetensors, without the prefix")
        convert_checkpoint(str(source), str(tmp_path / "stripped.pt"), to="full", strip_prefix="net.")
        stripped = _full(tmp_path / "stripped.pt")["optim"]
        assert set(stripped["state"]) == set(model) and set(stripped["param_groups"][0]["params"]) == set(model)
    if name == "fabric_sharded":  # the user's keys are the model's own: a fully_shard Net loads the DCP output
        convert_checkpoint(str(source), str(tmp_path / "dcp"), to="dcp")
        expected = _expected(lightning_out / name)
        for loaded in run_on_ranks(_load_net_into_fsdp2, 2, str(tmp_path / "dcp")):
            assert_same(loaded["model"], expected["model"], "fully_shard model loaded from Fabric's checkpoint")
            assert_same(loaded["optim"]["state"], expected["optim"]["state"], "AdamW state")
