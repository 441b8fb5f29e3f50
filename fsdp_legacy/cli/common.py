"""What the subcommands share: exit codes, one-line errors, path checks, progress bars and importing the user's
model code."""

from __future__ import annotations

import glob
import importlib
import os
import sys
import zipfile
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from torch import nn

EXIT_OK = 0
EXIT_FAILED = 1  # a checkpoint that cannot be read or converted (damaged, refused, incomplete)
EXIT_USAGE = 2  # bad arguments, a path that does not exist, something that is not a checkpoint (argparse's code too)

EXIT_CODES = """exit codes:
  0  done
  1  the checkpoint cannot be read or converted (damaged, incomplete, refused as unsafe): the message says why
  2  bad arguments, a path that does not exist, or something that is not a checkpoint of a layout this reads"""

T = TypeVar("T")


class UsageError(Exception):
    """Bad arguments, a missing path or something that is not a checkpoint: exit code 2, the message names the fix."""


def error_line(prog: str, message: str) -> str:
    """`prog: error: message` on one line, as argparse words its own errors."""
    return f"{prog}: error: {' '.join(str(message).split())}"


def check_source(source: str, what: str = "source") -> None:
    """Raise UsageError unless `source` is an existing file or directory, or a glob pattern matching files."""
    if os.path.exists(source):
        if os.path.isfile(source) and not zipfile.is_zipfile(source) and not source.endswith(".safetensors"):
            raise UsageError(
                f"{what} {source} is a file but not a torch.save archive (torch.save writes a zip archive; one written "
                "with _use_new_zipfile_serialization=False is not read): pass a checkpoint file or directory."
            )
        return
    if glob.has_magic(source):
        if not any(os.path.isfile(name) for name in glob.glob(source)):
            raise UsageError(f"{what} {source} matches no files: pass a pattern that matches every rank's file.")
        return
    raise UsageError(f"{what} {source} does not exist: pass the path of a checkpoint file or directory.")


def human_bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:,.2f} {unit}"
    return f"{count} B"


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the `tools` extra is not installed: no bars
        return None
    return tqdm


def progress(items: Iterable[T], total: int, description: str, quiet: bool = False) -> Iterator[T]:
    """`items`, with a tqdm bar on stderr while they are worked through (none without tqdm, with `quiet`, or when
    stderr is not a terminal)."""
    tqdm = None if quiet else _tqdm()
    if tqdm is None:
        yield from items
        return
    with tqdm(items, total=total, desc=description, leave=False, disable=None, file=sys.stderr) as bar:
        yield from bar


class ByteProgress:
    """A conversion's progress callback, `(phase, bytes done, bytes in total, key)`: one tqdm bar per phase on stderr
    (none without tqdm, with `quiet`, or when stderr is not a terminal)."""

    def __init__(self, quiet: bool) -> None:
        self._tqdm = None if quiet else _tqdm()
        self._bar: Any = None
        self._phase: str | None = None

    def __call__(self, phase: str, done: int, total: int, name: str) -> None:
        if self._tqdm is None:
            return
        if phase != self._phase:
            self.close()
            self._phase = phase
            self._bar = self._tqdm(
                total=total, desc=phase, unit="B", unit_scale=True, unit_divisor=1024, disable=None, file=sys.stderr
            )
        self._bar.update(done - self._bar.n)
        self._bar.set_postfix_str(name[-40:], refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def import_name(module: str, name: str, what: str) -> Any:
    """`module.name` of the user's code, imported from the current directory as `python -m` would (`what`: the
    option that named it, for the error)."""
    if os.getcwd() not in sys.path:  # as `python -m` would: the user's package from where they run the command
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as error:
        raise UsageError(f"{what}: cannot import {module} ({error}); run from the directory that holds it.") from None
    except AttributeError:
        raise UsageError(f"{what}: {module} has no {name}.") from None


def module_class(dotted: str) -> type[nn.Module]:
    """The nn.Module class a dotted --wrap names (mypkg.models.Layer)."""
    module, _, name = dotted.rpartition(".")
    if not module:
        raise UsageError(f"--wrap {dotted}: give the class with its module, e.g. mypkg.models.{dotted}.")
    found = import_name(module, name, f"--wrap {dotted}")
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise UsageError(f"--wrap {dotted} is not an nn.Module class.")
    return found
