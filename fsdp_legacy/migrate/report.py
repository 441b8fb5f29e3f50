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

    def format(self, path: str) -> str:
        return f"{path}:{self.line}: {self.what}: {self.why}; fix: {self.fix}"


@dataclass
class MigrationResult:
    """One file's migration: its new text and what is left to a person."""

    source: str
    migrated: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.migrated != self.source

    @property
    def complete(self) -> bool:
        """True when nothing FSDP1 is left for a person."""
        return not self.findings
