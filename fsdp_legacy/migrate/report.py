"""What the migration could not map: one finding per construct, worded `file:line: what: why; fix: the manual fix`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Finding:
    """A construct left unchanged (or changed with a caveat) that a person must look at."""

    line: int  # 1-based, in the file as it was read
    what: str
    why: str
    fix: str
    # "unmapped": left as written (or changed with a caveat); "refused": the whole file left as it is (subclasses.py);
    # "internal": FSDP1's private modules, which a person must replace (internals.py)
    kind: str = "unmapped"

    def format(self, path: str) -> str:
        return f"{path}:{self.line}: {self.what}: {self.why}; fix: {self.fix}"


@dataclass
class MigrationResult:
    """One file's migration: its new text and what is left to a person."""

    source: str
    migrated: str
    findings: list[Finding] = field(default_factory=list)
    # for the files migrated with it (program.py): the lines of the FSDP(...) calls left FSDP1, and the names of the
    # module-level MixedPrecision policies left FSDP1
    fsdp1_constructions: frozenset[int] = frozenset()
    fsdp1_policies: frozenset[str] = frozenset()
    # the FSDP1 keywords some construction that became fully_shard reads at run time (`mixed_precision`,
    # `auto_wrap_policy`...): the values of those kinds the other files build may be what it reads
    run_time_reads: frozenset[str] = frozenset()

    @property
    def changed(self) -> bool:
        return self.migrated != self.source

    @property
    def complete(self) -> bool:
        """True when nothing FSDP1 is left for a person."""
        return not self.findings
