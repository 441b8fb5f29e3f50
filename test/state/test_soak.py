"""tools/soak.py, shortened: torchrun --max-restarts on gloo ranks, SIGKILLs of a rank at seeded moments, every restart
resumed from fsdp_legacy.checkpoint.latest(). Oracle: the same schedule run without kills, whose final FULL model and
optimizer state must be equal bit for bit, and whose state at each step (a digest of every rank's flat shards and
optimizer state) every resume must have loaded exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import repo_paths

pytestmark = pytest.mark.heavy  # whole programs in other processes: CI runs them after the README's tests

SOAK = str(repo_paths.TOOLS / "soak.py")


def events(folder) -> list[dict]:
    with open(folder / "events.jsonl") as file:
        return [json.loads(line) for line in file]


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def soak(tmp_path, kills: int, *options: str) -> tuple[list[dict], list[dict]]:
    """Run the soak; check what every test of it holds; the soaked run's kills and starts."""
    command = [sys.executable, SOAK, "--kills", str(kills), "--steps", "8", "--every", "2", *options]
    # Hang guards only (a run takes under a minute on an idle machine): each torchrun, then the whole soak.
    done = subprocess.run(
        [*command, "--workdir", str(tmp_path), "--timeout", "120"], capture_output=True, text=True, timeout=620
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(f"soak: {kills} kills, {kills} restarts, "), output
    assert last.endswith("final state identical: yes"), output

    reference, soaked = events(tmp_path / "reference"), events(tmp_path / "soaked")
    assert all(e["attempt"] == 0 for e in reference if e["event"] == "start"), "the reference ran uninterrupted"
    assert not any(e["event"] == "kill" for e in reference)
    kills_done = [e for e in soaked if e["event"] == "kill"]
    starts = [e for e in soaked if e["event"] == "start"]
    # every kill is followed by one more attempt (one killed while resuming logs its kill, not a start)
    attempts = {(e["phase"], e["attempt"]) for e in (*starts, *kills_done) if e["attempt"] > 0}
    assert len(kills_done) == kills and len(attempts) == kills
    # What the reference held after each number of steps (when it saved, and at its starts), on every rank.
    expected = {(e["world"], e["step"]): e["digests"] for e in reference if e["event"] in ("saved", "start")}
    for start in starts:
        assert start["found"] is None or start["found"] not in {s["path"] for s in start["skipped"]}
        assert start["digests"] == expected[(start["world"], start["step"])], f"resumed {start['found']}: not intact"
    final = [torch.load(tmp_path / run / "final.pt", weights_only=True) for run in ("reference", "soaked")]
    assert equal(final[0], final[1]), "the final parameters and optimizer state, bit for bit"
    assert final[0]["optim"]["state"], "with the optimizer state"
    return kills_done, starts


def test_killed_ranks_resume_to_the_uninterrupted_result(tmp_path) -> None:
    # 2 ranks throughout; seed 5: killed mid-step, then with its rank file half written
    kills, starts = soak(tmp_path, 2, "--nproc", "2", "--first-nproc", "0", "--seed", "5")
    assert [k["moment"] for k in kills] == ["step", "save"]
    skipped = {os.path.basename(s["path"]) for start in starts for s in start["skipped"]}
    assert skipped == {"step_000004.rank-files"}, "the half-written checkpoint was refused"


def test_killed_after_changing_world_size(tmp_path) -> None:
    # steps 0-4 at 4 ranks, 4-8 at 2; seed 3: a rank of 2 killed after its DCP data at step 6, so the restart goes back
    # to the SHARDED checkpoint 4 ranks wrote
    kills, starts = soak(tmp_path, 1, "--nproc", "2", "--first-nproc", "4", "--seed", "3")
    assert [(k["phase"], k["moment"], k["done"]) for k in kills] == [(1, "save", 6)]
    restart = starts[-1]
    assert (restart["world"], os.path.basename(restart["found"])) == (2, "step_000004.dcp-sharded")
    assert [os.path.basename(s["path"]) for s in restart["skipped"]] == ["step_000006.dcp-sharded"]


def test_killed_in_backward_and_inside_the_restarts_load(tmp_path) -> None:
    # seed 20: a rank killed in backward (the later units' reduce-scatters issued), then one killed inside the next
    # attempt's checkpoint load (the attempt logs no start); every restart still loads the reference's state
    kills, starts = soak(tmp_path, 4, "--nproc", "2", "--first-nproc", "0", "--seed", "20")
    assert [k["moment"] for k in kills][:2] == ["backward", "resume"]
    assert kills[1]["detail"] == "inside the checkpoint's load" and kills[1]["attempt"] == 1
    assert 1 not in {start["attempt"] for start in starts}, "the attempt killed while resuming logged no start"
