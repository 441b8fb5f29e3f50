"""Ranks that agree on the outcome of a save or load streamed through rank 0 (hf_checkpoint.py, async_save.py).

Every rank talks to rank 0 only, point to point, so a rank's death shows up as a closed connection instead of a wait
that never ends, and at fixed points every rank's outcome meets at rank 0, which sends back one verdict: every rank
then raises the same error, or none does. Ranks are global ranks; `group` (every rank of the job) carries the
transfers, so a background save can use its own group and never pair with training's collectives.
"""

import builtins
import contextlib
import json
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..convert import errors

__all__ = ["Gone", "Peers", "comm_device", "decode", "encode"]


def comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's point-to-point transfers live: CUDA for NCCL, else the CPU (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------------------------------
# Agreeing on the outcome


class Peers:
    """The ranks of one save or load, kept in step. Every rank talks to rank 0 only (shards and outcomes go through
    it), so a rank that dies shows up at rank 0 as a closed connection and rank 0's death at every other rank, never
    as a wait on a rank that cannot answer; rank 0 leaves a dead rank out from then on. A rank's own failure does not
    stop it: it keeps every send and receive of the protocol (sending zeros, writing nothing) until the next
    agreement, where every rank raises the same error."""

    def __init__(self, frame: Callable[[str], str], group: dist.ProcessGroup | None = None) -> None:
        self.frame = frame  # a cause -> the message every rank raises
        self.group = group  # every rank of the job (a background save's own group, or the default one)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.device = comm_device(group)
        self.failure: BaseException | None = None  # this rank's first failure since the last agreement
        self.gone: dict[int, BaseException] = {}  # on rank 0: the ranks found dead, and the error that told

    def note(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = error

    def send(self, tensor: torch.Tensor) -> None:
        """To rank 0; raises the agreed error at once if rank 0 is gone (there is no one left to agree with)."""
        try:
            dist.send(tensor, 0, group=self.group)
        except RuntimeError as error:
            raise self._lost_rank_zero() from error

    def receive(self, tensor: torch.Tensor, peer: int) -> bool:
        """On rank 0, from `peer`: False (and `peer` is gone) when it died."""
        try:
            dist.recv(tensor, peer, group=self.group)
        except RuntimeError as error:
            self.gone[peer] = error
            return False
        return True

    def agree(self, commit: Callable[[], None] | None = None) -> None:
        """Every rank's outcome so far meets at rank 0, which sends back the verdict: the first failure by rank (rank
        0's, then the others', then a dead rank), or else the outcome of `commit`, which rank 0 runs first. A failure
        raises the same error (type and message) on every rank."""
        failure, self.failure = self.failure, None
        if self.rank != 0:
            self._send_text(encode(failure, self.rank), 0)
            verdict = self._receive_text(0)
            if verdict:
                raise decode(verdict, self.frame) from failure
            return
        verdicts = [encode(failure, 0)] if failure is not None else []
        answered = []
        for peer in range(1, self.size):
            if peer in self.gone:
                continue
            text = self._text_from(peer)
            if text is not None:
                answered.append(peer)
                verdicts += [text] if text else []
        verdicts += [encode(Gone(f"rank {peer} stopped answering"), 0) for peer in sorted(self.gone)]
        if not verdicts and commit is not None:
            try:
                commit()
            except Exception as error:
                failure = error
                verdicts.append(encode(error, 0))
        for peer in answered:
            with contextlib.suppress(RuntimeError):  # it died since it answered: nothing of it waits any more
                self._send_text(verdicts[0] if verdicts else "", peer)
        if verdicts:
            raise decode(verdicts[0], self.frame) from failure or next(iter(self.gone.values()), None)

    def _lost_rank_zero(self) -> Exception:
        return decode(encode(Gone("rank 0 stopped answering"), 0), self.frame)

    def _send_text(self, text: str, peer: int) -> None:
        data = (
            torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)
        )
        try:
            dist.send(torch.tensor([data.numel()], device=self.device), peer, group=self.group)
            if data.numel():
                dist.send(data.to(self.device), peer, group=self.group)
        except RuntimeError as error:
            if self.rank == 0:
                raise
            raise self._lost_rank_zero() from error

    def _receive_text(self, peer: int) -> str:
        try:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
            dist.recv(size, peer, group=self.group)
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
            if data.numel():
                dist.recv(data, peer, group=self.group)
        except RuntimeError as error:
            if self.rank == 0:
                raise
            raise self._lost_rank_zero() from error
        return bytes(data.cpu().numpy()).decode()

    def _text_from(self, peer: int) -> str | None:
        try:
            return self._receive_text(peer)
        except RuntimeError as error:
            self.gone[peer] = error
            return None


class Gone(RuntimeError):
    """A rank that stopped answering: killed, crashed, or slower than the process group's timeout."""


def encode(error: BaseException | None, rank: int) -> str:
    if error is None:
        return ""
    if isinstance(error, Gone):
        cause = f"{error} (it was killed or crashed: its connection closed, or it outran the process group's timeout)"
        return json.dumps(["RuntimeError", None, cause])
    cause = str(error) or type(error).__name__
    if rank:
        cause = f"{cause.rstrip('.')} (on rank {rank})"
    return json.dumps([type(error).__name__, getattr(error, "errno", None), cause])


_OURS = {cls.__name__: cls for cls in (errors.CheckpointError, errors.DestinationMissing, errors.DestinationKind)}


def decode(verdict: str, frame: Callable[[str], str]) -> Exception:
    """The agreed error, rebuilt alike on every rank: its type where it is a builtin or ours, else RuntimeError."""
    name, errno, cause = json.loads(verdict)
    kind = _OURS.get(name) or getattr(builtins, name, None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind = RuntimeError
    try:
        error = kind(frame(cause))
    except Exception:  # an exception class whose constructor wants other arguments
        error = RuntimeError(frame(cause))
    if isinstance(error, OSError) and errno is not None:
        error.errno = errno
    return error
