"""Launching a script of test/frameworks/ on local ranks with torch.distributed.run, as the framework tests do."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

FRAMEWORKS = Path(__file__).resolve().parent / "frameworks"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, args: list[str], ours: bool, ranks: int = 2) -> subprocess.CompletedProcess:
    """Run test/frameworks/`script` on `ranks` CPU ranks, on fsdp_legacy (FSDP_LEGACY=1) or on torch's FSDP1."""
    env = {k: v for k, v in os.environ.items() if k != "FSDP_LEGACY"} | {"OMP_NUM_THREADS": "1"}
    if ours:
        env["FSDP_LEGACY"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(FRAMEWORKS / script),
        *args,
    ]
    return subprocess.run(command, cwd=FRAMEWORKS, env=env, capture_output=True, text=True, timeout=600)
