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


def run_bench(tmp_path, *options: str, env: dict[str, str] | None = None) -> list[dict]:
    out = tmp_path / "rows.json"
    command = [sys.executable, os.path.join(TOOLS, "bench_scale.py"), "--preset", "llama-tiny", "--batch", "2x32"]
    done = subprocess.run(
        [*command, "--steps", "1", "--json", str(out), *options],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
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


def test_lora_fine_tuning_on_one_rank_of_eight(tmp_path):
    """--lora: the model frozen, adapters on every decoder linear layer, use_orig_params implied. Ours and torch's FSDP1
    compute the same loss; ours holds the adapters' gradients only, where torch's FSDP1 keeps a shard-sized flat
    gradient per unit, so our peak is below its; the estimate follows our measured peak."""
    # llama-tiny's units (tens of KB) would share our 1 MiB communication buckets, which cost up to 1.6x the budget
    # (docs/benchmarks.md); a real model's units are each above it, so the buckets are off here as they are there.
    options = ("--world-size", "8", "--layers", "2", "--lora", "4", "--impls", "ours,torch_fsdp1")
    rows = run_bench(tmp_path, *options, env={"FSDP_LEGACY_BUCKET_MB": "0"})
    by_impl = {row["impl"]: row for row in rows}
    assert all(row["lora_rank"] == 4 and "LoRA rank 4" in row["options"] for row in rows)
    assert "use_orig_params" in rows[0]["options"]
    ours, torch_fsdp1 = by_impl["ours"], by_impl["torch_fsdp1"]
    assert ours["loss"] == torch_fsdp1["loss"]
    assert ours["peak_allocated_bytes"] < torch_fsdp1["peak_allocated_bytes"]
    assert abs(ours["estimate_bytes"] - ours["peak_allocated_bytes"]) <= 0.05 * ours["peak_allocated_bytes"]


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
