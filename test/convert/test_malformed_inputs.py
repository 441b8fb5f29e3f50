"""One line and exit 1 or 2, never a traceback, for the malformed inputs issue 43 lists, fed to every reader:
`inspect`, `inspect --json`, `convert --to full`, `convert --to safetensors`, `checkpoint.latest()` and
`inspect --latest`. Each class of input is made from a checkpoint our savers wrote (test_seals.py's fixture) and
edited the way the issue found it crashing or misread: bytes appended to the side file, an impossible `saved_at`,
hostile values of DCP's own allowlisted metadata classes, a size its chunks no longer tile, an item of another dtype
than `.metadata` declares, junk `planner_data`. Oracle: the edit each case made (the error must name it), and the
intact copy, which every reader accepts."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from damage import dcp_items, rewrite_metadata, set_record_field
from test_seals import assert_one_line, readers, saved  # noqa: F401  (saved: the module's checkpoints)

from cli_runner import run_cli
from fsdp_legacy.checkpoint import latest
from fsdp_legacy.state.latest import search

SIDE = ".fsdp_legacy.json"
DAMAGED_METADATA = r"\.metadata is damaged: "


def _append_byte(directory: Path) -> None:
    with open(directory / SIDE, "ab") as file:
        file.write(b"\xff")


def _saved_at(value: Any) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:  # as an earlier version wrote it: no checksum of its own to break first
        body = json.loads((directory / SIDE).read_text())
        body.pop("checksum")
        body["saved_at"] = value
        (directory / SIDE).write_text(json.dumps(body))

    return edit


def _recorded_crc_changed(directory: Path) -> None:
    """One recorded CRC-32 changed by one, the side file otherwise intact (its own checksum now stale)."""
    body = json.loads((directory / SIDE).read_text())
    name = sorted(body["files"])[0]
    body["files"][name] ^= 1
    (directory / SIDE).write_text(json.dumps(body))


def _metadata(edit: Callable[[Any], None]) -> Callable[[Path], None]:
    return lambda directory: rewrite_metadata(str(directory), edit)


def _chunks_none(metadata: Any) -> None:
    metadata.state_dict_metadata["model.block.fc2.weight"].chunks = None


def _list_for_dict(metadata: Any) -> None:
    metadata.storage_data = list(metadata.storage_data.values())


def _transposed_size(metadata: Any) -> None:
    entry = metadata.state_dict_metadata["model.block.fc2.weight"]  # 3 x 5, one chunk of 3 x 5
    entry.size = torch.Size(reversed(entry.size))


def _declared_uint8(metadata: Any) -> None:
    metadata.state_dict_metadata["model.block.fc2.weight"].properties.dtype = torch.uint8


def _junk_planner_data(metadata: Any) -> None:
    metadata.planner_data = {key: ("model", *path) for key, path in metadata.planner_data.items()}


def _side_file_deleted(directory: Path) -> None:
    os.remove(directory / SIDE)


def _rank_deleted(directory: Path) -> None:
    os.remove(directory / "rank1.pt")


def _record_field(file: str, field: str, value: int) -> Callable[[Path], None]:
    """A torch.save archive whose first record's entry names a compression method zipfile lacks, or says it is
    encrypted: what one flipped bit in a zip header can do (zipfile raises NotImplementedError, RuntimeError)."""

    def edit(directory: Path) -> None:
        if file == "item":  # the item of one tensor of a DCP directory: an archive inside a data file
            name, offset, length = dcp_items(str(directory))["model.block.fc2.weight"]
            path = directory / name
            raw = path.read_bytes()
            (directory / "item").write_bytes(raw[offset : offset + length])
            set_record_field(str(directory / "item"), field, value)
            path.write_bytes(raw[:offset] + (directory / "item").read_bytes() + raw[offset + length :])
            os.remove(directory / "item")
        else:
            set_record_field(str(directory / file), field, value)

    return edit


UNREADABLE = r"is not a readable torch\.save archive \(({})\)"

# (source, edit, a pattern of the one line that must say what is wrong)
CASES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "side file + one byte": ("dcp_sealed", _append_byte, rf"{SIDE} is damaged"),
    "side file, a recorded CRC-32 changed": (
        "dcp_sealed",
        _recorded_crc_changed,
        rf"{SIDE} is damaged: its content does not match the CRC-32 it records of itself",
    ),
    "saved_at 1e300": ("dcp_sealed", _saved_at(1e300), r"records the save time 1e\+300, which is not a time"),
    "saved_at 2**63": ("dcp_sealed", _saved_at(2**63), f"records the save time {2**63}, which is not a time"),
    "chunk list of None": (
        "dcp_plain",
        _metadata(_chunks_none),
        DAMAGED_METADATA + r"the chunks of model\.block\.fc2\.weight are a NoneType, not a list",
    ),
    "a list where a dict belongs": (
        "dcp_plain",
        _metadata(_list_for_dict),
        DAMAGED_METADATA + "its storage_data is a list, not a dict",
    ),
    "size its chunks do not tile": (
        "dcp_plain",
        _metadata(_transposed_size),
        DAMAGED_METADATA + r"chunk \d of model\.block\.fc2\.weight at .* lies outside its size \(5, 3\)",
    ),
    "item of another dtype": (
        "dcp_plain",
        _metadata(_declared_uint8),
        r"the item of model\.block\.fc2\.weight at offset \d+ holds torch\.float32 data, but \.metadata declares "
        r"torch\.uint8",
    ),
    "the side file deleted": (  # read as a plain dcp.save, it would lose every check of its saver
        "dcp_sealed",
        _side_file_deleted,
        rf"was being saved through fsdp_legacy\.dcp_checkpoint\.save, which writes {SIDE} .* but it has none",
    ),
    "a rank's file deleted": ("ranks", _rank_deleted, r"the file of rank\(s\) \[1\] is missing"),
    "an item's record of an unknown compression method": (
        "dcp_plain",
        _record_field("item", "method", 99),
        UNREADABLE.format("That compression method is not supported"),
    ),
    "a rank file's record marked encrypted": (
        "ranks",
        _record_field("rank1.pt", "flags", 0x09),
        r"per-rank files is there but damaged: .*rank1\.pt.* " + UNREADABLE.format(".*password required.*"),
    ),
    "junk planner_data": (
        "dcp_plain",
        _metadata(_junk_planner_data),
        DAMAGED_METADATA + r"its planner_data maps model\.\S+ to the path 'model\.model\.",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_one_line_from_every_reader(saved: tuple[Path, dict], tmp_path: Path, case: str) -> None:  # noqa: F811
    name, edit, pattern = CASES[case]
    root = tmp_path / "root"
    source = root / name
    shutil.copytree(saved[0] / name, source)
    edit(source)
    for reader, argv in readers(source, tmp_path).items():
        assert_one_line(run_cli(*argv), pattern, f"{case}: {reader}")
    found, skipped = search(str(root))
    assert found is None and latest(str(root)) is None, found
    assert [s.path for s in skipped] == [str(source)] and re.search(pattern, skipped[0].reason), skipped
    done = run_cli("inspect", "--latest", str(root))
    assert done.returncode == 1 and "Traceback" not in done.stderr and "unexpected" not in done.stderr, done.stderr
    assert done.stdout.splitlines()[-1].startswith(f"  skipped:     {source}: "), done.stdout


def test_intact_copies_are_read(saved: tuple[Path, dict], tmp_path: Path) -> None:  # noqa: F811
    """The sources of the cases above, unedited, pass every reader and latest()."""
    for name in ("dcp_sealed", "dcp_plain"):
        root, out = tmp_path / name, tmp_path / f"{name}-out"
        shutil.copytree(saved[0] / name, root / name)
        out.mkdir()
        for reader, argv in readers(root / name, out).items():
            done = run_cli(*argv)
            assert done.returncode == 0, f"{name}: {reader}: {done.stderr}"
        found = latest(str(root))
        assert found is not None and found.path == str(root / name), found
        assert os.path.exists(out / "out.pt") and os.path.exists(out / "hf" / "model.safetensors")
