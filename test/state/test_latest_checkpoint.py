"""fsdp_legacy.checkpoint.latest(root) and `fsdp-legacy inspect --latest`: the newest checkpoint under a folder that is
complete and intact, agreed by every rank. Real checkpoints are saved with our savers at several steps (DCP through
dcp_checkpoint.save, per-rank LOCAL files, streamed full saves), then damaged as a kill or a bad copy leaves them
(truncated file, missing rank file, the temporary of an unfinished atomic save, one rank's file from another save, a
flipped byte, a DCP save stopped before its side file or its .metadata). Oracles: the parameters snapshotted at each
step (the chosen checkpoint must load and equal them), and the damage each test made (every skipped one is named with
its cause)."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import StateDictType, dcp_checkpoint
from fsdp_legacy.checkpoint import LatestCheckpoint, latest, load_full_model, save_full_model
from fsdp_legacy.cli.main import main
from fsdp_legacy.convert.atomic import _sibling
from fsdp_utils import Config, batch, build_ours, full_params, loss_of
from harness import run_on_ranks

CONFIG = Config("net", "FULL_SHARD")
STEPS = 3
FORMATS = ("dcp", "local", "full")


def _save(model: torch.nn.Module, optim: torch.optim.Optimizer, fmt: str, path: str) -> None:
    if fmt == "dcp":
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dcp_checkpoint.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}, path)
    elif fmt == "local":
        if dist.get_rank() == 0:
            os.makedirs(path)
        dist.barrier()
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            torch.save(model.state_dict(), os.path.join(path, f"rank{dist.get_rank()}.pt"))
        dist.barrier()
    else:
        save_full_model(model, path)


def _train_and_save(root: str, fmt: str) -> dict[int, dict[str, torch.Tensor]]:
    """STEPS Adam steps, a checkpoint after each (root/step_<n>); the full parameters at each step."""
    model = build_ours(CONFIG)[1]
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    snapshots = {}
    for step in range(1, STEPS + 1):
        loss_of(model(batch(CONFIG, step))).backward()
        optim.step()
        optim.zero_grad()
        _save(model, optim, fmt, os.path.join(root, f"step_{step}"))
        snapshots[step] = full_params(model)
    return snapshots


def _load(path: str, fmt: str) -> dict[str, torch.Tensor]:
    """A fresh model loaded from the checkpoint at `path`: its full parameters."""
    model = build_ours(CONFIG, seed=1)[1]
    if fmt == "dcp":
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict()}
            dcp_checkpoint.load(state, path)
            model.load_state_dict(state["model"])
    elif fmt == "local":
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            model.load_state_dict(torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), weights_only=False))
    else:
        load_full_model(model, path)
    return full_params(model)


def _data_file(path: str) -> str:
    """The biggest file of a checkpoint: where a kill or a bad copy does damage."""
    files = [os.path.join(path, n) for n in os.listdir(path) if not n.startswith(".")]
    return max(files, key=os.path.getsize)


def _truncate(path: str) -> None:
    file = _data_file(path)
    os.truncate(file, os.path.getsize(file) // 2)


def _flip(path: str) -> None:
    file = _data_file(path)
    with open(file, "r+b") as handle:
        handle.seek(os.path.getsize(file) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))


def _leave_temporary(root: str, newest: str) -> str:
    """What a save killed before its atomic rename leaves: a complete-looking hidden temporary beside the destination
    (named as convert/atomic.py names them), newer than everything else."""
    temporary = _sibling(os.path.join(root, "step_4"), "tmp")
    shutil.copytree(newest, temporary)
    return temporary


def _mix(root: str, fmt: str) -> None:
    """One file of the newest save replaced by the same file of the save before (a copy from another save)."""
    newest, older = os.path.join(root, f"step_{STEPS}"), os.path.join(root, f"step_{STEPS - 1}")
    name = "rank1.pt" if fmt == "local" else os.path.basename(_data_file(newest))
    shutil.copy(os.path.join(older, name), os.path.join(newest, name))


def _damage(root: str, fmt: str, case: str) -> tuple[int, list[tuple[str, str]]]:
    """Damage the newest checkpoint(s) per `case`: (the step that latest must choose, [(skipped path, a phrase of
    its reason)])."""
    newest = os.path.join(root, f"step_{STEPS}")
    damaged = "CRC-32|truncated|corrupted|cut short|damaged"
    if case == "truncated":
        _truncate(newest)
        return STEPS - 1, [(newest, damaged)]
    if case == "flipped":
        _flip(newest)
        return STEPS - 1, [(newest, damaged)]
    if case == "mixed":
        _mix(root, fmt)
        return STEPS - 1, [(newest, "another save|different saves|not from one save")]
    if case == "missing rank file":
        os.remove(os.path.join(newest, "rank1.pt"))
        return STEPS - 1, [(newest, r"rank\(s\) \[1\] is missing")]
    if case == "temporary":
        temporary = _leave_temporary(root, newest)
        return STEPS, [(temporary, "has not finished")]
    if case == "no side file":
        os.remove(os.path.join(newest, ".fsdp_legacy.json"))
        return STEPS - 1, [(newest, "did not finish")]
    if case == "no metadata":
        os.remove(os.path.join(newest, ".metadata"))
        return STEPS - 1, [(newest, "did not finish")]
    if case == "two newest damaged":
        second = os.path.join(root, f"step_{STEPS - 1}")
        _truncate(newest)
        _flip(second)
        return STEPS - 2, [(newest, damaged), (second, damaged)]
    raise AssertionError(case)


CASES = [
    ("dcp", "truncated"),
    ("dcp", "flipped"),
    ("dcp", "mixed"),
    ("dcp", "temporary"),
    ("dcp", "no side file"),
    ("dcp", "no metadata"),
    ("local", "truncated"),
    ("local", "flipped"),
    ("local", "mixed"),
    ("local", "missing rank file"),
    ("full", "truncated"),
    ("full", "flipped"),
    ("full", "temporary"),
    ("dcp", "two newest damaged"),
    ("local", "two newest damaged"),
]


def _on_ranks(root: str, fmt: str, case: str) -> dict[str, Any]:
    snapshots = _train_and_save(root, fmt)
    expected: Any = None
    if dist.get_rank() == 0:
        expected = _damage(root, fmt, case)
    holder = [expected]
    dist.broadcast_object_list(holder, src=0)
    step, skipped = holder[0]
    found = latest(root)
    assert found is not None, "an intact checkpoint is there"
    loaded = _load(found.path, fmt)
    for name, value in snapshots[step].items():
        torch.testing.assert_close(loaded[name], value, msg=lambda m, n=name: f"{n} of step {step}: {m}")
    return {"found": found, "step": step, "skipped": skipped}


def _check(found: LatestCheckpoint, root: str, step: int, skipped: list[tuple[str, str]], fmt: str) -> None:
    assert found.path == os.path.join(root, f"step_{step}")
    assert found.step == step
    assert found.format == {"full": "safetensors"}.get(fmt, fmt)
    # Our DCP and full saves record when they were saved; per-rank files fall back to their modification times.
    assert found.ordered_by == ("file modification time" if fmt == "local" else "the save's record")
    assert {s.path for s in found.skipped} == {path for path, _ in skipped}, found.skipped
    reasons = {s.path: s.reason for s in found.skipped}
    for path, phrase in skipped:
        assert re.search(phrase, reasons[path]), (path, reasons[path])


@pytest.mark.parametrize(("fmt", "case"), CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_latest_skips_damaged_checkpoints(tmp_path, fmt: str, case: str) -> None:
    """On 2 ranks: both choose the same checkpoint, the newest intact one, which loads and equals the parameters of
    its step; then offline (this process, no process group) the same choice, the same skipped ones."""
    root = str(tmp_path)
    results = run_on_ranks(_on_ranks, 2, root, fmt, case)
    assert results[0]["found"] == results[1]["found"]
    first = results[0]
    _check(first["found"], root, first["step"], first["skipped"], fmt)
    offline = latest(root)
    assert offline is not None
    _check(offline, root, first["step"], first["skipped"], fmt)
    assert offline.path == first["found"].path and offline.save_id == first["found"].save_id


def _save_all(root: str) -> None:
    _train_and_save(root, "dcp")


def test_nothing_usable_and_the_command_line(tmp_path, capsys) -> None:
    """Every checkpoint damaged: None on every rank and offline, and `inspect --latest` exits 1 listing each with its
    reason; intact again (one restored), the command names it; a missing root is a usage error."""
    root = str(tmp_path / "ckpt")
    run_on_ranks(_save_all, 2, root)
    for step in range(1, STEPS + 1):
        _flip(os.path.join(root, f"step_{step}"))

    assert run_on_ranks(latest, 2, root) == [None, None]
    assert latest(root) is None
    assert main(["inspect", "--latest", root]) == 1
    out = capsys.readouterr().out
    assert "no complete and intact checkpoint" in out
    for step in range(1, STEPS + 1):
        assert f"skipped:     {os.path.join(root, f'step_{step}')}: " in out
    _flip(os.path.join(root, "step_2"))  # the same byte flipped back: intact again
    assert main(["inspect", "--latest", root, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["path"] == os.path.join(root, "step_2") and body["format"] == "dcp"
    assert [s["path"] for s in body["skipped"]] == [os.path.join(root, "step_3")]
    assert main(["inspect", "--latest", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["inspect"]) == 2


def test_an_empty_root_and_non_checkpoints(tmp_path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.txt").write_text("not a checkpoint")
    (tmp_path / "notes.txt").write_text("")
    assert latest(str(tmp_path)) is None


_SEALED_STEPS = 2


def _sealed_and_plain(root: str) -> None:
    """At each step, our sealed DCP save (step_<n>) and then, as an exporter might, torch's plain dcp.save of the same
    state (export_<n>, newer, carrying no seal of ours)."""
    model = build_ours(CONFIG)[1]
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(1, _SEALED_STEPS + 1):
        loss_of(model(batch(CONFIG, step))).backward()
        optim.step()
        optim.zero_grad()
        _save(model, optim, "dcp", os.path.join(root, f"step_{step}"))
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.save(state, checkpoint_id=os.path.join(root, f"export_{step}"))
    dist.barrier()


def test_a_sealed_checkpoint_is_preferred_over_an_unsealed_one_of_its_step(tmp_path) -> None:
    """Of two intact checkpoints of one step, the sealed one (save identities and CRC-32s of every file) is chosen
    though the unsealed one is newer, on every rank and offline; the unsealed one is listed with the reason. A newer
    step still wins unsealed, and where the sealed one is damaged the unsealed one of its step is taken."""
    root = str(tmp_path)
    run_on_ranks(_sealed_and_plain, 2, root)
    sealed, plain = os.path.join(root, f"step_{_SEALED_STEPS}"), os.path.join(root, f"export_{_SEALED_STEPS}")
    assert os.path.getmtime(os.path.join(plain, ".metadata")) > os.path.getmtime(os.path.join(sealed, ".metadata"))
    found = run_on_ranks(latest, 2, root)
    assert found[0] == found[1] and found[0] is not None
    offline = latest(root)
    for result in (found[0], offline):
        assert result is not None and result.path == sealed, result
        assert result.checked == "one save (identities), CRC-32 of every file"
        reasons = {s.path: s.reason for s in result.skipped}
        assert set(reasons) == {plain} and "carries no seal" in reasons[plain] and sealed in reasons[plain]
    _flip(sealed)  # the sealed one damaged: the intact unsealed one of the same step is the answer
    result = latest(root)
    assert result is not None and result.path == plain and "no save identity" in result.checked
    assert {s.path for s in result.skipped} == {sealed}
    shutil.copytree(plain, os.path.join(root, f"export_{_SEALED_STEPS + 1}"))  # an unsealed newer step
    result = latest(root)
    assert result is not None and result.path == os.path.join(root, f"export_{_SEALED_STEPS + 1}")
