"""What a reader verified of what a checkpoint's writer sealed, and what it could not verify, in words: the converter
and `fsdp-legacy inspect` check every seal a format carries before they report or convert anything, and say which
parts of the checkpoint carried none (torch's plain dcp.save, safetensors written by other tools).

Seals by format (docs/failures.md, "What each format's seals guarantee"):
  our safetensors    per-tensor and whole-data CRC-32s and a CRC-32 over the header, in `__metadata__`; a save id
  our DCP            the side file: a CRC-32 of every file (`.metadata` included) and of itself, the save id stamped
                     in every data file
  plain dcp.save     none of its own: each item's torch.save CRC-32s, and its dtype and shape against `.metadata`
  torch.save files   the archive's per-record CRC-32s; per-rank LOCAL files also the layout records' save ids
"""

from collections.abc import Iterable
from dataclasses import dataclass

ARCHIVE = "CRC-32s of every record of the torch.save archive"  # what the readers of one torch.save file check


@dataclass(frozen=True)
class Seals:
    verified: tuple[str, ...] = ()  # what was checked and held, in words
    unverified: tuple[str, ...] = ()  # what carries no seal to check, in words

    def __add__(self, other: "Seals") -> "Seals":
        return Seals(_unique((*self.verified, *other.verified)), _unique((*self.unverified, *other.unverified)))

    def line(self) -> str:
        """One line for a report: what was verified, then what could not be."""
        checked = "; ".join(self.verified) or "nothing (the format carries no seal)"
        missing = f"; not verifiable: {'; '.join(self.unverified)}" if self.unverified else ""
        return f"{checked}{missing}"


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def combined(found: Iterable[Seals]) -> Seals:
    total = Seals()
    for seals in found:
        total = total + seals
    return total
