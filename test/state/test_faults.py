"""Faults and bad files: a save that fails anywhere (a missing, occupied or unwritable destination, a full disk, a file
size limit, a failure on another rank, a rank killed mid-write) raises the same error on every surviving rank within a
deadline and leaves the previous checkpoint intact bit for bit; a damaged or mixed checkpoint is refused on every rank
before anything of it reaches the model; a killed save's temporary is removed by the next save.

Oracles: torch.save's error for a missing directory, the safetensors package's verdict on each damaged file,
nn.Module.load_state_dict's missing and unexpected keys, the bytes of the previous checkpoint, the kernel's own EFBIG
(RLIMIT_FSIZE) for a full disk.
"""

import contextlib
import errno
import glob
import json
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from test_checkpoint_safety import _save_rank_files

import harness
import models
import repo_paths
from fsdp_legacy import safetensors_format
from fsdp_legacy.checkpoint import load_full_model, save_full_model
from fsdp_legacy.convert import CheckpointError, convert_checkpoint
from fsdp_legacy.convert import atomic as atomic_module
from fsdp_legacy.handle import FlatParamHandle
from fsdp_legacy.state import hf_checkpoint, peers
from fsdp_utils import Config, build_ours, full_params
from harness import RankError, run_on_ranks

CONFIG = Config("transformer", steps=1)
DEADLINE = 90.0  # seconds a faulty save may take on every rank before the test calls it a hang
REPO = str(repo_paths.REPO)


def snapshot(directory: str) -> dict[str, bytes]:
    files = {}
    for name in sorted(glob.glob(os.path.join(directory, "**"), recursive=True)):
        if os.path.isfile(name):
            with open(name, "rb") as handle:
                files[os.path.relpath(name, directory)] = handle.read()
    return files


def weights(model) -> dict[str, torch.Tensor]:
    """What a load writes: the full parameters and the buffers."""
    result = full_params(model)
    result.update((name.replace("_fsdp_wrapped_module.", ""), b.clone()) for name, b in model.named_buffers())
    return result


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def outcome(error: BaseException) -> tuple[str, int | None, str]:
    return type(error).__name__, getattr(error, "errno", None), str(error)


def last_lines(error: RankError) -> dict[int, str]:
    """The error each rank raised (the last line of its traceback), or how it died."""
    return {rank: text.strip().splitlines()[-1] for rank, text in error.errors.items()}


@contextlib.contextmanager
def file_size_limit(limit: int):
    """RLIMIT_FSIZE for this process: a write past `limit` bytes fails with the kernel's EFBIG."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's signal kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


# --------------------------------------------------------------------------------------------------------------------
# Saving: the destination


def _destination_faults(root: str) -> dict:
    _, model = build_ours(CONFIG)
    if dist.get_rank() == 0:
        with open(os.path.join(root, "a_file"), "w") as file:
            file.write("keep")
        # the oracles: torch.save into a directory that does not exist (RuntimeError from a path in torch 2.13,
        # FileNotFoundError from an opened file)
        with pytest.raises(RuntimeError, match=r"Parent directory .*absent does not exist"):
            torch.save({}, os.path.join(root, "absent", "model.pt"))
        with pytest.raises(FileNotFoundError):
            torch.save({}, open(os.path.join(root, "absent", "model.pt"), "wb"))
    dist.barrier()
    cases = {
        "missing": (os.path.join(root, "absent", "ckpt"), FileNotFoundError),
        "a file": (os.path.join(root, "a_file"), FileExistsError),
        "unwritable": (os.path.join(root, "ckpt"), PermissionError),
    }
    results = {}
    for name, (target, kind) in cases.items():
        with pytest.MonkeyPatch.context() as patch:
            if name == "unwritable" and dist.get_rank() == 0:  # (tests run as root, where chmod does not stop a write)

                def refuse(path: str, *args) -> None:
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

                patch.setattr(os, "mkdir", refuse)
            with pytest.raises(kind) as caught:
                save_full_model(model, target)
        results[name] = outcome(caught.value)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_unusable_destination_raises_on_every_rank(tmp_path, world_size: int) -> None:
    """The hang of issue 18: rank 0 could not create the destination and never received the others' shards."""
    results = run_on_ranks(_destination_faults, world_size, str(tmp_path), timeout=DEADLINE)
    assert all(r == results[0] for r in results), "the same error on every rank"
    assert "does not exist: create it first" in results[0]["missing"][2] and "absent" in results[0]["missing"][2]
    assert "exists and is a file" in results[0]["a file"][2]
    assert results[0]["unwritable"][1] == errno.EACCES and "is its directory writable" in results[0]["unwritable"][2]
    assert os.listdir(tmp_path) == ["a_file"] and open(tmp_path / "a_file").read() == "keep", "nothing was written"


# --------------------------------------------------------------------------------------------------------------------
# Saving: write errors before, during and after the data, on any rank


def _save(directory: str, seed: int, max_shard_size: str = "3KB", safe: bool = True) -> None:
    _, model = build_ours(CONFIG, seed=seed)
    save_full_model(model, directory, max_shard_size=max_shard_size, safe_serialization=safe)


def _loads_as(directory: str, seed: int) -> bool:
    _, model = build_ours(CONFIG, seed=seed)
    _, fresh = build_ours(CONFIG, seed=seed + 7)
    load_full_model(fresh, directory)
    return same(weights(fresh), weights(model))


def _failing_save(directory: str, fault: str, safe: bool) -> tuple:
    _, model = build_ours(CONFIG, seed=1)
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        if fault == "ENOSPC" and rank == 0:  # the disk fills up in the middle of the data
            original, calls = safetensors_format._pwrite, [0]

            def full_disk(fd: int, data, position: int) -> None:
                calls[0] += position > 0  # the headers (at 0) are written; the data is not
                if calls[0] > 2:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                original(fd, data, position)

            patch.setattr(safetensors_format, "_pwrite", full_disk)
        if fault == "EFBIG" and rank == 0:
            stack.enter_context(file_size_limit(2000))
        if fault == "before" and rank == last:

            def broken(self) -> None:
                raise RuntimeError("injected: this rank failed before the data")

            patch.setattr(FlatParamHandle, "writeback_orig_params", broken)
        if fault == "rename" and rank == 0:  # after the data: the new directory cannot take the destination's name
            rename = os.rename

            def failing_rename(source: str, target: str) -> None:
                if ".tmp-" in os.path.basename(source):
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                rename(source, target)

            patch.setattr(os, "rename", failing_rename)
        with pytest.raises(Exception) as caught:
            save_full_model(model, directory, max_shard_size="3KB", safe_serialization=safe)
    return outcome(caught.value)


FAULTS = [
    ("ENOSPC", True, "OSError", errno.ENOSPC, "No space left on device"),
    ("EFBIG", True, "OSError", errno.EFBIG, "File too large"),
    ("EFBIG", False, "RuntimeError", None, "unexpected pos"),  # torch.save's own report of a short write
    ("before", True, "RuntimeError", None, "injected: this rank failed before the data (on rank"),
    ("rename", True, "OSError", errno.EIO, "Input/output error"),
]


@pytest.mark.parametrize("world_size", [2, 4])
def test_write_errors_raise_on_every_rank_and_keep_the_previous(tmp_path, world_size: int) -> None:
    directory = str(tmp_path / "ckpt")
    run_on_ranks(_save, world_size, directory, 0, timeout=DEADLINE)
    before = snapshot(directory)
    for fault, safe, kind, code, text in FAULTS:
        results = run_on_ranks(_failing_save, world_size, directory, fault, safe, timeout=DEADLINE)
        assert all(r == results[0] for r in results), f"{fault}: the same error on every rank: {results}"
        assert results[0][:2] == (kind, code) and text in results[0][2], (fault, results[0])
        assert results[0][2].startswith(f"save_full_model could not save {directory}: ")
        assert results[0][2].endswith("the previous checkpoint there, if any, is intact."), results[0][2]
        assert snapshot(directory) == before, f"{fault}: the previous checkpoint is intact bit for bit"
        assert os.listdir(tmp_path) == ["ckpt"], f"{fault}: no temporary left: {os.listdir(tmp_path)}"
    assert all(run_on_ranks(_loads_as, world_size, directory, 0)), "and it loads as the model it was saved from"


# --------------------------------------------------------------------------------------------------------------------
# Saving: a rank killed during the write


def _killed_during_save(directory: str, victim: int, killer: int) -> None:
    pids: list = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    _, model = build_ours(CONFIG, seed=1)

    def kill() -> None:
        if pids[victim] is not None:
            os.kill(pids[victim], signal.SIGKILL)
            pids[victim] = None
            time.sleep(0.5)  # its connections are closed by then

    with pytest.MonkeyPatch.context() as patch:
        if dist.get_rank() == killer == 0:  # at rank 0's first write, before any other rank's shard arrived
            write = hf_checkpoint._write_piece

            def killing_write(*args) -> None:
                kill()
                write(*args)

            patch.setattr(hf_checkpoint, "_write_piece", killing_write)
        elif dist.get_rank() == killer:  # before this rank's first shard reaches rank 0
            send = peers.Peers.send

            def killing_send(self, tensor: torch.Tensor) -> None:
                kill()
                send(self, tensor)

            patch.setattr(peers.Peers, "send", killing_send)
        save_full_model(model, directory, max_shard_size="3KB")


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
@pytest.mark.parametrize("world_size,victim,killer", [(2, 0, 1), (4, 2, 0)], ids=["w2_rank0", "w4_rank2"])
def test_rank_killed_during_save(tmp_path, monkeypatch, world_size: int, victim: int, killer: int) -> None:
    """The survivors raise the same error at once (a closed connection, not a timeout), the previous checkpoint stays;
    a killed rank 0 leaves its temporary directory, which the next save removes."""
    monkeypatch.setattr(harness, "FAILURE_GRACE", DEADLINE)  # wait for every survivor's answer
    directory = str(tmp_path / "ckpt")
    run_on_ranks(_save, world_size, directory, 0, timeout=DEADLINE)
    before = snapshot(directory)
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_on_ranks(_killed_during_save, world_size, directory, victim, killer, timeout=DEADLINE)
    assert not caught.value.silent and time.monotonic() - start < DEADLINE, "no survivor waits for the dead rank"
    lines = last_lines(caught.value)
    assert lines.pop(victim).startswith("process died"), "(its exit code, -9, if it was reaped in time)"
    assert len(set(lines.values())) == 1 and len(lines) == world_size - 1, f"the same error on every survivor: {lines}"
    message = next(iter(lines.values()))
    assert f"RuntimeError: save_full_model could not save {directory}: rank {victim} stopped answering" in message
    assert snapshot(directory) == before, "the previous checkpoint is intact bit for bit"
    left = sorted(os.listdir(tmp_path))
    if victim == 0:  # rank 0 died with its temporary: left for the next save to remove
        assert len(left) == 2 and left[0].startswith(".ckpt.tmp-") and left[1] == "ckpt", left
    else:
        assert left == ["ckpt"], "rank 0 removed its temporary"
    run_on_ranks(_save, world_size, directory, 1, timeout=DEADLINE)  # the next save, with rank 0's temporary there
    assert os.listdir(tmp_path) == ["ckpt"], "the dead save's temporary is gone"
    assert all(run_on_ranks(_loads_as, world_size, directory, 1)), "the new checkpoint is complete"


# --------------------------------------------------------------------------------------------------------------------
# Loading: damaged, lying and mixed files, unexpected keys


def _rewrite(source: str, target: str, edit, cut: int = 0) -> None:
    """Copy of the safetensors file `source` whose header `edit(header)` changed (and `cut` bytes shorter)."""
    with open(source, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header, data = json.loads(file.read(length)), file.read()
    edit(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(target, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded + data[: len(data) - cut])


def damaged_directories(good: str, root: str) -> dict[str, str]:
    """One directory per kind of damage, each with a single model.safetensors."""

    def overlap(header: dict) -> None:  # the bias's offsets point at the weight's bytes (both 16 floats)
        header["blocks.0.ln1.bias"]["data_offsets"] = header["blocks.0.ln1.weight"]["data_offsets"]

    def past_end(header: dict) -> None:  # the last tensor's bytes moved past the end of the file
        last = max((v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][1])
        last["data_offsets"] = [offset + 64 for offset in last["data_offsets"]]

    def wrong_size(header: dict) -> None:
        header["norm.weight"]["shape"] = [17]

    cases = {"truncated": (None, 40), "past_end": (past_end, 0), "overlap": (overlap, 0), "size": (wrong_size, 0)}
    directories = {}
    for name, (edit, cut) in cases.items():
        os.makedirs(os.path.join(root, name))
        target = os.path.join(root, name, "model.safetensors")
        _rewrite(os.path.join(good, "model.safetensors"), target, edit or (lambda h: None), cut)
        with pytest.raises(Exception, match=r"."):  # the oracle: the safetensors package refuses it
            with safe_open(target, "pt") as file:
                for key in file.keys():
                    file.get_tensor(key)
        directories[name] = os.path.join(root, name)
    return directories


def _load_bad(directories: dict[str, str]) -> dict[str, str]:
    _, model = build_ours(CONFIG, seed=3)
    before = weights(model)
    messages = {}
    for name, directory in directories.items():
        with pytest.raises(RuntimeError) as caught:
            load_full_model(model, directory)
        assert same(weights(model), before), f"{name}: nothing of the file reached the model"
        messages[name] = str(caught.value)
    return messages


EXPECTED = {
    "truncated": r"model\.safetensors is cut short: .* lie past the end of the file",
    "past_end": r"model\.safetensors is cut short: .* lie past the end of the file",
    "overlap": r"model\.safetensors: blocks\.0\.ln1\.(bias|weight)'s bytes \[\d+, \d+\) overlap blocks\.0\.ln1\.",
    "size": r"model\.safetensors: norm\.weight holds 64 bytes, but a \(17,\) torch\.float32 tensor takes 68",
    "mixed": r"mixes the files of different saves \(.*model-00002-of-\d+\.safetensors: save [0-9a-f]+",
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_damaged_or_mixed_files_are_refused_before_the_model_is_touched(tmp_path, world_size: int) -> None:
    """Every rank checks the headers against the files (as the safetensors package does) and the save identities,
    and the ranks agree, before any byte is copied: a file cut short used to raise on the last rank only."""
    run_on_ranks(_save, world_size, str(tmp_path / "good"), 0, "5GB", timeout=DEADLINE)
    directories = damaged_directories(str(tmp_path / "good"), str(tmp_path / "bad"))
    run_on_ranks(_save, world_size, str(tmp_path / "a"), 0, timeout=DEADLINE)
    run_on_ranks(_save, world_size, str(tmp_path / "b"), 1, timeout=DEADLINE)
    shutil.copytree(tmp_path / "a", tmp_path / "mixed")
    second = sorted(glob.glob(str(tmp_path / "b" / "model-00002-of-*.safetensors")))[0]
    shutil.copy(second, tmp_path / "mixed")  # the same keys, from another save
    directories["mixed"] = str(tmp_path / "mixed")
    messages = run_on_ranks(_load_bad, world_size, directories, timeout=DEADLINE)
    assert all(m == messages[0] for m in messages), "the same error on every rank"
    for name, directory in directories.items():
        assert re.search(EXPECTED[name], messages[0][name]), (name, messages[0][name])
        with pytest.raises(CheckpointError, match=EXPECTED[name]):  # the converter refuses them alike
            convert_checkpoint(directory, str(tmp_path / "out.pt"), to="full")
    assert not os.path.exists(tmp_path / "out.pt")


def _unexpected_keys(directory: str) -> tuple:
    _, model = build_ours(CONFIG, seed=3)
    before = weights(model)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in .*: "extra" \(in model\.safetensors\)') as caught:
        load_full_model(model, directory)
    assert same(weights(model), before), "strict: nothing loaded"
    result = load_full_model(model, directory, strict=False)
    return str(caught.value), result.missing_keys, result.unexpected_keys, weights(model)


@pytest.mark.parametrize("world_size", [2, 4])
def test_unexpected_keys_follow_torch(tmp_path, world_size: int) -> None:
    """strict (the default) raises with torch's wording; strict=False loads the rest and returns the keys torch's
    load_state_dict(strict=False) returns."""
    torch.manual_seed(5)
    plain = models.Transformer()
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    state.pop("blocks.1.mlp.0.weight")
    state["extra"] = torch.zeros(3)
    oracle = models.Transformer().load_state_dict(state, strict=False)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
        models.Transformer().load_state_dict(state)
    os.makedirs(tmp_path / "ckpt")
    save_file({k: v for k, v in state.items() if k != "head.weight"}, tmp_path / "ckpt" / "model.safetensors")
    results = run_on_ranks(_unexpected_keys, world_size, str(tmp_path / "ckpt"), timeout=DEADLINE)
    assert all(r[0] == results[0][0] for r in results), "the same error on every rank"
    for _, missing, unexpected, loaded in results:
        assert (missing, unexpected) == (oracle.missing_keys, oracle.unexpected_keys)
        assert all(torch.equal(loaded[k], v) for k, v in state.items() if k in loaded), "the rest is loaded"


# --------------------------------------------------------------------------------------------------------------------
# The converter: damaged per-rank files, DCP mixed from two saves or damaged, a full disk


def test_truncated_rank_file_is_reported_damaged_not_missing(tmp_path) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    run_on_ranks(_save_rank_files, 2, str(ranks))
    with open(ranks / "rank1.pt", "r+b") as file:
        file.truncate(os.path.getsize(ranks / "rank1.pt") - 100)
    with pytest.raises(CheckpointError, match=r"per-rank files is there but damaged: .*rank1\.pt is not a readable"):
        convert_checkpoint(str(ranks), str(tmp_path / "out.pt"), to="full")
    assert os.listdir(tmp_path) == ["ranks"]


def full_file(path, seed: int) -> None:
    torch.manual_seed(seed)
    torch.save({"model": {"w": torch.randn(64, 64), "b": torch.randn(64)}}, path)


def test_dcp_mixed_from_two_saves_or_flipped_is_refused(tmp_path) -> None:
    for name, seed in (("a", 0), ("b", 1)):
        full_file(tmp_path / f"{name}.pt", seed)
        convert_checkpoint(str(tmp_path / f"{name}.pt"), str(tmp_path / name), to="dcp")
    data = sorted(f for f in os.listdir(tmp_path / "a") if f.endswith(".distcp"))
    assert data == sorted(f for f in os.listdir(tmp_path / "b") if f.endswith(".distcp")) and len(data) > 1
    shutil.copytree(tmp_path / "a", tmp_path / "mixed")
    shutil.copy(tmp_path / "b" / data[-1], tmp_path / "mixed" / data[-1])
    with pytest.raises(CheckpointError, match=rf"mixes the files of different saves: .*{data[-1]} \(of save "):
        convert_checkpoint(str(tmp_path / "mixed"), str(tmp_path / "out.pt"), to="full")
    shutil.copytree(tmp_path / "a", tmp_path / "flipped")
    largest = max(data, key=lambda name: os.path.getsize(tmp_path / "a" / name))  # w's 16 KiB
    with open(tmp_path / "flipped" / largest, "r+b") as file:  # a bit in the middle of its tensor data
        file.seek(os.path.getsize(tmp_path / "a" / largest) // 2)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CheckpointError, match=r"is corrupted: its record .* does not match the CRC-32"):
        convert_checkpoint(str(tmp_path / "flipped"), str(tmp_path / "out.pt"), to="full")
    assert not os.path.exists(tmp_path / "out.pt")
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}}
    dcp.load(state, checkpoint_id=str(tmp_path / "a"), no_dist=True)  # the stamp does not bother DCP's reader
    assert torch.equal(state["model"]["w"], torch.load(tmp_path / "a.pt")["model"]["w"])


@pytest.mark.parametrize("to", ["full", "dcp", "safetensors"])
def test_converter_on_a_full_disk(tmp_path, to: str) -> None:
    """A write past the file size limit (the kernel's EFBIG) or into a full disk (ENOSPC): the converter's own error
    naming the destination and the cause, no partial output, the previous output intact."""
    full_file(tmp_path / "source.pt", 0)
    destination = str(tmp_path / "out")
    convert_checkpoint(str(tmp_path / "source.pt"), destination, to=to)
    before = snapshot(destination) if os.path.isdir(destination) else open(destination, "rb").read()
    full_file(tmp_path / "source.pt", 1)
    cause = "File too large" if to == "safetensors" else "torch.save could not write"  # (torch keeps no errno)
    with file_size_limit(4096):
        with pytest.raises(CheckpointError, match=rf"Could not write {destination}: {cause}.*previous .* intact"):
            convert_checkpoint(str(tmp_path / "source.pt"), destination, to=to)
    with pytest.MonkeyPatch.context() as patch:

        def full(*args) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        patch.setattr(os, "posix_fallocate", full)  # what a torch.save file reserves before it is filled
        patch.setattr(safetensors_format, "_pwrite", full)
        if to != "dcp":
            with pytest.raises(CheckpointError, match=r"No space left on device.*free some space"):
                convert_checkpoint(str(tmp_path / "source.pt"), destination, to=to)
    after = snapshot(destination) if os.path.isdir(destination) else open(destination, "rb").read()
    assert after == before and sorted(os.listdir(tmp_path)) == ["out", "source.pt"], os.listdir(tmp_path)


def test_command_line_on_a_full_disk(tmp_path) -> None:
    """The command line: one error line and a failure exit code, no traceback, no output."""
    full_file(tmp_path / "source.pt", 0)

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    command = [sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"), str(tmp_path / "source.pt")]
    done = subprocess.run(
        [*command, str(tmp_path / "out"), "--to", "dcp", "--quiet"],
        preexec_fn=limited,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert done.returncode not in (0, 2) and "Traceback" not in done.stderr, done.stderr
    assert f"Could not write {tmp_path / 'out'}: torch.save could not write" in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["source.pt"]


# --------------------------------------------------------------------------------------------------------------------
# Temporaries of dead saves


def test_stale_temporaries_of_dead_saves_only_are_removed(tmp_path) -> None:
    """A killed save's temporary says who wrote it (pid, start time, host): the next save removes those of dead
    processes (a reused pid too) and keeps those of live ones, of other hosts, and of unknown writers."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    owner = atomic_module._owner()  # this process: alive
    pid, start, host = owner.split("-", 2)
    names = {
        "dead": f".out.tmp-0000000a-{dead.pid}-1-{host}",
        "reused": f".out.tmp-0000000b-{pid}-{int(start) + 1}-{host}",  # this pid, but another process's start time
        "alive": f".out.tmp-0000000c-{owner}",
        "elsewhere": f".out.tmp-0000000d-{dead.pid}-1-another-host",
        "unknown": ".out.tmp-0000000e",
    }
    for name in names.values():
        os.makedirs(tmp_path / name / "inside")
    full_file(tmp_path / "source.pt", 0)
    convert_checkpoint(str(tmp_path / "source.pt"), str(tmp_path / "out"), to="dcp")
    kept = {key for key, name in names.items() if os.path.exists(tmp_path / name)}
    assert kept == {"alive", "elsewhere", "unknown"}
    # killed between its two renames: the previous directory, set aside, goes back in place
    shutil.rmtree(tmp_path / "out")
    os.makedirs(tmp_path / f".out.old-0000000f-{dead.pid}-1-{host}")
    open(tmp_path / f".out.old-0000000f-{dead.pid}-1-{host}" / "previous", "w").close()
    assert atomic_module.remove_stale_temporaries(str(tmp_path / "out")) == [
        str(tmp_path / f".out.old-0000000f-{dead.pid}-1-{host}")
    ]
    assert os.listdir(tmp_path / "out") == ["previous"]
