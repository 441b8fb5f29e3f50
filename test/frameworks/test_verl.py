"""verl 0.9.1's FSDP1 engine, unmodified, on fsdp_legacy through the switch (FSDP_LEGACY=1) and on torch's own FSDP1,
side by side on 2 CPU ranks (test/frameworks/run_verl.py): set-up, PPO updates, eval log-probabilities, offload and
reload, checkpoint save, load and resume, weight sync and the three LoRA export paths, use_orig_params both ways, fp32
and verl's bf16 mixed precision. Every tensor every stage produced, and every tensor of every checkpoint file, equal
torch's FSDP1's bit for bit; and the stages agree among themselves (a resume continues as the run without a break, a
weight sync sends the weights the checkpoint holds, a merged LoRA export is the base plus the adapters). verl's
reference policy (parameters offloaded to the CPU, which torch's FSDP1 cannot do with a CPU compute device) runs on
ours only, against the actor's log-probabilities before training.

Needs verl, installed as CI installs it (`.ci/run`: verl 0.9.1 without its dependencies, the few packages its FSDP
modules import, peft 0.20.0); `pytest -m verl`. Skipped where verl is not installed.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torchrun import torchrun

pytestmark = pytest.mark.verl
RANKS = 2
HYBRID, FULL_SHARD_TWIN = "hsdp", "fp32"  # verl's fsdp_size=1 (HYBRID_SHARD, shard groups of one), and the same run
# with fsdp_size=2 (FULL_SHARD): data parallel over the same 2 ranks, the same training
CHECKPOINT_FILES = ("model", "optim", "extra_state")


def _launch(impl: str, out: Path) -> dict[str, Any]:
    done = torchrun("run_verl.py", ["--impl", impl, "--out", str(out)], ours=impl == "ours")
    assert done.returncode == 0, f"run_verl.py --impl {impl} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def verl_runs() -> Iterator[tuple[dict, dict, Path, Path]]:
    pytest.importorskip("verl")
    peft = pytest.importorskip("peft")
    if tuple(int(part) for part in peft.__version__.split(".")[:2]) > (0, 20):
        pytest.skip(f"verl 0.9.1's LoRA export needs peft <= 0.20 (its key names); peft {peft.__version__} here")
    with tempfile.TemporaryDirectory() as directory:
        ours, theirs = Path(directory) / "ours", Path(directory) / "torch"
        yield _launch("ours", ours), _launch("torch", theirs), ours, theirs


def _stages(out: Path, run: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / run / f"rank{rank}.pt", weights_only=True)


def _under(found: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {key[len(prefix) + 1 :]: value for key, value in found.items() if key.startswith(prefix + "/")}


def _bitwise(mine: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert mine.dtype == expected.dtype and mine.shape == expected.shape, f"{what}: {mine.dtype} {mine.shape}"
    if not torch.equal(mine, expected):
        difference = (mine.double() - expected.double()).abs().max().item()
        raise AssertionError(f"{what}: differs from torch's FSDP1 by up to {difference}")


def test_verl_engine_stages_equal_torch_fsdp1_bit_for_bit(verl_runs: tuple) -> None:
    ours, theirs, our_dir, their_dir = verl_runs
    assert ours.keys() == theirs.keys() and len(ours) == 7
    compared = 0
    for name, mine in ours.items():
        if name == HYBRID:  # torch's FSDP1 trains its replicas apart there: the next test
            continue
        torch_run = theirs[name]
        assert mine["fsdp"].startswith("fsdp_legacy") and torch_run["fsdp"].startswith("torch.distributed.fsdp")
        for fact in ("units", "param_dtypes", "exported", "checkpoint_files"):  # the wrapping verl chose, and so on
            assert mine[fact] == torch_run[fact], f"{name}: {fact}"
        for rank in range(RANKS):
            found, expected = _stages(our_dir, name, rank), _stages(their_dir, name, rank)
            found = {k: v for k, v in found.items() if not k.startswith("reference/")}  # ours only: see below
            assert found.keys() == expected.keys(), f"{name}: {sorted(set(found) ^ set(expected))[:5]}"
            for key, value in found.items():
                _bitwise(value, expected[key], f"{name}, rank {rank}: {key}")
                compared += 1
    assert compared > 2000


def _checkpoint_values(path: Path) -> dict[str, Any]:
    """Every value of a verl checkpoint file by its path in the nested structure: DTensors as (placements, local
    tensor), tensors, and the rest (scheduler state, numpy and Python RNG states) as they are."""
    found: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if hasattr(value, "to_local"):
            found[prefix] = (str(value.placements), tuple(value.shape), value.to_local())
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}/{index}", item)
        else:
            found[prefix] = value

    walk("", torch.load(path, weights_only=False, map_location="cpu"))  # DTensors and RNG states: not weights_only
    return found


def _same_value(mine: Any, expected: Any, what: str) -> int:
    if isinstance(mine, tuple) and len(mine) == 3 and isinstance(mine[2], torch.Tensor):
        assert mine[:2] == expected[:2], f"{what}: placements or shape"
        _bitwise(mine[2], expected[2], what)
        return 1
    if isinstance(mine, torch.Tensor):
        _bitwise(mine, expected, what)
        return 1
    if isinstance(mine, np.ndarray):
        assert np.array_equal(mine, expected), what
        return 0
    assert mine == expected, f"{what}: {mine} != {expected}"
    return 0


def test_verl_checkpoint_manager_files_hold_torch_fsdp1s_tensors(verl_runs: tuple) -> None:
    ours, _, our_dir, their_dir = verl_runs
    compared = 0
    for name in ours.keys() - {HYBRID}:
        for kind in CHECKPOINT_FILES:
            for rank in range(RANKS):
                relative = Path(name) / "checkpoints" / "global_step_3" / f"{kind}_world_size_{RANKS}_rank_{rank}.pt"
                mine, expected = _checkpoint_values(our_dir / relative), _checkpoint_values(their_dir / relative)
                assert mine.keys() == expected.keys(), relative
                for key, value in mine.items():
                    compared += _same_value(value, expected[key], f"{relative}{key}")
    assert compared > 500


def _lora_pairs(base: dict[str, torch.Tensor], merged: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """(base name, merged name) of the weights LoRA adapts: the base export names them `...base_layer.weight`,
    the merged one by the plain module name."""
    return [(key, key.replace(".base_layer.", ".")) for key in base if ".base_layer." in key]


def _consistent(name: str, result: dict, out: Path, rank: int) -> None:
    found = _stages(out, name, rank)
    steps = range(3, 5)
    for step in steps:  # the resumed engine continues as the run without a break (which exported weights between)
        for key, value in _under(found, f"train/step{step}").items():
            assert torch.equal(value, found[f"resumed/step{step}/{key}"]), f"{name}: resumed step {step} {key}"
    final, resumed = _under(found, "final/full"), _under(found, "resumed/full")
    assert final.keys() == resumed.keys() and all(torch.equal(final[k], resumed[k]) for k in final), name
    saved, loaded = _under(found, "reloaded/step2"), _under(found, "loaded/shard")  # the shards at the save
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved), name
    initial = _under(found, "setup/shard")
    assert any(not torch.equal(initial[unit], saved[unit]) for unit in saved), f"{name}: nothing trained"
    norms = [found[f"train/step{step}/grad_norm"].item() for step in range(5)]
    assert all(norm > 0 for norm in norms)
    weights = _under(found, "saved/full")
    if not result["config"]["lora"]:
        assert min(norms) > result["clip"], f"{name}: the full model's steps clip ({norms})"
        if result["reference_offloads"] is not None:  # ours: verl's reference policy, CPUOffload(offload_params=True)
            assert result["reference_offloads"] and all(result["reference_offloads"]), name
            for key in ("log_probs", "entropy"):  # as the actor's before training, which equal torch's FSDP1's
                assert torch.equal(found[f"reference/{key}"], found[f"infer/step0/{key}"]), f"{name}: reference {key}"
        sync, shards = _under(found, "sync"), _under(found, "sync_shard")
        assert list(sync) == result["exported"]["sync"] and sync.keys() == shards.keys() == weights.keys()
        for key, value in sync.items():  # the full weights at the save, and each rank's dim-0 chunk in bf16
            assert torch.equal(value, weights[key]), f"{name}: weight sync {key}"
            shard_ranks = RANKS if result["config"]["fsdp_size"] > 1 else 1  # hybrid: a shard group of one
            chunks = value.to(torch.bfloat16).chunk(shard_ranks, dim=0)
            index = rank % shard_ranks
            local = chunks[index].reshape(-1) if index < len(chunks) else torch.zeros(0, dtype=torch.bfloat16)
            assert torch.equal(shards[key], local), f"{name}: sharded weight sync {key}"
        return
    layered, full = _under(found, "lora_layered"), _under(found, "lora_full")
    assert layered and layered.keys() == full.keys(), name
    assert all(".lora_A." in key or ".lora_B." in key for key in layered), name
    assert all(torch.equal(layered[k], full[k]) for k in layered), f"{name}: layered summon vs full summon"
    base, merged = _under(found, "lora_base"), _under(found, "lora_merged")
    pairs = _lora_pairs(base, merged)
    assert len(pairs) == 14 and len(base) == len(merged), name  # 7 projections in each of the 2 layers
    for base_key, merged_key in pairs:  # merged = base + scaling * B @ A, the adapters the summons exported
        module = "base_model.model." + merged_key.removesuffix(".weight")
        delta = full[f"{module}.lora_B.weight"].float() @ full[f"{module}.lora_A.weight"].float()
        expected = base[base_key].float() + result["lora_scaling"] * delta
        assert delta.abs().max() > 0, f"{name}: {module}'s adapter never trained"
        torch.testing.assert_close(merged[merged_key].float(), expected, rtol=1e-2, atol=1e-3, msg=merged_key)
    for key in set(base) - {b for b, _ in pairs}:  # embeddings, norms, the head: as they are
        assert torch.equal(merged[key], base[key].to(merged[key].dtype)), f"{name}: merged {key}"


def test_verl_stages_agree_among_themselves(verl_runs: tuple) -> None:
    """On ours, and on torch's (so that these checks are known to hold of FSDP1 itself)."""
    ours, theirs, our_dir, their_dir = verl_runs
    assert {run["config"]["use_orig_params"] for run in ours.values()} == {False, True}
    assert {(run["config"]["lora"], run["config"]["use_orig_params"]) for run in ours.values()} >= {
        (True, False),
        (True, True),
    }
    assert all(run["reference_offloads"] for run in ours.values() if not run["config"]["lora"])
    for results, out in ((ours, our_dir), (theirs, their_dir)):
        for name, result in results.items():
            assert any(".lora_" in unit for unit in result["units"]) == result["config"]["lora"], name
            for rank in range(RANKS):
                _consistent(name, result, out, rank)


# HSDP's gradient norm is taken over whole gradients (shard groups of one rank), the FULL_SHARD twin's over two halves
# combined across the ranks: the same value summed in another order, so from the first clipping on the two runs differ
# in fp32's last bits, which Adam's division by the root of the second moment grows for small-gradient entries
# (measured: 1.3e-7 of a tensor's largest value over the 5 steps on one AMD EPYC, 1.3e-6 on the CI machine; equal on
# the machine where the test was written). torch's FSDP1 here trains each replica on its own data: its ranks' norms
# differ by about half, 5e4 times this bound.
HSDP_RTOL = 1e-5


def test_verl_hybrid_shard_trains_as_full_shard_where_torch_fsdp1_trains_replicas_apart(verl_runs: tuple) -> None:
    """verl's fsdp_size=1 on 2 ranks: a (2, 1) mesh, HYBRID_SHARD with shard groups of one rank. torch's FSDP1 clamps
    each unit to NO_SHARD over its one-rank shard group ("switching to use NO_SHARD ... since the world size is 1")
    and so never reduces gradients across the replicas: each rank trains on its own data alone, silently. Ours
    replicates over the replicate group, so the run is the FULL_SHARD run of the same data, which equals torch's
    FSDP1's: bit for bit until the first gradient norm (the first step's losses and figures), then every figure,
    log-probability, full weight, weight sync and resumed step within fp32's rounding of the norm's order."""
    ours, theirs, our_dir, their_dir = verl_runs
    assert ours[HYBRID]["config"]["fsdp_size"] == 1 and ours[FULL_SHARD_TWIN]["config"]["fsdp_size"] == 2
    assert {k: v for k, v in ours[HYBRID]["config"].items() if k not in ("name", "fsdp_size")} == {
        k: v for k, v in ours[FULL_SHARD_TWIN]["config"].items() if k not in ("name", "fsdp_size")
    }
    compared = exact = 0
    for rank in range(RANKS):
        mine, expected = _stages(our_dir, HYBRID, rank), _stages(their_dir, FULL_SHARD_TWIN, rank)
        for key, value in mine.items():
            if key.split("/")[0] not in ("train", "infer", "saved", "sync", "final", "resumed"):
                continue
            what = f"{HYBRID} vs torch's {FULL_SHARD_TWIN}, rank {rank}: {key}"
            if key.startswith(("infer/step0/", "train/step0/")) and not key.endswith("grad_norm"):
                _bitwise(value, expected[key], what)  # before any clipping: the same gradients, summed alike
                exact += 1
            else:
                assert value.dtype == expected[key].dtype and value.shape == expected[key].shape, what
                scale = expected[key].abs().max().item() if expected[key].numel() else 0.0
                off = (value - expected[key]).abs().max().item() if value.numel() else 0.0
                assert off <= HSDP_RTOL * scale, f"{what}: off by {off}, {off / scale:.2e} of its largest value"
            compared += 1
    assert compared > 200 and exact >= 2 * RANKS, (compared, exact)

    def norms(out: Path, rank: int) -> list[float]:
        found = _stages(out, HYBRID, rank)
        return [found[f"train/step{step}/grad_norm"].item() for step in range(5)]

    assert norms(our_dir, 0) == norms(our_dir, 1)
    apart = max(abs(a - b) / b for a, b in zip(norms(their_dir, 0), norms(their_dir, 1), strict=True))
    assert apart > 1000 * HSDP_RTOL, f"torch's FSDP1 reduces across the replicas now ({apart})"
