"""Every reader run on a checkpoint in a forked child, under a timeout and limits on its address space
(RLIMIT_AS) and on the size of any file it writes (RLIMIT_FSIZE), and what it gave: exit code or signal, its output,
and for the converters a fingerprint of what they wrote (each tensor's dtype, shape and bytes), to compare with the
reader's result on the intact checkpoint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import resource
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

READERS = (
    "inspect",
    "inspect --json",
    "convert --to full",
    "convert --to safetensors",
    "latest()",
    "inspect --latest",
)
DIRECTORY_ONLY = ("latest()", "inspect --latest")  # they look for checkpoint directories under a root
EXIT_UNCAUGHT = 70  # the child's code when the reader raised out of it (its traceback is on stderr)


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 30.0
    memory_bytes: int = 4 << 30  # address space a reader may add to what the forked process already maps
    file_bytes: int = 64 << 20  # the largest file a reader may write


@dataclass(frozen=True)
class Ran:
    exit_code: int | None  # None: ended by a signal or the timeout
    signal: int | None
    timed_out: bool
    stdout: str
    stderr: str
    seconds: float


def _address_space() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[0]) * resource.getpagesize()


def run_forked(body: Callable[[], int], scratch: Path, limits: Limits) -> Ran:
    """`body()` in a forked child (its return value the exit code), stdout and stderr to files in `scratch`."""
    out, err = scratch / "stdout", scratch / "stderr"
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = EXIT_UNCAUGHT
        try:
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            sys.stdout = open(1, "w", closefd=False)  # (not the parent's objects, which pytest may have replaced)
            sys.stderr = open(2, "w", closefd=False)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
            memory = _address_space() + limits.memory_bytes
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
            code = body()
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    status, delay = 0, 0.002
    deadline = started + limits.timeout_s
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            timed_out = True
            break
        time.sleep(delay)
        delay = min(delay * 1.5, 0.05)
    seconds = time.monotonic() - started
    exit_code = os.waitstatus_to_exitcode(status)
    return Ran(
        exit_code=None if timed_out or exit_code < 0 else exit_code,
        signal=-exit_code if exit_code < 0 and not timed_out else None,
        timed_out=timed_out,
        stdout=out.read_text(errors="replace"),
        stderr=err.read_text(errors="replace"),
        seconds=seconds,
    )


# --------------------------------------------------------------------------------------------------------------------
# The readers


def _cli(*argv: str) -> Callable[[], int]:
    def body() -> int:
        from fsdp_legacy.cli.main import main

        return main(list(argv), prog="fsdp-legacy")

    return body


def _latest(root: Path) -> Callable[[], int]:
    def body() -> int:
        from fsdp_legacy.checkpoint import latest

        found = latest(str(root))
        if found is None:
            return 1
        print(json.dumps({k: v for k, v in dataclasses.asdict(found).items() if k != "skipped"}, sort_keys=True))
        return 0

    return body


def preload() -> None:
    """Import what the readers import, once in the parent, so that no child spends its time importing."""
    import fsdp_legacy.checkpoint
    import fsdp_legacy.cli.main  # noqa: F401


def reader_body(reader: str, checkpoint: Path, out: Path) -> Callable[[], int]:
    root = checkpoint.parent
    return {
        "inspect": _cli("inspect", str(checkpoint)),
        "inspect --json": _cli("inspect", str(checkpoint), "--json"),
        "convert --to full": _cli("convert", str(checkpoint), str(out / "out.pt"), "--to", "full", "--quiet"),
        "convert --to safetensors": _cli("convert", str(checkpoint), str(out / "hf"), "--to", "safetensors", "--quiet"),
        "latest()": _latest(root),
        "inspect --latest": _cli("inspect", "--latest", str(root)),
    }[reader]


# --------------------------------------------------------------------------------------------------------------------
# What a reader gave, to compare


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _fingerprint_tree(value: Any, key: str, into: dict[str, str]) -> None:
    if isinstance(value, dict):
        if not value:
            into[key] = "{}"
        for name, item in value.items():
            _fingerprint_tree(item, f"{key}.{name}" if key else str(name), into)
    elif isinstance(value, (list, tuple)):
        into[key + "#len"] = f"{type(value).__name__} of {len(value)}"
        for position, item in enumerate(value):
            _fingerprint_tree(item, f"{key}[{position}]", into)
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        into[key] = f"{tensor.dtype} {tuple(tensor.shape)} {_digest(raw)}"
    else:
        into[key] = repr(value)


def _full_fingerprint(path: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    _fingerprint_tree(torch.load(path, map_location="cpu", weights_only=True), "", found)
    return found


def _safetensors_fingerprint(directory: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for path in sorted(directory.glob("*.safetensors")):
        raw = path.read_bytes()
        (length,) = struct.unpack_from("<Q", raw)
        header = json.loads(raw[8 : 8 + length])
        for name, entry in sorted(header.items()):
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                data = raw[8 + length + begin : 8 + length + end]
                found[name] = f"{path.name} {entry['dtype']} {tuple(entry['shape'])} {_digest(data)}"
    index = directory / "model.safetensors.index.json"
    if index.exists():
        found["(index)"] = json.dumps(json.loads(index.read_text())["weight_map"], sort_keys=True)
    return found


# The bytes a checkpoint takes on disk, which bytes appended to an archive change and its content does not (zip
# readers skip what follows the central directory): not part of the result.
_DISK = re.compile(r'"disk_bytes": \d+|[\d.,]+ (?:[KMG]iB|B) on disk')


def result_of(reader: str, ran: Ran, out: Path) -> dict[str, str]:
    """What a reader that succeeded gave: its converted tensors, or its listing (stdout by line)."""
    if reader == "convert --to full":
        return _full_fingerprint(out / "out.pt")
    if reader == "convert --to safetensors":
        return _safetensors_fingerprint(out / "hf")
    return {f"line {n}": _DISK.sub("(on disk)", line) for n, line in enumerate(ran.stdout.splitlines())}
