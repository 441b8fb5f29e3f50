"""A fuzzing campaign: seeded cases (a format, a mutation of a fresh copy of its intact checkpoint), every reader run
on each copy (readers.py) and each run classified against what the same reader gives on the intact checkpoint:

    clean error   exit 1 or 2 with its one-line error (latest(): the copy skipped)
    same result   exit 0 and the same listing or the same converted tensors: the mutation was harmless
    silent wrong  exit 0 and a different result, or a result where `convert --to full` refused the same copy
    traceback     a Python traceback, or the command's catch-all for an exception no check foresaw
    crash         a signal, or another exit code
    hang          the timeout
    code ran      the hostile pickle's marker appeared

A case's id is `SEED:INDEX`: the index picks the format (in turn), the seed and index seed the mutation, so an id
reruns one case exactly."""

from __future__ import annotations

import os
import random
import shutil
import signal
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .mutations import KINDS, Source
from .readers import DIRECTORY_ONLY, READERS, Limits, Ran, preload, reader_body, result_of, run_forked
from .regions import files_of, regions_of
from .sources import FORMATS, SAVES

OUTCOMES = ("clean error", "same result", "silent wrong", "traceback", "crash", "hang", "code ran")
FAILURES = ("traceback", "crash", "hang", "code ran")  # a defect in any format
_CATCH_ALL = "a case fsdp_legacy's checks missed"  # cli/main.py's line for an exception no check foresaw


@dataclass(frozen=True)
class Verdict:
    reader: str
    outcome: str
    detail: str
    seconds: float


@dataclass(frozen=True)
class CaseResult:
    id: str
    format: str
    kind: str
    mutation: str
    verdicts: tuple[Verdict, ...]

    def defects(self) -> list[Verdict]:
        sealed = FORMATS[self.format]
        return [v for v in self.verdicts if v.outcome in FAILURES or (v.outcome == "silent wrong" and sealed)]


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:400] if lines else ""


def _differences(found: dict[str, str], expected: dict[str, str]) -> str:
    keys = sorted(set(found) | set(expected))
    differ = [k for k in keys if found.get(k) != expected.get(k)]
    shown = "; ".join(f"{k}: {expected.get(k, '(absent)')} -> {found.get(k, '(absent)')}" for k in differ[:3])
    return f"{len(differ)} entries differ from the intact result: {shown}"


class Campaign:
    """Fuzzing of the checkpoints under `sources` (sources.write_sources), in the scratch folder `work`."""

    def __init__(self, sources: Path, work: Path, limits: Limits | None = None) -> None:
        self.work, self.limits = work, limits or Limits()
        self.root, self.out, self.marker = work / "root", work / "out", work / "marker"
        self.sources = {
            name: Source(
                name, sources / SAVES[0] / name, sources / SAVES[1] / name, tuple(regions_of(sources / SAVES[0] / name))
            )
            for name in FORMATS
        }
        self.baseline: dict[tuple[str, str], dict[str, str]] = {}
        preload()
        for name in FORMATS:
            checkpoint = self._fresh_copy(self.sources[name])
            for reader in self.readers_of(name):
                ran = self._run(reader, checkpoint)
                if ran.exit_code != 0:
                    raise RuntimeError(f"{reader} fails on the intact {name}: {ran.stderr.strip()[-2000:]}")
                self.baseline[name, reader] = result_of(reader, ran, self.out)

    @staticmethod
    def readers_of(name: str) -> tuple[str, ...]:
        directory = name != "full.pt"
        return tuple(r for r in READERS if directory or r not in DIRECTORY_ONLY)

    # ----------------------------------------------------------------------------------------------------------------

    def _fresh_copy(self, source: Source) -> Path:
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        target = self.root / source.name
        (shutil.copytree if source.intact.is_dir() else shutil.copy2)(source.intact, target)
        return target

    def _keep_times(self, source: Source, copy: Path) -> None:
        """Every file's modification time as the intact one's (latest() orders per-rank files by them), so that a
        listing differs only by what the mutation changed."""
        stamp = max(os.stat(source.intact / f if f else source.intact).st_mtime for f in files_of(source.intact))
        for file in files_of(copy) if copy.exists() else []:
            original = source.intact / file if file else source.intact
            when = os.stat(original).st_mtime if original.exists() else stamp
            os.utime(copy / file if file else copy, (when, when))

    def _run(self, reader: str, checkpoint: Path) -> Ran:
        shutil.rmtree(self.out, ignore_errors=True)
        self.out.mkdir(parents=True)
        return run_forked(reader_body(reader, checkpoint, self.out), self.work, self.limits)

    def plan(self, seed: int, index: int) -> tuple[Source, random.Random]:
        name = list(FORMATS)[index % len(FORMATS)]
        return self.sources[name], random.Random(f"{seed}:{index}")

    def run_case(self, seed: int, index: int, only: str | None = None) -> CaseResult:
        """Case `index` of `seed`: a mutation of a kind drawn from those that apply (or the kind named `only`)."""
        source, rng = self.plan(seed, index)
        kinds = [k for k in KINDS if k.applies(source) and only in (None, k.name)]
        if not kinds:
            raise ValueError(f"no mutation {only!r} applies to {source.name}")
        kind = rng.choice(kinds)
        copy = self._fresh_copy(source)
        shutil.rmtree(self.marker, ignore_errors=True)
        mutation = kind.mutate(copy, source, rng, self.marker)
        self._keep_times(source, copy)
        verdicts = [self._judge(source.name, reader, copy) for reader in self.readers_of(source.name)]
        return CaseResult(f"{seed}:{index}", source.name, kind.name, mutation, tuple(_cross_checked(verdicts)))

    def _judge(self, name: str, reader: str, checkpoint: Path) -> Verdict:
        ran = self._run(reader, checkpoint)
        outcome, detail = self._classify(name, reader, ran)
        shutil.rmtree(self.marker, ignore_errors=True)
        return Verdict(reader, outcome, detail, ran.seconds)

    def _classify(self, name: str, reader: str, ran: Ran) -> tuple[str, str]:
        judged = outcome_of(ran, self.marker.exists(), self.limits)
        if judged is not None:
            return judged
        try:
            found = result_of(reader, ran, self.out)
        except Exception as error:  # (what it wrote cannot be read back)
            return "silent wrong", f"exit 0, but its output cannot be read: {type(error).__name__}: {error}"
        expected = self.baseline[name, reader]
        return ("same result", "") if found == expected else ("silent wrong", _differences(found, expected))


def outcome_of(ran: Ran, code_ran: bool, limits: Limits) -> tuple[str, str] | None:
    """The outcome of a run and its detail, or None where it exited 0 (its result is then compared)."""
    if code_ran:
        return "code ran", "the hostile pickle's marker was made"
    if ran.timed_out:
        return "hang", f"still running after {limits.timeout_s:g} s"
    if ran.signal is not None:
        return "crash", f"killed by {signal.Signals(ran.signal).name}: {_last_line(ran.stderr)}"
    if "Traceback (most recent call last)" in ran.stderr or _CATCH_ALL in ran.stderr:
        return "traceback", _last_line(ran.stderr)
    if ran.exit_code in (1, 2):
        return "clean error", _last_line(ran.stderr) or _last_line(ran.stdout) or f"exit {ran.exit_code}"
    if ran.exit_code != 0:
        return "crash", f"exit code {ran.exit_code}: {_last_line(ran.stderr)}"
    return None


def _cross_checked(verdicts: list[Verdict]) -> Iterable[Verdict]:
    """A reader that accepts a copy unchanged where `convert --to full` refuses it has not checked what the converter
    does (every reader promises the same checks): silent wrong."""
    refusal = next((v for v in verdicts if v.reader == "convert --to full" and v.outcome == "clean error"), None)
    for verdict in verdicts:
        if refusal is not None and verdict.outcome == "same result":
            detail = f"exit 0 with the intact result, but convert --to full refuses the copy: {refusal.detail}"
            yield Verdict(verdict.reader, "silent wrong", detail, verdict.seconds)
        else:
            yield verdict


def table(results: Iterable[CaseResult]) -> str:
    """Reader runs by format and outcome, as a Markdown table."""
    counts: Counter[tuple[str, str]] = Counter()
    cases: Counter[str] = Counter()
    for result in results:
        cases[result.format] += 1
        for verdict in result.verdicts:
            counts[result.format, verdict.outcome] += 1
    rows = ["| format (cases) | " + " | ".join(OUTCOMES) + " |", "|---" * (len(OUTCOMES) + 1) + "|"]
    for name in FORMATS:
        if cases[name]:
            cells = " | ".join(str(counts[name, outcome]) for outcome in OUTCOMES)
            sealed = "" if FORMATS[name] else ", unsealed"
            rows.append(f"| {name} ({cases[name]}{sealed}) | {cells} |")
    totals = " | ".join(str(sum(counts[n, o] for n in FORMATS)) for o in OUTCOMES)
    rows.append(f"| all ({sum(cases.values())}) | {totals} |")
    return "\n".join(rows)
