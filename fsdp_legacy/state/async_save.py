"""Saves that do not stall training: what a save needs is copied off the training tensors at the call, and the files
are written in the background while training goes on.

    pending = dcp_checkpoint.async_save(state, "ckpt/step100")      # a LOCAL or SHARDED state dict, through DCP
    pending = save_full_model_async(model, "export/step100")         # full weights, Hugging Face safetensors
    ...                                                              # training steps
    pending.wait()                                                   # every rank; raises the save's error

The background work talks over a gloo group of its own (one per set of ranks, made on the first call), so its
collectives and transfers never pair with training's, whatever backend training uses. One save is in flight at a
time: a new call first waits for the previous one (and raises its error if no one has seen it), so the host memory
held is one copy of this rank's part of the state. For DCP that copy is DCP's staging (the stager dcp.async_save
uses, run in the call, then dcp.save in the save's thread, as dcp.async_save's thread runs it); for full weights it
is this rank's local shards (rank 0: plus the tensors held whole), in CPU buffers kept for the next save, pinned when
the shards live on a GPU, where the copy is queued on the current stream and the call does not wait for it. The
save's thread runs at the lowest CPU priority, so that where training keeps every core busy it is training that
gets them. The files are the same as the synchronous save's, written the same way: a kill leaves the previous
checkpoint.
"""

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from ..api import StateDictType
from . import background_state
from .dcp_checkpoint import finish_save, forget_side_file, records_of_tree
from .hf_checkpoint import (
    SaveSources,
    check_save_dtype,
    collect_for_save,
    copy_sources,
    save_frame,
    write_full_model,
)
from .optim_state import optim_state_dict
from .peers import Peers
from .state_dict import state_dict_type

__all__ = ["AsyncSave", "async_save", "async_save_sharded", "save_full_model_async"]

BACKGROUND_NICE = 19  # the save's thread yields the cores to training's (the lowest priority, about 1/70 of a core)


class AsyncSave:
    """A save running in the background. `wait()` returns its result once the files are complete (DCP's metadata for
    a DCP save, None for full weights) or raises its error, the same on every rank; `done()` polls. `stall_s` is how
    long the call held the caller, `host_bytes` the bytes of the copy it holds until it ends."""

    def __init__(self, where: str, work: Callable[[], Any], stall_s: float, host_bytes: int) -> None:
        self.where, self.stall_s, self.host_bytes = where, stall_s, host_bytes
        self._future: Future = Future()
        self._seen = False
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"fsdp_legacy save {where}")
        self._thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        with contextlib.suppress(AttributeError, OSError):  # Linux: a thread has a nice value of its own
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        try:
            self._future.set_result(work())
        except BaseException as error:  # handed to wait(), on this rank as on every other
            self._future.set_exception(error)

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the save is complete; raises TimeoutError if `timeout` seconds pass first."""
        try:
            result = self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self._seen = True
            raise
        self._seen = True
        return result


_in_flight: list[AsyncSave] = []  # the one save not yet settled
_side_groups: dict[tuple[int, ...], tuple[object, dist.ProcessGroup]] = {}  # ranks -> (default group, its side group)


def _settle_previous() -> None:
    """Wait for the save still in flight; its error is raised here unless its wait() has already raised it."""
    while _in_flight:
        previous = _in_flight.pop()
        seen = previous._seen
        try:
            previous.wait()
        except BaseException:
            if not seen:
                raise


def side_group(process_group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """The gloo group of background saves over the ranks of `process_group` (default: every rank), made once per
    process group setup. Every rank of it must call this the same number of times (the async saves do); for a
    subgroup, only its ranks."""
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    default = dist.distributed_c10d._get_default_group()
    cached = _side_groups.get(ranks)
    if cached is None or cached[0] is not default or not _still_registered(cached[1]):
        # Every rank of the job makes it when the save is over all of them; a subgroup's ranks alone, otherwise.
        local = len(ranks) < dist.get_world_size()
        group = made_at_background_priority(
            lambda: dist.new_group(list(ranks), backend="gloo", use_local_synchronization=local)
        )
        assert group is not None
        _side_groups[ranks] = (default, group)
        return group
    return cached[1]


def _still_registered(group: dist.ProcessGroup) -> bool:
    """False once the program destroyed the group: torch forgets its ranks then."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def made_at_background_priority(make: Callable[[], Any]) -> Any:
    """`make()` run by a thread at the background saves' nice value: gloo starts its worker and transport threads
    when a group is made, and on Linux a thread inherits its maker's nice value, so the save's collectives then run
    below training as the save's own thread does, instead of at training's priority."""
    made: Future = Future()

    def run() -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        try:
            made.set_result(make())
        except BaseException as error:
            made.set_exception(error)

    maker = threading.Thread(target=run, name="fsdp_legacy save group")
    maker.start()
    maker.join()
    return made.result()


def _start(where: str, started: float, work: Callable[[], Any], host_bytes: int) -> AsyncSave:
    pending = AsyncSave(where, work, time.perf_counter() - started, host_bytes)
    _in_flight.append(pending)
    return pending


def async_save(
    state: dict[str, Any], checkpoint_id: str, *, process_group: dist.ProcessGroup | None = None
) -> AsyncSave:
    """dcp_checkpoint.save in the background: DCP's stager copies `state` to the CPU during the call, and dcp.save
    writes the copy, then the save identity stamps, CRC-32s and side file follow, on the save's own group. Every rank of
    `process_group` calls it; `wait()` returns DCP's metadata. Until the side file is written the directory counts as
    unfinished (latest() skips it)."""
    started = time.perf_counter()
    _settle_previous()
    return _dcp_in_background(state, checkpoint_id, side_group(process_group), started)


def _dcp_in_background(
    state: dict[str, Any], checkpoint_id: str, group: dist.ProcessGroup, started: float
) -> AsyncSave:
    records = records_of_tree(state)
    forget_side_file(checkpoint_id, group)
    writer = FileSystemWriter(checkpoint_id)
    staged = writer.stage(state)  # DCP's staging (what dcp.async_save runs in the call): a CPU copy of every tensor

    def finish() -> Any:  # what dcp.async_save's thread runs, then ours, in a thread whose priority is lowered
        saved = dcp.save(staged, storage_writer=writer, process_group=group)
        return finish_save(saved, checkpoint_id, records, group)

    return _start(checkpoint_id, started, finish, background_state.tensor_bytes(state))  # what DCP's staging copies


@torch.no_grad()
def async_save_sharded(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    checkpoint_id: str,
    *,
    model_key: str = "model",
    optim_key: str = "optim",
) -> AsyncSave:
    """The model's and the optimizer's SHARDED state dicts saved through DCP in the background, as
    `dcp_checkpoint.save({model_key: model.state_dict(), optim_key: FSDP.optim_state_dict(model, optim)}, ...)` under
    SHARDED_STATE_DICT would save them at this moment, but the call only copies this rank's flat shards, buffers and
    optimizer state: the all-gathers that cut every parameter and state into per-rank chunks run in the background,
    on the save's own group (background_state.py). Every rank calls it; load the checkpoint as any SHARDED one.
    Models whose SHARDED dicts cannot be built that way (NO_SHARD, DTensor state dicts, units sharded over fewer
    than every rank) have them built in the call, and the writing still runs in the background."""
    started = time.perf_counter()
    _settle_previous()
    group = side_group()
    _buffers.begin()
    captured, failure = None, None
    try:
        captured = background_state.capture(model, optim, _buffers.copy)
    except Exception as error:
        failure = error
    ready = _buffers.copied()
    _agree_on(failure, group)  # every rank raises, or none: no rank's thread waits for a gather that never comes
    if captured is None:
        with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {model_key: model.state_dict(), optim_key: optim_state_dict(model, optim)}
        return _dcp_in_background(state, checkpoint_id, group, started)
    forget_side_file(checkpoint_id, group)
    writer = FileSystemWriter(checkpoint_id)

    def work() -> Any:
        if ready is not None:
            ready.synchronize()
        model_state, optim_state = background_state.build(captured, group)
        saved = dcp.save({model_key: model_state, optim_key: optim_state}, storage_writer=writer, process_group=group)
        return finish_save(saved, checkpoint_id, {}, group)

    return _start(checkpoint_id, started, work, captured.copied_bytes)


def _agree_on(failure: Exception | None, group: dist.ProcessGroup) -> None:
    failed = torch.tensor([failure is not None], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if failure is not None:
        raise failure
    if failed.item():
        raise RuntimeError("async_save_sharded failed on another rank (its error says why); nothing was saved")


@torch.no_grad()
def save_full_model_async(
    model: nn.Module,
    directory: str,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    safe_serialization: bool = True,
) -> AsyncSave:
    """save_full_model in the background: every rank copies its local shards (rank 0 also the tensors held whole)
    during the call, then streams the copies to rank 0 over the save's own group while training goes on. The
    directory appears, whole, when the save completes; a failure leaves the previous one."""
    started = time.perf_counter()
    _settle_previous()
    check_save_dtype(dtype)
    peers = Peers(save_frame(directory), group=side_group())
    sources: SaveSources | None = None
    ready: torch.cuda.Event | None = None
    try:
        _buffers.begin()
        sources = copy_sources(collect_for_save(model), _buffers.copy)
        ready = _buffers.copied()
    except Exception as error:
        peers.note(error)

    def write() -> None:
        if ready is not None:
            ready.synchronize()  # the device-to-host copies queued at the call
        write_full_model(sources, directory, peers, max_shard_size, dtype, safe_serialization)

    return _start(directory, started, write, sources.copied_bytes if sources is not None else 0)


class _CopyBuffers:
    """CPU buffers for the copies of one save, reused by the next when the sizes match (one save is in flight at a
    time, so a buffer is free again when the next save starts); pinned for GPU tensors."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.next = 0
        self.on_gpu = False

    def begin(self) -> None:
        self.next, self.on_gpu = 0, False

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        pinned = tensor.device.type == "cuda"
        index, self.next = self.next, self.next + 1
        reusable = (
            index < len(self.buffers)
            and self.buffers[index].shape == tensor.shape
            and self.buffers[index].dtype == tensor.dtype
            and self.buffers[index].is_pinned() == pinned
        )
        if not reusable:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            if index < len(self.buffers):
                self.buffers[index] = buffer
            else:
                self.buffers.append(buffer)
        self.on_gpu |= pinned
        return self.buffers[index].copy_(tensor, non_blocking=pinned)

    def copied(self) -> "torch.cuda.Event | None":
        """An event after every copy of this save (None when nothing came from a GPU); buffers past them go."""
        del self.buffers[self.next :]
        event = None
        if self.on_gpu:
            event = torch.cuda.Event()
            event.record()
        return event


_buffers = _CopyBuffers()
