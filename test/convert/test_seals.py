"""Every reader checks every seal the writer made before it reports or converts: one flipped bit in the data of any
format we write gives one line naming the file (and the tensor, where the format can tell) and a failure exit code,
from `inspect`, `inspect --json`, `convert --to full` and `convert --to safetensors`; header edits of our safetensors
are refused by their header seal; intact, each says what it verified and what the format carries no seal for.

Checkpoints are saved here by 2 gloo ranks with our savers (save_full_model in one file and sharded,
dcp_checkpoint.save of SHARDED state with the optimizer, a plain dcp.save, per-rank LOCAL torch.save files, a full
torch.save file). Oracles: the FULL model state dict (a conversion of the intact checkpoint equals it), and the damage
each test made, located by parsing the formats independently (damage.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from damage import (
    data_record_offset,
    flip_bit,
    flip_in_item,
    largest_tensor,
    pickle_offset,
    rewrite_safetensors_header,
    safetensors_header,
    tensors_holding,
)
from test_optim_state import adam, model_sd, osd, train

import fsdp_legacy
from cli_runner import run_cli
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import StateDictType
from fsdp_legacy.checkpoint import save_full_model
from fsdp_legacy.state import dcp_checkpoint
from fsdp_utils import Config, build_ours
from harness import run_on_ranks

CONFIG = Config("net", "FULL_SHARD")
SOURCES = ("full_one", "full_sharded", "dcp_sealed", "dcp_plain", "ranks", "full.pt")


def _save(root: str) -> dict[str, torch.Tensor]:
    model = build_ours(CONFIG)[1]
    optim = adam(model)
    train(model, optim, CONFIG, range(1))
    save_full_model(model, os.path.join(root, "full_one"))
    save_full_model(model, os.path.join(root, "full_sharded"), max_shard_size=64)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp_checkpoint.save(state, os.path.join(root, "dcp_sealed"))
        dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(root, "dcp_plain"))
    local = model_sd(model, fsdp_legacy, "LOCAL_STATE_DICT")
    torch.save(local, os.path.join(root, "ranks", f"rank{dist.get_rank()}.pt"))
    full = model_sd(model, fsdp_legacy, "FULL_STATE_DICT")
    optim_full = osd(model, optim, fsdp_legacy, "FULL_STATE_DICT")
    if dist.get_rank() == 0:
        torch.save({"model": full, "optim": optim_full}, os.path.join(root, "full.pt"))
    return full


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("seals")
    (root / "ranks").mkdir()
    return root, run_on_ranks(_save, 2, str(root))[0]


def copy_of(saved: tuple[Path, dict], name: str, tmp_path: Path) -> Path:
    source = saved[0] / name
    target = tmp_path / name
    (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
    return target


def readers(source: Path, out: Path) -> dict[str, tuple[str, ...]]:
    return {
        "inspect": ("inspect", str(source)),
        "inspect --json": ("inspect", str(source), "--json"),
        "convert --to full": ("convert", str(source), str(out / "out.pt"), "--to", "full", "--quiet"),
        "convert --to safetensors": ("convert", str(source), str(out / "hf"), "--to", "safetensors", "--quiet"),
    }


def assert_one_line(done: subprocess.CompletedProcess, pattern: str, what: str) -> None:
    """A failure exit code and one line of error that matches `pattern`: no traceback, no output, and not the
    catch-all for a case no check foresaw."""
    err = done.stderr
    assert done.returncode in (1, 2), f"{what}: exit {done.returncode}: {done.stdout}{err}"
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and not done.stdout, f"{what}: {err}"
    assert "unexpected" not in err and re.search(pattern, err), f"{what}: {err}"


def assert_refused_by_every_reader(source: Path, out: Path, pattern: str) -> None:
    for name, argv in readers(source, out).items():
        assert_one_line(run_cli(*argv), pattern, name)
        assert not (out / "out.pt").exists() and not (out / "hf").exists(), f"{name} wrote output"


# --------------------------------------------------------------------------------------------------------------------
# Intact: what was verified


@pytest.mark.parametrize("name", SOURCES)
def test_intact_checkpoints_say_what_was_verified(saved: tuple[Path, dict], tmp_path: Path, name: str) -> None:
    """Every reader succeeds; inspect lists what it verified and what carries no seal, the conversion says the same
    and equals the saving model's FULL state dict bit for bit."""
    source, expected = saved[0] / name, saved[1]
    found = run_cli("inspect", str(source), "--json")
    assert found.returncode == 0, found.stderr
    body = json.loads(found.stdout)
    verified, unverified = " | ".join(body["verified"]), " | ".join(body["not_verified"])
    if name.startswith("full_"):
        assert "CRC-32 of every tensor's data" in verified and "CRC-32 of every header" in verified
        assert "one save" in verified and not unverified
    elif name == "dcp_sealed":
        assert "CRC-32 of every file (.fsdp_legacy.json)" in verified and not unverified
    elif name == "dcp_plain":
        assert "CRC-32s of every item's torch.save archive" in verified and "dtype and shape" in verified
        assert "no .fsdp_legacy.json" in unverified
    elif name == "ranks":
        assert "CRC-32s of every rank's torch.save archive" in verified and "one save" in verified
    else:
        assert "CRC-32s of every record of the torch.save archive" in verified
    done = run_cli("convert", str(source), str(tmp_path / "out.pt"), "--to", "full", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "verified bit for bit against the source" in done.stdout
    assert f"  source checked: {'; '.join(body['verified'])}" in done.stdout.splitlines(), done.stdout
    model = torch.load(tmp_path / "out.pt", weights_only=True)["model"]
    assert model.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(model[key].view(torch.uint8), value.view(torch.uint8)), key


def test_the_converters_safetensors_are_sealed(saved: tuple[Path, dict], tmp_path: Path) -> None:
    """`convert --to safetensors` seals what it writes as save_full_model does: a bit flipped in its output is named
    by file and tensor."""
    out = tmp_path / "hf"
    assert run_cli("convert", str(saved[0] / "full.pt"), str(out), "--to", "safetensors", "--quiet").returncode == 0
    metadata = safetensors_header(str(out / "model.safetensors"))[0]["__metadata__"]
    assert {"fsdp_legacy_data_crc32", "fsdp_legacy_tensor_crc32", "fsdp_legacy_header_crc32"} <= metadata.keys()
    name, start = largest_tensor(str(out / "model.safetensors"))
    flip_bit(str(out / "model.safetensors"), start, 3)
    done = run_cli("inspect", str(out))
    assert_one_line(done, rf"model\.safetensors: the data of {re.escape(name)} does not match the CRC-32", "inspect")


# --------------------------------------------------------------------------------------------------------------------
# One flipped bit of data


def _flip_data(source: Path, name: str) -> str:
    """Flip one bit in a tensor's data; the pattern the error must match (the file, and the tensor where it can be
    named)."""
    if name.startswith("full_"):
        files = sorted(f for f in os.listdir(source) if f.endswith(".safetensors"))
        file = str(source / files[-1])
        tensor, start = largest_tensor(file)
        flip_bit(file, start, 5)
        return rf"{re.escape(file)}: the data of {re.escape(tensor)} does not match the CRC-32"
    if name.startswith("dcp_"):
        file = flip_in_item(str(source), "model.block.fc2.weight")
        return rf"{re.escape(file)} \(the item of model\.block\.fc2\.weight at byte \d+\) is corrupted"
    file = str(source / "rank1.pt") if name == "ranks" else str(source)
    with open(file, "rb") as handle:
        record, start = data_record_offset(handle.read(), 16)
    holding = "|".join(map(re.escape, tensors_holding(file, record))) if name == "full.pt" else r"\S+"
    assert holding, "the record holds a tensor of the file"
    flip_bit(file, start)
    return (
        rf"{re.escape(file)} is corrupted: its record {re.escape(repr(record))} \(the data of ({holding})\) does "
        "not match the CRC-32"
    )


@pytest.mark.parametrize("name", SOURCES)
def test_a_flipped_data_bit_is_named_by_every_reader(saved: tuple[Path, dict], tmp_path: Path, name: str) -> None:
    source = copy_of(saved, name, tmp_path)
    pattern = _flip_data(source, name)
    assert_refused_by_every_reader(source, tmp_path, pattern)


def test_a_rank_file_damaged_in_place_is_damaged_not_missing(saved: tuple[Path, dict], tmp_path: Path) -> None:
    """rank1.pt damaged three ways in place (a data bit, a bit of 'ShardedTensor' in its pickle, its first byte):
    convert and inspect say it is damaged and name it; none says a rank is missing."""
    for damage in ("data", "pickle", "first byte"):
        source = tmp_path / damage
        shutil.copytree(saved[0] / "ranks", source)
        file = str(source / "rank1.pt")
        with open(file, "rb") as handle:
            archive = handle.read()
        offset = {
            "data": data_record_offset(archive, 16)[1],
            "pickle": pickle_offset(archive, b"ShardedTensor") + 3,
            "first byte": 0,
        }[damage]
        flip_bit(file, offset, 1)
        for reader in ("inspect", "convert --to full"):
            done = run_cli(*readers(source, tmp_path)[reader])
            assert_one_line(done, rf"per-rank files is there but damaged: {re.escape(file)}", f"{damage}: {reader}")
            assert "missing" not in done.stderr, done.stderr


# --------------------------------------------------------------------------------------------------------------------
# The safetensors header's seal


def test_header_edits_are_refused_by_its_seal(saved: tuple[Path, dict], tmp_path: Path) -> None:
    """A bit flipped in a tensor's name (weight -> wmight), a shape permuted (same byte count: the header stays
    consistent with the file), a seal's own key damaged: every reader refuses the file with one line."""
    sealed = r"its header \(tensor names, dtypes, shapes, offsets or metadata\) does not match the CRC-32 seal"
    for case in ("renamed", "permuted", "seal key"):
        source = copy_of(saved, "full_one", tmp_path / case)
        file = str(source / "model.safetensors")
        header, data_start = safetensors_header(file)
        if case == "renamed":
            with open(file, "rb") as handle:
                at = handle.read(data_start).index(b'"block.fc2.weight"') + len('"block.fc2.w')
            flip_bit(file, at, 3)  # 'e' -> 'm'
            pattern = sealed
        elif case == "permuted":
            key = next(k for k, v in header.items() if k != "__metadata__" and len(set(v["shape"])) == 2)
            rewrite_safetensors_header(file, lambda h, k=key: h[k].update(shape=h[k]["shape"][::-1]))
            pattern = sealed
        else:
            rewrite_safetensors_header(
                file,
                lambda h: h["__metadata__"].update(
                    fsdp_legacy_header_crc33=h["__metadata__"].pop("fsdp_legacy_header_crc32")
                ),
            )
            pattern = "header's seals .* are incomplete"
        assert_refused_by_every_reader(source, tmp_path / case, pattern)


def test_a_header_without_its_seal_is_read_and_said_unsealed(saved: tuple[Path, dict], tmp_path: Path) -> None:
    """A file as earlier versions wrote it (the data CRC-32, no per-tensor CRC-32s or header seal) is read, and
    reported as header-unsealed by inspect and convert."""
    source = copy_of(saved, "full_one", tmp_path)

    def unseal(header: dict) -> None:
        del header["__metadata__"]["fsdp_legacy_header_crc32"], header["__metadata__"]["fsdp_legacy_tensor_crc32"]

    rewrite_safetensors_header(str(source / "model.safetensors"), unseal)
    done = run_cli("inspect", str(source), "--json")
    assert done.returncode == 0, done.stderr
    assert '"header-unsealed: tensor names, dtypes and shapes' in done.stdout
    assert "CRC-32 of every file's data (in its header)" in done.stdout
    done = run_cli("convert", str(source), str(tmp_path / "out.pt"), "--to", "full", "--quiet")
    assert done.returncode == 0 and "  not verifiable in the source: header-unsealed" in done.stdout, done.stdout
