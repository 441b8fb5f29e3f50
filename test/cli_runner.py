"""The `fsdp-legacy` command run in this process: `main()` as `python -m fsdp_legacy` runs it, returning its exit code
and what it printed as `subprocess.run` does. A subprocess costs an interpreter and torch's import (seconds here) per
call; the tests keep real subprocesses where the process itself is under test (the installed script, the switch in
the environment, a path as a user types it)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import warnings
from pathlib import Path
from typing import Any

from fsdp_legacy.cli.main import main

PROG = "python -m fsdp_legacy"


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m fsdp_legacy ARGS` in this process: its exit code, stdout and stderr (warnings included, as a new
    interpreter prints them)."""
    out, err = io.StringIO(), io.StringIO()

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        err.write(warnings.formatwarning(message, category, filename, lineno, line))

    previous = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.resetwarnings()  # (pytest's filters and recorder are not the command's)
            warnings.showwarning = show
            try:
                code = main(list(args), prog=PROG)
            except SystemExit as exited:  # argparse: --help, usage errors
                code = exited.code if isinstance(exited.code, int) else int(exited.code is not None)
    finally:
        os.chdir(previous)
    return subprocess.CompletedProcess([*PROG.split(), *args], code, out.getvalue(), err.getvalue())
