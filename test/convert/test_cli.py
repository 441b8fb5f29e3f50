"""The `fsdp-legacy` command (fsdp_legacy.cli), run as users run it (`python -m fsdp_legacy ...`: in this process,
through cli_runner.py, and in a new interpreter where the process is under test), on checkpoints saved here by 2 gloo
ranks.

Oracles: the FULL model and optimizer state dicts of the model that saved the checkpoint (a converted checkpoint
equals them bit for bit; `inspect` lists exactly their names, shapes and dtypes), the estimator called directly on
tools/gpt.py's GPT (`mem-report`'s numbers), and torch.load (what a converted file holds).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_optim_state import adam, model_sd, osd, train

import fsdp_legacy
import repo_paths
from cli_runner import run_cli
from fsdp_legacy.cli import main
from fsdp_legacy.convert import convert_checkpoint
from fsdp_legacy.state import dcp_checkpoint
from fsdp_utils import Config, build_ours
from harness import run_on_ranks

REPO = repo_paths.REPO
CONFIG = Config("transformer")
LOCAL, FULL = "LOCAL_STATE_DICT", "FULL_STATE_DICT"


def _save(config: Config, directory: str) -> dict:
    """Train with Adam, then save a LOCAL checkpoint with DCP ({"model", "optim"}) and per-rank torch.save files of
    the LOCAL model state dict; return the FULL model and optimizer state dicts, the oracle."""
    model = build_ours(config)[1]
    optim = adam(model)
    train(model, optim, config, range(2))
    state = {"model": model_sd(model, fsdp_legacy, LOCAL), "optim": osd(model, optim, fsdp_legacy, LOCAL)}
    dcp_checkpoint.save(state, os.path.join(directory, "local"))  # the layout records go into its side file
    torch.save(state["model"], os.path.join(directory, "ranks", f"part{dist.get_rank()}.pt"))
    return {"model": model_sd(model, fsdp_legacy, FULL), "optim": osd(model, optim, fsdp_legacy, FULL)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    directory = tmp_path_factory.mktemp("cli")
    (directory / "ranks").mkdir()
    expected = run_on_ranks(_save, 2, CONFIG, str(directory))[0]
    return directory, expected


def real_command(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m fsdp_legacy ARGS` in a new interpreter, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "fsdp_legacy", *args], capture_output=True, text=True, cwd=cwd, check=False
    )


command = run_cli  # the same command in this process (cli_runner.py): no interpreter and torch import per call


def inspected(path: Path) -> dict:
    """`inspect PATH --json`, parsed."""
    done = command("inspect", str(path), "--json", "--quiet")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def listing(found: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    return {p["name"]: (tuple(p["shape"]), p["dtype"]) for p in found["parameters"]}


def expected_listing(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict:
    def cast(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    return {name: (tuple(t.shape), str(cast(t)).removeprefix("torch.")) for name, t in state.items()}


def tensors_in(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in tensors_in(value)]
    if isinstance(tree, list):
        return [t for value in tree for t in tensors_in(value)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def assert_same(actual: Any, expected: Any, what: str) -> None:
    """Equal nested state dicts: the same keys, tensors of the same dtype equal bit for bit."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (
            f"{what}: {sorted(actual)} != {sorted(expected)}"
        )
        for key in expected:
            assert_same(actual[key], expected[key], f"{what}.{key}")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, what
        assert torch.equal(actual.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), what
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), what
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{what}[{index}]")
    else:
        assert actual == expected, what


# --------------------------------------------------------------------------------------------------------------------
# convert and inspect


def test_convert_and_inspect(saved: tuple[Path, dict], tmp_path: Path) -> None:
    """LOCAL (DCP, 2 ranks) -> full file through the command equals the saving model's FULL state dicts bit for bit;
    inspect lists exactly the model's names, shapes and dtypes in the LOCAL checkpoint (its flat parameters named by
    their records), the per-rank files, the full file and a bf16 safetensors directory, with the world size where
    there is one and the optimizer state where there is one."""
    directory, expected = saved
    full = tmp_path / "full.pt"
    done = command("convert", str(directory / "local"), str(full), "--to", "full", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "(local) -> " in done.stdout and "verified" in done.stdout, done.stdout
    stored = torch.load(full, weights_only=True)
    assert_same(stored["model"], expected["model"], "converted model")
    assert_same(stored["optim"], expected["optim"], "converted optimizer state")

    oracle = expected_listing(expected["model"])
    states = {name for state in expected["optim"]["state"].values() for name in state}
    state_tensors = [v for s in expected["optim"]["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]

    local = inspected(directory / "local")
    assert (local["layout"], local["format"], local["world_size"]) == ("dcp", "local", 2)
    assert listing(local) == oracle
    assert local["flat_parameters"] == 4  # the root and 3 blocks
    assert local["optimizer"] == {
        "present": True,
        "parameters": len(expected["optim"]["state"]),
        "states": sorted(states),
        "tensors": len(state_tensors),
        "bytes": sum(t.numel() * t.element_size() for t in state_tensors),
        "groups": 1,
    }

    ranks = inspected(directory / "ranks")
    assert (ranks["layout"], ranks["format"], ranks["world_size"]) == ("local", "local", 2)
    assert listing(ranks) == oracle and ranks["optimizer"] == {"present": False}
    assert ranks["files"] == 2 and ranks["disk_bytes"] == sum(f.stat().st_size for f in (directory / "ranks").iterdir())

    whole = inspected(full)
    assert (whole["layout"], whole["format"], whole["world_size"]) == ("full", "full", None)
    assert listing(whole) == oracle and whole["optimizer"]["present"]
    assert whole["tensor_bytes"] == sum(t.numel() * t.element_size() for t in tensors_in(stored))
    assert stored.keys() == {"model", "optim", "layout"} and "carries the layout records of 4" in whole["notes"][0]

    convert_checkpoint(str(full), str(tmp_path / "hf"), to="safetensors", dtype=torch.bfloat16)
    hf = inspected(tmp_path / "hf")
    assert (hf["layout"], hf["format"], hf["optimizer"]) == ("safetensors", "safetensors", {"present": False})
    assert listing(hf) == expected_listing(expected["model"], torch.bfloat16)


def test_inspect_text(saved: tuple[Path, dict]) -> None:
    """Without --json (per-rank files, quoted glob): the format, world size and optimizer state in words, then one
    row per model tensor."""
    directory, expected = saved
    done = command("inspect", str(directory / "ranks" / "part*.pt"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "per-rank torch.save files, a LOCAL state dict" in lines[0]
    assert "  world size:  2" in lines and "  optimizer:   none" in lines
    rows = {tuple(line.split()) for line in lines if line.startswith("  ") and ":" not in line}
    table = {
        (name, str(tuple(t.shape)).replace(" ", ""), str(t.dtype).removeprefix("torch."))
        for name, t in expected["model"].items()
    }
    assert {(r[0], "".join(r[1:-1]), r[-1]) for r in rows if r[0] != "name"} == table


def test_inspect_checks_the_crcs_and_runs_no_pickled_code(saved: tuple[Path, dict], tmp_path: Path) -> None:
    """A full file whose tensor bytes are damaged: convert and inspect both refuse it (torch.save's CRC-32s: exit 1,
    one line naming the record); intact, inspect says it verified them. A pickle that would run code is refused
    (exit 1) and the code does not run."""
    _, expected = saved
    path = tmp_path / "model.pt"
    torch.save(expected["model"], path)
    intact = inspected(path)
    assert listing(intact) == expected_listing(expected["model"])
    assert intact["verified"] == ["CRC-32s of every record of the torch.save archive"] and not intact["not_verified"]
    with zipfile.ZipFile(path) as archive:
        record = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size >= 64)
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack_from("<2H", data, record.header_offset + 26)  # the local header's
    start = record.header_offset + 30 + name_length + extra_length
    data[start : start + 8] = bytes(b ^ 0xFF for b in data[start : start + 8])
    path.write_bytes(data)

    done = command("convert", str(path), str(tmp_path / "out.pt"), "--to", "full")
    assert done.returncode == 1 and "does not match the CRC-32" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    done = command("inspect", str(path), "--json")
    damaged = "|".join(n for n, t in expected["model"].items() if t.numel() * t.element_size() == record.file_size)
    assert done.returncode == 1, done.stderr
    assert re.search(rf"its record {re.escape(repr(record.filename))} \(the data of ({damaged})\)", done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout, done.stderr

    class Payload:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    torch.save({"model": expected["model"], "extra": Payload()}, tmp_path / "evil.pt")
    done = command("inspect", str(tmp_path / "evil.pt"))
    assert done.returncode == 1 and "weights_only" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "ran").exists()


def test_bad_paths_and_formats(saved: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Exit code 2 and one line naming the problem and the fix, for a path that does not exist (the real command),
    something that is not a checkpoint and an existing destination; argparse's own errors are 2 as well."""
    directory, _ = saved
    missing = tmp_path / "nothing"
    done = real_command("inspect", str(missing))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr == (
        f"python -m fsdp_legacy inspect: error: checkpoint {missing} does not exist: pass the path of a checkpoint "
        "file or directory.\n"
    )

    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "empty").mkdir()
    cases = [
        (["convert", str(missing), str(tmp_path / "x"), "--to", "full"], f"source {missing} does not exist"),
        (
            ["convert", str(tmp_path / "notes.txt"), str(tmp_path / "x"), "--to", "full"],
            "is a file but not a torch.save archive",
        ),
        (["inspect", str(tmp_path / "empty")], "is a directory without a DCP .metadata file"),
        (["inspect", str(tmp_path / "ranks-*.pt")], "matches no files"),
        (["convert", str(directory / "local"), str(directory / "ranks"), "--to", "dcp"], "exists; pass --overwrite"),
        (["convert", str(directory / "local"), str(missing / "out.pt"), "--to", "full"], f"{missing}, the directory"),
        (
            ["convert", str(directory / "local"), str(tmp_path / "x"), "--to", "dcp", "--dtype", "bf16"],
            "--dtype cannot be used with --to dcp",
        ),
    ]
    for argv, message in cases:
        assert main(argv, prog="fsdp-legacy") == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"fsdp-legacy {argv[0]}: error: ") and message in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(directory / "local"), str(tmp_path / "x")])  # no --to
    assert exit_info.value.code == 2 and "--to" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# mem-report


def test_mem_report_equals_the_estimator() -> None:
    """The peaks mem-report prints (JSON, bytes) are the estimator's for tools/gpt.py's GPT of the same size."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from gpt import GPT, Block, GPTConfig
    finally:
        sys.path.remove(str(REPO / "tools"))
    from fsdp_legacy.memory import Phase, estimate_memory
    from fsdp_legacy.wrap import ModuleWrapPolicy

    done = command("mem-report", "--model", "gpt-small", "--world-sizes", "2", "--batch", "2x64", "--json", "--quiet")
    assert done.returncode == 0, done.stderr
    reported = json.loads(done.stdout)
    config = GPTConfig(vocab_size=256, block_size=128, n_layer=8, n_head=4, d_model=256)

    def loss(model: torch.nn.Module, step: int) -> torch.Tensor:
        tokens = torch.randint(0, config.vocab_size, (2, 64))
        return model(tokens, tokens)[1]

    profile = estimate_memory(
        lambda: GPT(config),
        loss,
        2,
        dict(auto_wrap_policy=ModuleWrapPolicy({Block})),
        lambda params: torch.optim.AdamW(params, lr=1e-4),
    )
    phases = {phase.value: profile.peak(phase) for phase in Phase}
    assert reported["estimates"] == [
        {
            "world_size": 2,
            "peak_bytes": {**phases, "peak": profile.peak()},
            "seconds": reported["estimates"][0]["seconds"],
            "method": "traced",  # 8 blocks: fewer than the 3 + 4 + 5 an extrapolation traces
        }
    ]
    plan = reported["wrap_plan"]
    counts = {f"blocks.{i}": sum(p.numel() for p in block.parameters()) for i, block in enumerate(GPT(config).blocks)}
    assert plan["units"] == counts and plan["parameters"] == sum(p.numel() for p in GPT(config).parameters())


def test_mem_report_of_hybrid_sharding() -> None:
    """HYBRID_SHARD over 4 ranks in shard groups of 2 holds what FULL_SHARD over 2 ranks holds, plus the buffers of the
    all-reduce across the replicas: its peak is FULL_SHARD's at 2 ranks (within 5%), above FULL_SHARD's at 4; a shard
    group size that does not divide the world size is refused."""
    common = ["mem-report", "--model", "gpt-small", "--batch", "2x64", "--json", "--quiet"]

    def peaks(*args: str) -> dict[int, int]:
        done = command(*common, *args)
        assert done.returncode == 0, done.stderr
        return {e["world_size"]: e["peak_bytes"]["peak"] for e in json.loads(done.stdout)["estimates"]}

    hybrid = peaks("--world-sizes", "4", "--sharding-strategy", "HYBRID_SHARD", "--shard-group-size", "2")[4]
    full = peaks("--world-sizes", "2,4")
    assert abs(hybrid - full[2]) <= 0.05 * full[2] and hybrid > full[4], (hybrid, full)
    refused = command(*common, "--world-sizes", "6", "--sharding-strategy", "HYBRID_SHARD", "--shard-group-size", "4")
    assert refused.returncode == 2 and "--shard-group-size 4 does not divide world size 6" in refused.stderr


def test_mem_report_of_a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """--module pkg:factory --wrap pkg.Class from the current directory: the plan's units are the model's, the peak
    per rank falls with the world size; without --wrap the error says what to add."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "mymodels.py").write_text(
        "from torch import nn\n"
        "class Layer(nn.Sequential):\n"
        "    pass\n"
        "def build():\n"
        "    return nn.Sequential(nn.Embedding(50, 8), Layer(nn.Linear(8, 8), nn.ReLU()), Layer(nn.Linear(8, 50)))\n"
    )
    args = ["mem-report", "--module", "mymodels:build", "--vocab-size", "50", "--batch", "2x4", "--world-sizes", "1,2"]
    try:
        assert main([*args, "--wrap", "mymodels.Layer", "--json", "--quiet"]) == 0
    finally:
        sys.modules.pop("mymodels", None)
    reported = json.loads(capsys.readouterr().out)
    assert reported["wrap_plan"]["units"] == {"1": 8 * 8 + 8, "2": 8 * 50 + 50}
    assert reported["wrap_plan"]["root_parameters"] == 50 * 8
    assert [e["world_size"] for e in reported["estimates"]] == [1, 2]
    assert reported["estimates"][1]["peak_bytes"]["peak"] < reported["estimates"][0]["peak_bytes"]["peak"]
    assert main(args) == 2 and "needs --wrap" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# Help and the installed script


@pytest.mark.heavy  # fresh interpreters, about 5 s: CI runs it after the README's tests (pytest -m heavy)
def test_help(capsys: pytest.CaptureFixture) -> None:
    """The installed `fsdp-legacy` script runs and gives the help `python -m fsdp_legacy` gives; every subcommand's
    has examples and the exit codes."""
    script = shutil.which("fsdp-legacy", path=sysconfig.get_path("scripts"))
    assert script is not None, "no fsdp-legacy script: pip install -e . (setup.cfg's console_scripts)"
    by_script = subprocess.run([script, "--help"], capture_output=True, text=True, check=False)
    assert by_script.returncode == 0, by_script.stderr
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"], prog="python -m fsdp_legacy")
    assert exit_info.value.code == 0
    assert by_script.stdout.replace("fsdp-legacy", "python -m fsdp_legacy", 1) == capsys.readouterr().out
    for name in ("inspect", "convert", "mem-report"):
        assert f"\n    {name}" in by_script.stdout
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"], prog="fsdp-legacy")
        out = capsys.readouterr().out
        assert exit_info.value.code == 0 and f"usage: fsdp-legacy {name}" in out
        assert f"examples:\n  fsdp-legacy {name} " in out and "exit codes:" in out


@pytest.mark.heavy  # fresh interpreters, about 5 s: CI runs it after the README's tests (pytest -m heavy)
def test_commands_under_the_switch() -> None:
    """The commands work in an environment with FSDP_LEGACY=1 (torch's FSDP1 names switched to ours)."""
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_legacy", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "FSDP_LEGACY": "1"},
        check=False,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
