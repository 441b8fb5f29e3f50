"""Atomic replacement of a checkpoint file or directory: a crash (or an exception) mid-save leaves the previous
checkpoint as it was and no partial one under the destination's name.

The new checkpoint is written to a hidden temporary beside the destination (same file system, so the rename is
atomic), flushed to disk (fsync of every file and of the directories), then renamed over the destination. A directory
cannot be renamed over a non-empty one, so the previous directory is first renamed aside and deleted after: a crash
between those two renames leaves it intact under `.NAME.old-*` beside the destination.
"""

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator

from .errors import CheckpointError


@contextlib.contextmanager
def atomic_file(destination: str) -> Iterator[str]:
    """Yield a temporary path to write the file to; on success it replaces `destination`."""
    _check_kind(destination, directory=False)
    temporary = _sibling(destination, "tmp")
    try:
        yield temporary
        _fsync(temporary)
        os.replace(temporary, destination)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise
    _fsync(os.path.dirname(os.path.abspath(destination)))


@contextlib.contextmanager
def atomic_directory(destination: str) -> Iterator[str]:
    """Yield a new empty temporary directory to write into; on success it replaces `destination`."""
    _check_kind(destination, directory=True)
    temporary = _sibling(destination, "tmp")
    os.mkdir(temporary)
    try:
        yield temporary
        for root, _, files in os.walk(temporary):
            for name in files:
                _fsync(os.path.join(root, name))
            _fsync(root)
        previous = _sibling(destination, "old") if os.path.exists(destination) else None
        if previous is not None:
            os.rename(destination, previous)
        os.rename(temporary, destination)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    _fsync(os.path.dirname(os.path.abspath(destination)))
    if previous is not None:
        shutil.rmtree(previous)


def _sibling(destination: str, kind: str) -> str:
    head, name = os.path.split(os.path.abspath(destination))
    return os.path.join(head, f".{name}.{kind}-{uuid.uuid4().hex[:8]}")


def _check_kind(destination: str, directory: bool) -> None:
    if os.path.exists(destination) and os.path.isdir(destination) != directory:
        raise CheckpointError(
            f"{destination} exists and is a {'file' if directory else 'directory'}, but this checkpoint format is a "
            f"{'directory' if directory else 'file'}: choose another destination or remove it first."
        )
    parent = os.path.dirname(os.path.abspath(destination))
    if not os.path.isdir(parent):
        raise CheckpointError(f"{parent}, the directory of {destination}, does not exist: create it first.")


def _fsync(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
