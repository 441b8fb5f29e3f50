"""Multi-process test harness: persistent pools of gloo rank processes.

Spawning a process and importing torch costs seconds, so one pool per world size is
created lazily and kept for the whole pytest session.  ``run_on_ranks(fn, ws, ...)``
runs ``fn(*args, **kwargs)`` on every rank and returns the results indexed by rank.
After any failure or timeout the pool is killed (surviving ranks may be blocked in a
collective forever) and the next call for that world size spawns a fresh one. The process
groups a successful job made are destroyed after it (see _destroy_groups_made_since).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import importlib
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

__all__ = ["RankError", "run_on_ranks", "shutdown"]

_TEST_DIR = os.path.dirname(os.path.abspath(__file__))
STARTUP_TIMEOUT = 180.0  # several ranks importing torch on 2 cores can be slow
FAILURE_GRACE = 3.0  # after a rank fails, how long the others get to report too
_ctx = mp.get_context("spawn")  # fork after torch has started threads is unsafe

# Replies are pickled by hand with plain pickle: Connection.send would use torch's
# ForkingPickler reductions, which share tensor storage through fds that die with
# the sender (and we kill senders). Message: (status "ok"/"err", payload, pg_alive).
_Reply = tuple[str, Any, bool]


class RankError(AssertionError):
    """Raised when ranks raise, die, or do not answer in time."""

    def __init__(self, msg: str, errors: dict[int, str], silent: list[int]) -> None:
        super().__init__(msg)
        self.errors, self.silent = errors, silent  # rank -> traceback; hung ranks


def _worker(rank: int, ws: int, port: int, conn: Connection, stack_file: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent kills us
    os.dup2(2, 1)  # worker stdout (C level too) -> the parent's stderr
    sys.stdout = sys.stderr
    if _TEST_DIR not in sys.path:  # so `import fsdp_legacy` / `import test_foo` work, from any test folder
        sys.path.insert(0, _TEST_DIR)
    import repo_paths

    repo_paths.put_on_sys_path()
    # SIGUSR1 dumps all Python stacks to a file the parent reads when we hang.
    stacks = open(stack_file, "w")  # a local keeps it open for the worker's lifetime
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(ws),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(ws),
    )
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=ws)
        gc.freeze()  # (see below)
        conn.send_bytes(pickle.dumps(("ok", os.getpid(), True)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("err", traceback.format_exc(), False)))
        return
    while True:
        try:
            job = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the parent is gone
        if not job:  # empty message = stop
            break
        try:
            module, qualname, args, kwargs = pickle.loads(job)
            fn: Any = importlib.import_module(module)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            torch.manual_seed(0)  # every job starts from the same RNG state
            groups_before = _live_groups()
            out = tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), fn(*args, **kwargs))
            _destroy_groups_made_since(groups_before)
            reply = pickle.dumps(("ok", out, dist.is_initialized()))
        except BaseException:  # SystemExit too: report it instead of dying silently
            reply = pickle.dumps(("err", traceback.format_exc(), dist.is_initialized()))
        out = fn = args = kwargs = None
        # Free the job's objects (reference cycles too) before the next one starts, then freeze what survives: a full
        # collection walks every object in the process (torch, dynamo, the test modules: ~0.2 s a job), a collection
        # after a freeze only those created since (a few ms).
        gc.collect()
        gc.freeze()
        conn.send_bytes(reply)
        if not dist.is_initialized():
            break  # the job destroyed the default group; the parent respawns us
    if dist.is_initialized():
        dist.destroy_process_group()


def _live_groups() -> set[Any]:
    """The process groups this rank holds now (torch's registry: no public API lists them)."""
    return set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()


def _destroy_groups_made_since(before: set[Any]) -> None:
    """Destroy the subgroups a job made (meshes, HSDP's groups, side groups) once it succeeded. A gloo group keeps a
    transport thread that wakes about a hundred times a second; left alive, a pool's ranks gathered hundreds of them
    over a session and spent most of both cores waking them, idle pools included. Every rank ran the same job, so
    every rank destroys the same groups. A failed job's pool is discarded whole instead."""
    made = _live_groups() - before
    for group in made:
        dist.destroy_process_group(group)
    if made:
        _forget_dtensor_caches()


def _forget_dtensor_caches() -> None:
    """DTensor's caches key on meshes, and meshes compare equal by shape and names, not by their groups: a later
    job's equal mesh would get cached specs that hold the destroyed groups' mesh. Cleared with them (a thread's own
    Python sharding cache: this thread's, where the jobs run)."""
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute, debug

    debug._clear_sharding_prop_cache()  # torch's own: the Python cache and the C++ fast path's
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pool:
    """``ws`` rank processes with one pipe each, in an initialized gloo group."""

    def __init__(self, ws: int) -> None:
        self.ws = ws
        self.tmpdir = tempfile.mkdtemp(prefix=f"harness_ws{ws}_")
        port = _free_port()
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        try:
            for r in range(ws):
                parent_end, child_end = _ctx.Pipe()
                p = _ctx.Process(
                    target=_worker, name=f"ws{ws}-rank{r}", args=(r, ws, port, child_end, self._stack_file(r))
                )
                p.start()
                child_end.close()  # so the parent sees EOF when the child dies
                self.conns.append(parent_end)
                self.procs.append(p)
            replies, silent = self.collect(STARTUP_TIMEOUT)
        except BaseException:  # e.g. Ctrl-C while starting: leave no processes behind
            self.kill()
            raise
        errors = {r: rep[1] for r, rep in replies.items() if rep[0] == "err"}
        if errors or silent:
            msg = _report(f"starting {ws} ranks", errors, silent, self.dump_stacks(silent), STARTUP_TIMEOUT)
            self.kill()
            raise RankError(msg, errors, silent)

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self.tmpdir, f"rank{rank}.stacks")

    def collect(self, timeout: float) -> tuple[dict[int, _Reply], list[int]]:
        """One reply per rank; gives up FAILURE_GRACE s after the first failure."""
        replies: dict[int, _Reply] = {}
        pending = {c: r for r, c in enumerate(self.conns)}
        deadline = time.monotonic() + timeout
        while pending and (left := deadline - time.monotonic()) > 0:
            for c in wait(list(pending), left):
                r = pending.pop(c)  # type: ignore[call-overload]
                try:
                    replies[r] = pickle.loads(c.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self.procs[r].join(1)
                    replies[r] = ("err", f"process died (exit code {self.procs[r].exitcode})", False)
                except Exception:
                    replies[r] = ("err", "parent could not unpickle the result:\n" + traceback.format_exc(), True)
                if replies[r][0] == "err":
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
        return replies, sorted(pending.values())

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5 if ranks else 0)  # faulthandler writes from the signal handler
        out = {}
        for r in ranks:
            try:
                with open(self._stack_file(r)) as f:
                    out[r] = f.read().strip()
            except OSError:
                out[r] = ""
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(10)  # reaps the process: no zombies
        for c in self.conns:
            c.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def stop(self) -> None:
        for c in self.conns:
            try:
                c.send_bytes(b"")
            except OSError:
                pass  # already dead
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()  # whatever did not exit in time


def _report(
    what: str, errors: dict[int, str], silent: list[int], stacks: dict[int, str], timeout: float | None = None
) -> str:
    if silent and not errors and timeout is not None:
        lines = [f"{what} timed out after {timeout} s: ranks {silent} did not answer"]
    else:
        parts = [f"ranks {sorted(errors)} raised"] if errors else []
        if silent:  # most likely blocked in a collective with a failed rank
            parts.append(f"ranks {silent} did not answer within {FAILURE_GRACE} s of that")
        lines = [f"{what} failed: " + "; ".join(parts)]
    for r in sorted(errors):
        lines += [f"===== rank {r} raised =====", errors[r].rstrip()]
    for r in silent:
        lines += [f"===== rank {r} did not answer; its Python stacks =====", stacks.get(r) or "(unavailable)"]
    return "\n".join(lines)


_pools: dict[int, _Pool] = {}


def _discard(ws: int) -> None:
    pool = _pools.pop(ws, None)
    if pool is not None:
        pool.kill()


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, /, *args: Any, timeout: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return results by rank.

    ``fn`` must be a module-level function: workers import it by module + qualname.
    Raises RankError (an AssertionError) with every failing rank's traceback.
    """
    __tracebackhide__ = True  # pytest: show the caller's line, not the harness internals
    module, qualname = fn.__module__, fn.__qualname__
    if "<" in qualname:  # <lambda> / <locals>: the workers cannot import it
        raise TypeError(f"run_on_ranks needs a module-level function, got {qualname}")
    job = pickle.dumps((module, qualname, args, kwargs))
    pool = _pools.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):  # died between jobs?
        _discard(world_size)
        pool = _pools[world_size] = _Pool(world_size)
    try:
        for c in pool.conns:
            c.send_bytes(job)
        replies, silent = pool.collect(timeout)
    except BaseException:  # e.g. Ctrl-C: ranks are mid-job, the pool is unusable
        _discard(world_size)
        raise
    errors = {r: rep[1] for r, rep in replies.items() if rep[0] == "err"}
    if errors or silent:
        msg = _report(
            f"run_on_ranks({module}.{qualname}, world_size={world_size})",
            errors,
            silent,
            pool.dump_stacks(silent),
            timeout,
        )
        _discard(world_size)
        raise RankError(msg, errors, silent)
    if not all(rep[2] for rep in replies.values()):
        _discard(world_size)  # a job destroyed the default group: start fresh next time
    return [replies[r][1] for r in range(world_size)]


def shutdown() -> None:
    """Stop all pools: stop message, join with a timeout, kill leftovers."""
    while _pools:
        _pools.popitem()[1].stop()


atexit.register(shutdown)  # pytest_sessionfinish calls it first; this is the backstop
