"""tools/bench_scale.py, the rig that plays one rank of a large world: a small configuration of it, checked for what the
published figures rely on. The three implementations are measured on the same values (ours and torch's FSDP1 hold the
same flat shards, so their losses are bit-identical), the estimator's prediction is compared with our measured peak,
and the JSON has the documented fields."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

import repo_paths
from fsdp_legacy.cli.llama import PRESETS, Llama

pytestmark = pytest.mark.heavy  # whole programs in other processes: CI runs them after the README's tests

TOOLS = str(repo_paths.TOOLS)
FIELDS = {"impl", "preset", "layers", "world_size", "device", "peak_allocated_bytes", "peak_reserved_bytes"}
FIELDS |= {"estimate_bytes", "step_s"}


def run_bench(tmp_path, *options: str) -> list[dict]:
    out = tmp_path / "rows.json"
    command = [sys.executable, os.path.join(TOOLS, "bench_scale.py"), "--preset", "llama-tiny", "--batch", "2x32"]
    done = subprocess.run(
        [*command, "--steps", "1", "--json", str(out), *options], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the fake process group's collectives move no data" in done.stdout
    return json.loads(out.read_text())["rows"]


def test_three_implementations_on_one_rank_of_eight(tmp_path):
    options = ("--world-size", "8", "--layers", "2", "--bf16", "--activation-checkpointing", "--use-orig-params")
    rows = run_bench(tmp_path, *options)
    by_impl = {row["impl"]: row for row in rows}
    assert set(by_impl) == {"ours", "torch_fsdp1", "fsdp2"}
    for row in rows:
        assert FIELDS <= set(row), row
        assert row["world_size"] == 8 and row["layers"] == 2 and row["of_layers"] == PRESETS["llama-tiny"].num_layers
        assert row["peak_allocated_bytes"] > 0 and row["step_s"] > 0 and math.isfinite(row["loss"])
    # The same flat shards and the same filled collectives: torch's FSDP1 computes exactly what ours computes.
    assert by_impl["ours"]["loss"] == by_impl["torch_fsdp1"]["loss"]
    ours = by_impl["ours"]
    assert abs(ours["estimate_bytes"] - ours["peak_allocated_bytes"]) <= 0.05 * ours["peak_allocated_bytes"]
    # Every rank holds 1/8 of the model's parameters and AdamW's two moments at least (fp32).
    state = 3 * 4 * sum(p.numel() for p in Llama(PRESETS["llama-tiny"].with_layers(2)).parameters()) / 8
    assert ours["peak_allocated_bytes"] >= state


def test_bad_input_is_refused() -> None:
    bad = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "bench_scale.py"), "--preset", "llama-tiny", "--layers", "99"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "has 1 to 8 decoder layers" in bad.stderr
    offload = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "bench_scale.py"), "--preset", "llama-tiny", "--cpu-offload"],
        capture_output=True,
        text=True,
    )
    # torch's FSDP1 and FSDP2 cannot offload on the CPU (FSDP1_FACTS): said before anything runs, with the way out.
    assert offload.returncode == 2 and "torch_fsdp1 and fsdp2 cannot offload" in offload.stderr
    assert "use --impls ours or --device cuda" in offload.stderr
