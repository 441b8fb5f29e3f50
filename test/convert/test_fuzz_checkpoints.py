"""tools/fuzz_checkpoints.py, the fuzzer of issue 43: its forked runs are classified as they happened (code run by a
pickle, a hang, a crash, a traceback, the memory and file-size limits enforced), and a campaign of a few hundred seeded
cases over every format our savers write finds no defect: no silent wrong result in a format we seal, and no
traceback, crash, hang or code run in any format. Oracles: what each run did (a marker the pickle makes, the signal,
the timeout), and each reader's result on the intact checkpoint."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import repo_paths

sys.path.insert(0, str(repo_paths.TOOLS))

from checkpoint_fuzz.campaign import Campaign, outcome_of, table
from checkpoint_fuzz.hostile import code_pickles
from checkpoint_fuzz.readers import Limits, run_forked
from checkpoint_fuzz.sources import FORMATS, write_sources

LIMITS = Limits(timeout_s=3.0, memory_bytes=1 << 30, file_bytes=1 << 20)


def _outcome(body, tmp_path: Path, marker: Path | None = None) -> tuple[str, str] | None:
    ran = run_forked(body, tmp_path, LIMITS)
    return outcome_of(ran, marker is not None and marker.exists(), LIMITS)


@pytest.mark.parametrize("kind", ["posix.mkdir", "builtins.exec", "a state dict holding builtins.eval"])
def test_a_pickle_that_runs_code_is_seen(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "marker"
    payload = code_pickles(marker)[kind]
    found = _outcome(lambda: (pickle.loads(payload), 0)[1], tmp_path, marker)
    assert found is not None and found[0] == "code ran", found
    assert marker.is_dir()


def test_hangs_crashes_tracebacks_and_limits(tmp_path: Path) -> None:
    started = time.monotonic()
    assert _outcome(lambda: (time.sleep(60), 0)[1], tmp_path) == ("hang", "still running after 3 s")
    assert time.monotonic() - started < 10
    found = _outcome(lambda: (os.kill(os.getpid(), signal.SIGSEGV), 0)[1], tmp_path)
    assert found is not None and found[0] == "crash" and "SIGSEGV" in found[1], found
    found = _outcome(lambda: 1 // 0, tmp_path)
    assert found == ("traceback", "ZeroDivisionError: integer division or modulo by zero"), found
    found = _outcome(lambda: int(torch.empty(4 << 30, dtype=torch.uint8).sum()), tmp_path)  # past RLIMIT_AS
    assert found is not None and found[0] == "traceback" and "alloc" in found[1].lower(), found

    def too_large() -> int:
        (tmp_path / "big").write_bytes(bytes(2 << 20))  # past RLIMIT_FSIZE: EFBIG, not SIGXFSZ
        return 0

    found = _outcome(too_large, tmp_path)
    assert found is not None and found[0] == "traceback" and "File too large" in found[1], found
    assert (tmp_path / "big").stat().st_size <= LIMITS.file_bytes
    assert _outcome(lambda: 2, tmp_path) == ("clean error", "exit 2")
    assert _outcome(lambda: 0, tmp_path) is None


@pytest.mark.heavy  # 15 cases per format, about a minute on 2 CPU cores (longer: tools/fuzz_checkpoints.py)
def test_a_campaign_finds_no_defect(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    write_sources(tmp_path / "sources")
    campaign = Campaign(tmp_path / "sources", tmp_path / "work")
    seed, cases = 43, 15 * len(FORMATS)
    results = [campaign.run_case(seed, index) for index in range(cases)]
    report = table(results)
    defects = [
        f"case {r.id} ({r.format}: {r.mutation}): {v.reader}: {v.outcome}: {v.detail}"
        for r in results
        for v in r.defects()
    ]
    assert not defects, report + "\n" + "\n".join(defects)
    outcomes = {v.outcome for r in results for v in r.verdicts}
    assert "clean error" in outcomes and "same result" in outcomes, report  # the mutations reach the readers
    assert {r.format for r in results} == set(FORMATS)
    assert len({r.kind for r in results}) >= 12, report  # every kind of mutation was drawn
    again = campaign.run_case(seed, 5)  # an id reruns its case exactly
    assert (again.mutation, again.verdicts[0].outcome) == (results[5].mutation, results[5].verdicts[0].outcome)
    # torch.save's tensor rebuilds given arguments no save writes, once in each format whose archives can be rebuilt
    archives = [index for index, name in enumerate(FORMATS) if name.startswith("dcp") or name == "full.pt"]
    rebuilt = [campaign.run_case(seed, index, only="hostile rebuild") for index in archives]
    report = table(rebuilt)
    assert not [v for r in rebuilt for v in r.defects()], report
    assert {r.format for r in rebuilt if any(v.outcome == "clean error" for v in r.verdicts)} == {
        list(FORMATS)[index] for index in archives
    }, report
