"""Atomic replacement of a checkpoint file or directory: a crash (or an exception) mid-save leaves the previous
checkpoint as it was and no partial one under the destination's name.

The new checkpoint is written to a hidden temporary beside the destination (same file system, so the rename is
atomic), flushed to disk (fsync of every file and of the directories), then renamed over the destination. A directory
cannot be renamed over a non-empty one, so the previous directory is first renamed aside and deleted after.

A save that is killed leaves its temporary behind (and, killed between the two renames, the previous directory aside
under `.NAME.old-*`). The temporaries' names say who wrote them (process id, its start time, host), so the next save
to the same destination removes those of writers that are dead, and puts a previous directory left aside back in
place, but never touches the temporaries of a save still running (or of another host, which cannot be checked).
"""

import contextlib
import os
import re
import shutil
import socket
import uuid
import warnings
from collections.abc import Iterator

from .errors import DestinationKind, DestinationMissing


@contextlib.contextmanager
def atomic_file(destination: str) -> Iterator[str]:
    """Yield a temporary path to write the file to; on success it replaces `destination`."""
    _check_kind(destination, directory=False)
    remove_stale_temporaries(destination)
    temporary = _sibling(destination, "tmp")
    try:
        yield temporary
        _fsync(temporary)
        os.replace(temporary, destination)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise
    _settle(destination, None)


@contextlib.contextmanager
def atomic_directory(destination: str) -> Iterator[str]:
    """Yield a new empty temporary directory to write into; on success it replaces `destination`."""
    _check_kind(destination, directory=True)
    remove_stale_temporaries(destination)
    temporary = _sibling(destination, "tmp")
    try:
        os.mkdir(temporary)
    except OSError as error:
        raise type(error)(
            error.errno,
            f"cannot create a directory beside {destination} ({error.strerror}): is its directory writable?",
        ) from error
    try:
        yield temporary
        for root, _, files in os.walk(temporary):
            for name in files:
                _fsync(os.path.join(root, name))
            _fsync(root)
        previous = _sibling(destination, "old") if os.path.exists(destination) else None
        if previous is not None:
            os.rename(destination, previous)
        try:
            os.rename(temporary, destination)
        except BaseException:
            if previous is not None:
                os.rename(previous, destination)  # the previous one back in place
            raise
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    _settle(destination, previous)


def remove_stale_temporaries(destination: str) -> list[str]:
    """Remove the temporaries that dead saves left beside `destination` (a previous directory they had set aside goes
    back in place if nothing replaced it); returns what was removed or restored. Those of live processes, of other
    hosts, and of unknown writers are left alone."""
    head, name = os.path.split(os.path.abspath(destination))
    pattern = re.compile(rf"\.{re.escape(name)}\.(tmp|old)-[0-9a-f]{{8}}-(\d+)-(\d+)-(.+)")
    done: list[str] = []
    try:
        entries = sorted(os.listdir(head))
    except OSError:  # (no such directory, or not listable: the save itself will say what is wrong)
        return done
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match is None or _alive(int(match.group(2)), match.group(3), match.group(4)):
            continue
        path = os.path.join(head, entry)
        with contextlib.suppress(OSError):  # another save may be cleaning up the same leftovers
            if match.group(1) == "old" and not os.path.lexists(destination):
                os.rename(path, destination)  # killed between its two renames: the previous checkpoint is this one
            elif os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            done.append(path)
    return done


def _owner() -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "unknown"
    return f"{os.getpid()}-{_start_time(os.getpid()) or 0}-{host}"


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (Linux), which tells a reused process id apart; None where
    unknown or when the process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()  # after the command name, which may hold anything
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _alive(pid: int, start: str, host: str) -> bool:
    if host != _owner().split("-", 2)[2]:
        return True  # another machine's process: it cannot be checked from here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    if os.path.isdir("/proc") and start != "0":
        return _start_time(pid) == start
    return True


def _sibling(destination: str, kind: str) -> str:
    head, name = os.path.split(os.path.abspath(destination))
    return os.path.join(head, f".{name}.{kind}-{uuid.uuid4().hex[:8]}-{_owner()}")


def _check_kind(destination: str, directory: bool) -> None:
    if os.path.exists(destination) and os.path.isdir(destination) != directory:
        raise DestinationKind(
            f"{destination} exists and is a {'file' if directory else 'directory'}, but this checkpoint format is a "
            f"{'directory' if directory else 'file'}: choose another destination or remove it first."
        )
    parent = os.path.dirname(os.path.abspath(destination))
    if not os.path.isdir(parent):
        raise DestinationMissing(f"{parent}, the directory of {destination}, does not exist: create it first.")


def _settle(destination: str, previous: str | None) -> None:
    """After the rename: the new checkpoint is in place, so what fails from here on is only warned about."""
    try:
        _fsync(os.path.dirname(os.path.abspath(destination)))
        if previous is not None:
            shutil.rmtree(previous)
    except OSError as error:
        warnings.warn(f"{destination} was saved, but tidying up after it failed: {error}", stacklevel=3)


def _fsync(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
