"""One rank of the soak (tools/soak.py starts it under torchrun --max-restarts): a small GPT trained with fsdp_legacy
(AdamW, bf16 mixed precision) that checkpoints every k steps, rotating through our formats, and resumes from
`fsdp_legacy.checkpoint.latest()` on every (re)start. While kills remain for its phase, a seeded plan picks a victim
rank, a step and a moment, and the victim SIGKILLs itself there; torchrun then restarts every rank.

Everything the driver checks comes from `events.jsonl` in the run folder (one JSON object a line, appended with one
write each): "start" (rank 0, per attempt: the checkpoint chosen, those skipped and why, a digest of every rank's
state after the load), "saved" (rank 0: the digests of the state just saved), "kill" (the victim, just before it
dies), "finish" (rank 0). The last phase writes the full model and optimizer state to final.pt.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import signal
import sys
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import fsdp_legacy from the checkout
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import MixedPrecision, StateDictType, dcp_checkpoint
from fsdp_legacy.checkpoint import (
    get_model_state_dict,
    get_optimizer_state_dict,
    latest,
    load_rank_state,
    save_full_model,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from fsdp_legacy.state import dcp_checkpoint as dcp_checkpoint_module
from fsdp_legacy.wrap import ModuleWrapPolicy
from gpt import GPT, Block, CharTokenizer, GPTConfig, make_corpus
from process_exit import exit_now

# Checkpoint formats, in turn by save number. Each holds the model and the optimizer state, so a resume is exact.
FORMATS = ("dcp-sharded", "dcp-local", "rank-files")
MOMENTS = ("step", "collective", "backward", "save", "rename", "resume")
EVENTS = "events.jsonl"
FINAL = "final.pt"
BATCH, SEQ = 4, 32


@dataclass(frozen=True)
class Phase:
    """A stretch of the run at one world size: steps [start, end), its number of kills."""

    index: int
    world: int
    start: int
    end: int
    kills: int
    last: bool


@dataclass(frozen=True)
class KillPlan:
    rank: int  # the victim
    moment: str  # one of MOMENTS
    detail: str  # how, within the moment (the save's stage, the resume's)
    done: int  # steps done when it dies: the step in progress (step, collective, backward), the save point (save,
    # rename) or the step resumed from (resume: set when it dies)


@dataclass
class Run:
    """What one rank works with."""

    folder: str
    seed: int
    every: int
    phase: Phase
    rank: int
    model: Any
    optim: torch.optim.Optimizer
    plan: KillPlan | None

    @property
    def root(self) -> str:
        return os.path.join(self.folder, "ckpt")

    @property
    def export(self) -> str:
        return os.path.join(self.folder, "exports", "model")


def log_event(folder: str, event: dict[str, Any]) -> None:
    """One line, one write, synced: a rank killed right after it leaves the line whole."""
    line = (json.dumps(event, sort_keys=True) + "\n").encode()
    descriptor = os.open(os.path.join(folder, EVENTS), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_events(folder: str) -> list[dict[str, Any]]:
    path = os.path.join(folder, EVENTS)
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [json.loads(line) for line in file if line.strip()]


def format_of(done: int, phase: Phase, every: int) -> str:
    """The format of the checkpoint after `done` steps. A phase that hands over to another world size ends on a
    SHARDED DCP save, the one format that loads at another world size."""
    if done == phase.end and not phase.last:
        return "dcp-sharded"
    return FORMATS[(done // every) % len(FORMATS)]


def is_save_point(done: int, phase: Phase, every: int) -> bool:
    return done % every == 0 or done == phase.end


def plan_kill(seed: int, phase: Phase, every: int, kills_done: int, start: int) -> KillPlan:
    """Where this attempt's victim dies: always before the phase's last save, so a kill never leaves the phase
    complete with kills still to place (every attempt that has one dies). A collective kill is in forward (a unit's
    all-gather) or, by a second draw, in backward (reduce-scatters in flight)."""
    rng = random.Random(f"soak-{seed}-{phase.index}-{kills_done}")
    horizon = min(phase.end, start + 2 * every)  # within about two checkpoints of the resume
    saves = [d for d in range(start + 1, horizon) if is_save_point(d, phase, every)]
    moment = rng.choice(("step", "collective", "save", "rename") if saves else ("step", "collective"))
    if moment in ("step", "collective"):
        plan = KillPlan(rng.randrange(phase.world), moment, "", rng.randrange(start, horizon))
        if moment == "collective" and random.Random(f"soak-{seed}-{phase.index}-{kills_done}-pass").randrange(2):
            plan = KillPlan(plan.rank, "backward", "", plan.done)
        return plan
    done = rng.choice(saves)
    if moment == "rename":  # rank 0 alone renames (convert/atomic.py)
        return KillPlan(0, moment, "between the export's renames", done)
    if format_of(done, phase, every) == "rank-files":
        return KillPlan(rng.randrange(phase.world), moment, "its rank file half written", done)
    stage = rng.choice(["data", "stamps"])
    detail = "after its DCP data, before .metadata" if stage == "data" else "after dcp.save, before the side file"
    return KillPlan(rng.randrange(phase.world), moment, detail, done)


def plan_resume_kill(seed: int, phase: Phase, kills_done: int, resuming: bool) -> KillPlan | None:
    """A kill while this attempt resumes (inside latest()'s agreement, or inside the load), decided before it
    resumes; None (the kill is placed after the resume by plan_kill) when there is nothing to resume from or the draw
    says so: one draw in len(MOMENTS)."""
    rng = random.Random(f"soak-{seed}-{phase.index}-{kills_done}-resume")
    if not resuming or rng.randrange(len(MOMENTS)):
        return None
    stage = rng.choice(["latest", "load"])
    detail = "inside latest()'s agreement" if stage == "latest" else "inside the checkpoint's load"
    return KillPlan(rng.randrange(phase.world), "resume", detail, -1)


def die(run: Run, step: int) -> None:
    """SIGKILL this rank, logged first (with its attempt: a resume kill's attempt logs no start)."""
    assert run.plan is not None
    plan = asdict(run.plan)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    event = {"event": "kill", "phase": run.phase.index, **plan, "at_step": step, "attempt": attempt}
    log_event(run.folder, event)
    os.kill(os.getpid(), signal.SIGKILL)


def planned(run: Run, moment: str, done: int) -> bool:
    plan = run.plan
    return plan is not None and plan.rank == run.rank and plan.moment == moment and plan.done == done


# --------------------------------------------------------------------------------------------------------------------
# Model, data, digests


def build(seed: int) -> tuple[Any, torch.optim.Optimizer, torch.Tensor]:
    text = make_corpus(n_sentences=2000, seed=seed)
    tok = CharTokenizer(text)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=SEQ, n_layer=4, n_head=2, d_model=64)
    torch.manual_seed(seed)  # the same initial model on every rank
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(GPT(cfg), auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    return model, optim, torch.tensor(tok.encode(text))


def batch(data: torch.Tensor, seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a step: a function of (seed, step, rank) alone, so a resumed run sees what the uninterrupted saw."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1024 + rank)
    starts = torch.randint(len(data) - SEQ - 1, (BATCH, 1), generator=g)
    chunk = data[starts + torch.arange(SEQ + 1)]
    return chunk[:, :-1], chunk[:, 1:]


def digest(run: Run) -> str:
    """SHA-256 of this rank's flat parameter shards and their optimizer state, bytes as they are."""
    h = hashlib.sha256()
    for param in run.model.parameters():
        tensors = [param.detach()] + [v for _, v in sorted(run.optim.state.get(param, {}).items())]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                h.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():  # FSDP.state_dict_type's FutureWarning, kept for parity with torch
        warnings.simplefilter("ignore", FutureWarning)
        yield


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints


def local_state(run: Run) -> dict[str, Any]:
    with quiet(), FSDP.state_dict_type(run.model, StateDictType.LOCAL_STATE_DICT):
        return {"model": run.model.state_dict(), "optim": FSDP.optim_state_dict(run.model, run.optim)}


def load_local(run: Run, state: dict[str, Any]) -> None:
    with quiet(), FSDP.state_dict_type(run.model, StateDictType.LOCAL_STATE_DICT):
        run.model.load_state_dict(state["model"])
        run.optim.load_state_dict(FSDP.optim_state_dict_to_load(run.model, run.optim, state["optim"]))


def save(run: Run, done: int) -> None:
    fmt = format_of(done, run.phase, run.every)
    path = os.path.join(run.root, f"step_{done:06d}.{fmt}")
    with killing_inside_save(run, done, fmt):
        if fmt == "rank-files":
            os.makedirs(path, exist_ok=True)
            buffer = io.BytesIO()
            torch.save(local_state(run), buffer)
            data = buffer.getvalue()
            with open(os.path.join(path, f"rank{run.rank}.pt"), "wb") as file:  # straight to its name, as users do
                if planned(run, "save", done):
                    file.write(data[: len(data) // 2])
                    file.flush()
                    os.fsync(file.fileno())
                    die(run, done)
                file.write(data)
        elif fmt == "dcp-local":
            dcp_checkpoint.save(local_state(run), path)
        else:
            state = {"model": get_model_state_dict(run.model), "optim": get_optimizer_state_dict(run.model, run.optim)}
            dcp_checkpoint.save(state, path)
    digests = gather(digest(run))
    if run.rank == 0:
        log_event(
            run.folder,
            {
                "event": "saved",
                "phase": run.phase.index,
                "world": run.phase.world,
                "step": done,
                "format": fmt,
                "digests": digests,
            },
        )


@contextlib.contextmanager
def killing_inside_save(run: Run, done: int, fmt: str) -> Iterator[None]:
    """In the victim only: die inside dcp_checkpoint.save, after this rank's data files (before rank 0 can write
    .metadata) or after dcp.save returned (before the stamps, CRC-32s and side file)."""
    if not planned(run, "save", done) or fmt == "rank-files":
        yield
        return
    assert run.plan is not None
    if run.plan.detail.startswith("after its DCP data"):

        class Dying(FileSystemWriter):
            def write_data(self, plan: Any, planner: Any) -> Any:
                future = super().write_data(plan, planner)
                future.wait()
                die(run, done)

        with mock.patch.object(dcp_checkpoint_module, "FileSystemWriter", Dying):
            yield
        return

    def dying_data_files(*args: Any) -> Any:
        die(run, done)

    with mock.patch.object(dcp_checkpoint_module, "data_files", dying_data_files):
        yield


def export(run: Run, done: int) -> None:
    """The full model, streamed as safetensors to one destination replaced each time (two renames: the previous
    directory aside, the new one into place). Not a resume point (no optimizer state): kept out of the root."""
    if not planned(run, "rename", done):
        save_full_model(run.model, run.export)
        return
    rename = os.rename

    def dying_rename(source: str, target: str) -> None:
        if ".tmp-" in os.path.basename(source):  # the previous one (if any) is aside, the new one not yet in place
            die(run, done)
        rename(source, target)

    with mock.patch.object(os, "rename", dying_rename):
        save_full_model(run.model, run.export)


@contextlib.contextmanager
def killing_inside_resume(run: Run) -> Iterator[None]:
    """The victim of a resume kill dies inside latest()'s agreement (the others wait in it) or on entering the load
    (dcp.load's collectives; its own rank file). (Nothing else in a resume exchanges objects before latest() does.)"""
    if not planned(run, "resume", -1):
        yield
        return
    assert run.plan is not None
    if run.plan.detail.startswith("inside latest()"):  # its first exchange: the others wait in it
        with mock.patch.object(dist, "all_gather_object", lambda *_, **__: die(run, -1)):
            yield
        return
    with mock.patch.object(dcp_checkpoint_module.dcp, "load", lambda *_, **__: die(run, -1)):
        yield


def resume(run: Run) -> tuple[int, dict[str, Any]]:
    """Load the newest intact checkpoint latest() agrees on; the steps done, and what to log about it."""
    with killing_inside_resume(run):
        return load_latest(run)


def load_latest(run: Run) -> tuple[int, dict[str, Any]]:
    found = latest(run.root)
    skipped = [{"path": s.path, "reason": s.reason} for s in (found.skipped if found else ())]
    if found is None:
        if run.phase.index > 0:
            raise RuntimeError(f"phase {run.phase.index} found no checkpoint under {run.root} to start from")
        return 0, {"found": None, "skipped": skipped}
    fmt = os.path.basename(found.path).split(".", 1)[1]
    if fmt == "rank-files":
        if planned(run, "resume", -1):
            die(run, -1)  # (dcp.load is not what reads rank files)
        load_local(run, load_rank_state(os.path.join(found.path, f"rank{run.rank}.pt")))
    elif fmt == "dcp-local":
        get_optimizer_state_dict(run.model, run.optim)  # the optimizer's state must exist to be a load target
        state = local_state(run)
        dcp_checkpoint.load(state, found.path)
        load_local(run, state)
    else:
        state = {"model": get_model_state_dict(run.model), "optim": get_optimizer_state_dict(run.model, run.optim)}
        dcp_checkpoint.load(state, found.path)
        set_model_state_dict(run.model, state["model"])
        set_optimizer_state_dict(run.model, run.optim, state["optim"])
    assert found.step is not None, found.path
    about = {"found": found.path, "format": found.format, "checked": found.checked, "skipped": skipped}
    return found.step, about


# --------------------------------------------------------------------------------------------------------------------
# The loop


def train(run: Run, data: torch.Tensor, start: int) -> None:
    middle = run.model.blocks[len(run.model.blocks) // 2]  # an FSDP unit: its forward all-gathers
    for step in range(start, run.phase.end):
        x, y = batch(data, run.seed, step, run.rank)
        hook = None
        if planned(run, "collective", step):  # the others wait in this unit's all-gather for the victim
            hook = middle.register_forward_pre_hook(lambda *_, at=step: die(run, at))
        if planned(run, "backward", step):  # in backward, the later units' reduce-scatters issued, the others in them

            def die_in_backward(module: Any, inputs: Any, output: torch.Tensor, at: int = step) -> None:
                output.register_hook(lambda _: die(run, at))

            hook = middle.register_forward_hook(die_in_backward)
        _, loss = run.model(x, y)
        loss.backward()
        if planned(run, "step", step):  # gradients reduced, the optimizer not stepped
            die(run, step)
        run.optim.step()
        run.optim.zero_grad(set_to_none=True)
        if hook is not None:
            hook.remove()
        done = step + 1
        if is_save_point(done, run.phase, run.every):
            export(run, done)
            save(run, done)


def write_final(run: Run) -> None:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {
        "model": get_model_state_dict(run.model, options=options),
        "optim": get_optimizer_state_dict(run.model, run.optim, options=options),
    }
    if run.rank == 0:
        temporary = os.path.join(run.folder, FINAL + ".tmp")
        torch.save(state, temporary)
        os.replace(temporary, os.path.join(run.folder, FINAL))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--phase", type=int, required=True)
    p.add_argument("--from-step", type=int, required=True)
    p.add_argument("--to-step", type=int, required=True)
    p.add_argument("--kills", type=int, default=0)
    p.add_argument("--last", action="store_true")
    p.add_argument("--collective-timeout", type=float, default=60.0, help="seconds before any collective gives up")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the cores; one thread each is also deterministic
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    phase = Phase(args.phase, world, args.from_step, args.to_step, args.kills, args.last)
    model, optim, data = build(args.seed)
    run = Run(args.folder, args.seed, args.every, phase, rank, model, optim, None)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kills_done = sum(e["event"] == "kill" and e["phase"] == phase.index for e in read_events(args.folder))
    plan: list[KillPlan | None] = [None]
    if rank == 0 and kills_done < phase.kills:
        plan[0] = plan_resume_kill(args.seed, phase, kills_done, resuming=attempt > 0 or phase.index > 0)
    dist.broadcast_object_list(plan, src=0)
    run.plan = plan[0]
    start, about = resume(run)
    digests = gather(digest(run))
    plan = [None]
    if rank == 0:
        if kills_done < phase.kills:
            plan[0] = plan_kill(args.seed, phase, args.every, kills_done, start)
        log_event(
            args.folder,
            {
                "event": "start",
                "phase": phase.index,
                "world": world,
                "attempt": attempt,
                "step": start,
                "digests": digests,
                **about,
                "plan": asdict(plan[0]) if plan[0] else None,
            },
        )
    dist.broadcast_object_list(plan, src=0)
    run.plan = plan[0]
    train(run, data, start)
    if phase.last:
        write_final(run)
    if rank == 0:
        log_event(args.folder, {"event": "finish", "phase": phase.index, "step": phase.end})
    dist.barrier()
    dist.destroy_process_group()
    exit_now()


if __name__ == "__main__":
    main()
