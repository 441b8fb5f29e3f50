"""`fsdp-legacy migrate` end to end: each program of test/migrate_corpus/ (FSDP1) is migrated, and both versions run
with torchrun at 2 CPU ranks side by side; what rank 0 prints (losses, norms, checksums) must agree, and the FSDP2
program must resume from the FSDP1 program's checkpoint as the FSDP1 program itself went on."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

import repo_paths
from torchrun import free_port

pytest.importorskip("libcst")

from fsdp_legacy.cli import main as cli_main
from fsdp_legacy.migrate.rewriter import migrate_source

CORPUS = repo_paths.TEST_DIR / "migrate_corpus"
REPO = repo_paths.REPO


# -- end to end: both programs under torchrun -----------------------------------------------------------------------


FP32_RTOL = 1e-5
# FSDP1 and FSDP2 in bf16 (param, reduce and buffer dtypes) gave bit-identical losses here (torch 2.11, 2.13 and
# 2.14, CPU, gloo, 2 ranks: docs/migration.md section 7); the margin is for reduction orders that differ elsewhere.
BF16_RTOL = 1e-3


def _torchrun(*runs: tuple[Any, ...]) -> list[dict[str, list[float]]]:
    """Run each (script, *args) with torchrun at 2 ranks, all side by side, through migrate_corpus/launch.py (a
    script named *_fsdp1.py on torch's FSDP1 mended for the CPU); for each, the `key value` lines its rank 0 printed,
    by key."""
    env = {k: v for k, v in os.environ.items() if k != "FSDP_LEGACY"} | {"OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    started = []
    for script, *args in runs:
        launcher = [str(CORPUS / "launch.py")] + (["--fsdp1-on-cpu"] if Path(script).name.endswith("_fsdp1.py") else [])
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", *launcher, str(script), *map(str, args),
        ]  # fmt: skip
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        started.append((subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True), out, err))
    printed = []
    for process, out, err in started:
        process.wait(timeout=300)
        out.seek(0), err.seek(0)
        assert process.returncode == 0, err.read()[-4000:]
        values: dict[str, list[float]] = {}
        for key, _, value in (line.partition(" ") for line in out.read().splitlines()):
            if re.fullmatch(r"-?[\d.e+-]+|nan|inf", value):
                values.setdefault(key, []).append(float(value))
        printed.append(values)
    return printed


def _migrate_copy(name: str, tmp_path: Path) -> tuple[Path, Path]:
    fsdp1 = tmp_path / f"{name}_fsdp1.py"
    fsdp2 = tmp_path / f"{name}_fsdp2.py"
    fsdp1.write_text((CORPUS / f"{name}.py").read_text())
    fsdp2.write_text(fsdp1.read_text())
    assert cli_main(["migrate", str(fsdp2), "--write"]) == 0  # fully migrated
    migrated = fsdp2.read_text()
    assert "FullyShardedDataParallel" not in migrated
    again = migrate_source(migrated)  # a second pass finds nothing left
    assert (again.migrated, again.findings) == (migrated, []), [f.format(fsdp2.name) for f in again.findings]
    return fsdp1, fsdp2


def _assert_close(fsdp2: list[float], fsdp1: list[float], rtol: float = FP32_RTOL) -> None:
    assert len(fsdp2) == len(fsdp1) > 0
    worst = max(abs(a - b) / abs(b) for a, b in zip(fsdp2, fsdp1, strict=True))
    print(f"FSDP1 {fsdp1}\nFSDP2 {fsdp2}\nworst relative difference {worst:.3g}")
    assert worst <= rtol


def _compare(
    name: str,
    tmp_path: Path,
    *args: str,
    fsdp1_args: tuple[str, ...] = (),
    fsdp2_args: tuple[str, ...] = (),
    rtol: float = FP32_RTOL,
) -> tuple[Path, dict[str, list[float]]]:
    """Migrate corpus program `name`, run the FSDP1 original (with `args` and `fsdp1_args`) and the migrated program
    (with `args` and `fsdp2_args`) side by side, and check that everything rank 0 printed (losses, norms) agrees
    within `rtol`. Returns the migrated program and the FSDP1 program's output."""
    fsdp1, fsdp2 = _migrate_copy(name, tmp_path)
    before, after = _torchrun((fsdp1, *args, *fsdp1_args), (fsdp2, *args, *fsdp2_args))
    assert set(after) == set(before) and "loss" in before, (before, after)
    for key in before:
        _assert_close(after[key], before[key], rtol)
    return fsdp2, before


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_readme_style_program_trains_the_same(tmp_path: Path) -> None:
    """`model.apply(init_weights)` after wrapping included: apply_full initializes the full parameters, as FSDP1's
    apply does (nn.Module.apply on the shards would start from other weights)."""
    fsdp2, _ = _compare("readme_style", tmp_path)
    assert "    apply_full(model, init_weights)" in fsdp2.read_text()


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_accumulate_clip_sharded_resumes_from_fsdp1_checkpoint(tmp_path: Path) -> None:
    fsdp1, fsdp2 = _migrate_copy("accumulate_clip_sharded", tmp_path)
    checkpoint = tmp_path / "ckpt"
    (before,) = _torchrun((fsdp1, "--steps", "6", "--save", checkpoint, "--save-after", "2"))
    # the FSDP2 program resumes from the FSDP1 program's SHARDED checkpoint and continues as it did, through steps
    # that accumulate under no_sync and clip
    (after,) = _torchrun((fsdp2, "--steps", "6", "--resume", checkpoint, "--first-step", "3"))
    _assert_close(after["loss"], before["loss"][3:])


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_tutorial_style_program_trains_the_same_and_resumes_from_fsdp1_full_checkpoint(tmp_path: Path) -> None:
    """Size-based policy, Adadelta + StepLR, a FULL checkpoint (rank0_only, offload_to_cpu) torch.save'd by rank 0,
    and the parameters read under summon_full_params (their norm is printed and compared)."""
    checkpoint = tmp_path / "full.pt"
    fsdp2, before = _compare(
        "tutorial_style", tmp_path, "--epochs", "4", fsdp1_args=("--save", str(checkpoint), "--save-epoch", "2")
    )
    source = fsdp2.read_text()
    assert "apply_fully_shard(model, my_auto_wrap_policy)" in source and "with full_params(model" in source
    # every rank loads the FSDP1 file (set_model_state_dict / set_optimizer_state_dict, full_state_dict=True) and
    # trains epochs 3 and 4 as the FSDP1 run did after saving
    (after,) = _torchrun((fsdp2, "--epochs", "4", "--resume", checkpoint))
    _assert_close(after["loss"], before["loss"][8:])
    _assert_close(after["norm"], before["norm"])


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_t5_style_program_in_bf16_with_activation_checkpointing(tmp_path: Path) -> None:
    """transformer_auto_wrap_policy, bf16 MixedPrecision with a buffer dtype, activation checkpointing applied after
    wrapping (moved before fully_shard), and summon_full_params that must show fp32 parameters."""
    fsdp2, _ = _compare("t5_style", tmp_path, rtol=BF16_RTOL)
    source = fsdp2.read_text()
    assert source.index("apply_fsdp_checkpointing(model)\n") < source.index("fully_shard(model")


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_meta_init_program_materializes_as_fsdp1(tmp_path: Path) -> None:
    """A model built on the meta device, param_init_fn and sync_module_states: the same initial values unit by unit
    (a different initialization could not give the same losses)."""
    fsdp2, _ = _compare("meta_init", tmp_path)
    assert "param_init_fn=init_weights, sync_module_states=True" in fsdp2.read_text()


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_legacy_optimizer_api_program_trains_the_same_and_resumes_from_fsdp1(tmp_path: Path) -> None:
    """Adam, FSDP.set_state_dict_type (FULL, rank0_only) followed to model.state_dict() / load_state_dict(),
    full_optim_state_dict saved by rank 0, rekey_optim_state_dict to parameter ids (its checksum printed), and the
    optimizer state loaded back by scatter_full_optim_state_dict (rank 0's, two statements) or
    shard_full_optim_state_dict (every rank's, nested)."""
    fsdp1_file, fsdp2_file = tmp_path / "fsdp1.pt", tmp_path / "fsdp2.pt"
    fsdp2, before = _compare(
        "legacy_optim",
        tmp_path,
        *("--steps", "6", "--save-after", "2"),
        fsdp1_args=("--save", str(fsdp1_file)),
        fsdp2_args=("--save", str(fsdp2_file)),
    )
    assert "rekeyed" in before
    source = fsdp2.read_text()
    full_rank0 = "StateDictOptions(full_state_dict=True, cpu_offload=True)"  # the type set_state_dict_type set
    assert f"states = get_model_state_dict(model, options={full_rank0})" in source
    assert "broadcast_from_rank0=True" in source
    # FSDP1's checkpoint (its optimizer state with one `step` tensor per unit) into the FSDP2 program, both ways:
    # the steps after it are FSDP1's own steps after saving
    resume = ("--steps", "6", "--resume", fsdp1_file, "--first-step", "3")
    scattered, sharded = _torchrun((fsdp2, *resume), (fsdp2, *resume, "--load", "shard"))
    _assert_close(scattered["loss"], before["loss"][3:])
    _assert_close(sharded["loss"], before["loss"][3:])


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_llama_recipes_style_program_trains_the_same_and_resumes_from_fsdp1(tmp_path: Path) -> None:
    """A module-level FullStateDictConfig used by a handler whose model is a parameter, full_optim_state_dict saved by
    rank 0, scatter_full_optim_state_dict to resume, clipping and accumulation in a train function."""
    fsdp1_dir, fsdp2_dir = tmp_path / "fsdp1", tmp_path / "fsdp2"
    args = ("--steps", "5", "--save-after", "1")
    fsdp2, before = _compare("llama_recipes_style", tmp_path, *args, fsdp1_args=("--save", str(fsdp1_dir)),
                             fsdp2_args=("--save", str(fsdp2_dir)))  # fmt: skip
    assert "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))" in (
        fsdp2.read_text()
    )
    (after,) = _torchrun((fsdp2, "--steps", "5", "--resume", fsdp1_dir, "--first-step", "2"))
    _assert_close(after["loss"], before["loss"][4:])  # two micro-batches per step


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_qlora_style_program_in_bf16_from_meta_on_other_ranks(tmp_path: Path) -> None:
    """Rank 0 real, the others on meta (a lambda param_init_fn, sync_module_states), a policy built by a function
    (_or_policy of lambda and transformer policies), frozen base with LoRA, bf16 with a buffer dtype, no_sync, and
    the LoRA weights of a FULL rank0_only state dict (their checksum printed); resumed from FSDP1's file."""
    saved = tmp_path / "lora.pt"
    saves = {"fsdp1_args": ("--save", str(saved)), "fsdp2_args": ("--save", str(tmp_path / "fsdp2.pt"))}
    fsdp2, before = _compare("qlora_style", tmp_path, "--steps", "4", rtol=BF16_RTOL, **saves)  # type: ignore[arg-type]
    assert "apply_fully_shard(model, get_wrapping_policy(), param_init_fn=" in fsdp2.read_text()
    fsdp1 = tmp_path / "qlora_style_fsdp1.py"
    resumed_fsdp1, resumed = _torchrun(
        (fsdp1, "--steps", "2", "--resume", saved), (fsdp2, "--steps", "2", "--resume", saved)
    )
    _assert_close(resumed["loss"], resumed_fsdp1["loss"], BF16_RTOL)


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_accelerate_style_sharded_helpers_resume_from_fsdp1(tmp_path: Path) -> None:
    """Accelerate's save_fsdp_model / save_fsdp_optimizer (SHARDED, DCP), and the resume through load_fsdp_model and
    load_fsdp_optimizer (load_sharded_optimizer_state_dict, optim_state_dict_to_load with keywords)."""
    args = ("--steps", "6", "--save-after", "2")
    fsdp2, before = _compare("accelerate_style", tmp_path, *args, fsdp1_args=("--output", str(tmp_path / "fsdp1")),
                             fsdp2_args=("--output", str(tmp_path / "fsdp2")))  # fmt: skip
    assert "torch.distributed.checkpoint.load(optim_state, storage_reader=" in fsdp2.read_text()
    resume = ("--steps", "6", "--output", tmp_path / "again", "--resume", tmp_path / "fsdp1", "--first-step", "3")
    (after,) = _torchrun((fsdp2, *resume))
    _assert_close(after["loss"], before["loss"][3:])


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_olmo_style_trainer_saves_and_restores_in_its_methods(tmp_path: Path) -> None:
    """self._model under FULL blocks with keyword configs inside methods, a wrap policy returned by a method of the
    model, SHARD_GRAD_OP; the FSDP2 trainer restores FSDP1's unsharded checkpoint."""
    fsdp1_file, fsdp2_file = tmp_path / "fsdp1.pt", tmp_path / "fsdp2.pt"
    saves = {"fsdp1_args": ("--save", str(fsdp1_file)), "fsdp2_args": ("--save", str(fsdp2_file))}
    fsdp2, before = _compare("olmo_style", tmp_path, "--steps", "6", "--save-after", "2", **saves)  # type: ignore[arg-type]
    assert "get_model_state_dict(self._model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))" in (
        fsdp2.read_text()
    )
    (after,) = _torchrun((fsdp2, "--steps", "6", "--resume", fsdp1_file))
    _assert_close(after["loss"], before["loss"][3:])


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_torchtune_style_builder_sets_the_type_for_its_caller(tmp_path: Path) -> None:
    """FSDP(module=...) and set_state_dict_type inside the builder, the state-dict calls in the caller."""
    fsdp1_file, fsdp2_file = tmp_path / "fsdp1.pt", tmp_path / "fsdp2.pt"
    saves = {"fsdp1_args": ("--save", str(fsdp1_file)), "fsdp2_args": ("--save", str(fsdp2_file))}
    fsdp2, before = _compare("torchtune_style", tmp_path, "--epochs", "4", "--save-epoch", "1", **saves)  # type: ignore[arg-type]
    assert "the state-dict calls on what setup_model() returns take its options" in fsdp2.read_text()
    (after,) = _torchrun((fsdp2, "--epochs", "4", "--resume", fsdp1_file))
    _assert_close(after["loss"], before["loss"][6:])  # three steps an epoch


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_dinov2_style_student_teacher_through_a_wrapper_factory(tmp_path: Path) -> None:
    """get_fsdp_wrapper's partial(FSDP, ...) with the strategy and dtypes looked up by name, four FSDP roots (student
    and teacher backbone and head), the teacher's EMA over the parameters, FSDP.fsdp_modules counting the units, a
    SHARDED checkpoint of the whole meta-architecture; the FSDP2 program resumes from FSDP1's."""
    args = ("--steps", "6", "--save-after", "2")
    fsdp2, before = _compare("dinov2_style", tmp_path, *args, fsdp1_args=("--save", str(tmp_path / "fsdp1")),
                             fsdp2_args=("--save", str(tmp_path / "fsdp2")))  # fmt: skip
    assert "partial(\n        fully_shard_fsdp1," in fsdp2.read_text()
    assert before["units"] == [9.0]  # per submodel: the root and its units (PatchEmbed and 3 Blocks; 3 Linear)
    (after,) = _torchrun((fsdp2, "--steps", "6", "--resume", tmp_path / "fsdp1"))
    _assert_close(after["loss"], before["loss"][3:])
    _assert_close(after["norm"], before["norm"])


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
def test_fastchat_style_save_model_under_a_type_is_refused_whole_and_reported(tmp_path: Path, capsys: Any) -> None:
    """trainer.save_model() under FastChat's FULL block: the tool cannot see into it, so the block stays, and with it
    the whole file (rewritten around it, the FSDP1 block would set nothing on the FSDP2 model and fail leaving it).
    The report says so, exit 1, the file untouched, and a second run reproduces it exactly; the original runs."""
    program = tmp_path / "fastchat_style_fsdp1.py"
    source = (CORPUS / "fastchat_style.py").read_text()
    program.write_text(source)
    reports = []
    for _ in range(2):
        assert cli_main(["migrate", str(program), "--write"]) == 1
        assert program.read_text() == source
        reports.append(capsys.readouterr().err)
    assert reports[0] == reports[1]
    lines = [line.split(": ", 1)[1] for line in reports[0].splitlines()]
    assert len(lines) == 3, reports[0]
    assert lines[1].startswith("`with FSDP.state_dict_type(...)`: it stays: `trainer.save_model(...)` at line 62")
    assert lines[2].startswith("FSDP1 state_dict_type blocks kept: the `FSDP.state_dict_type(...)` block at line 61")
    (printed,) = _torchrun((program, "--steps", "4", "--output", tmp_path, "--save-after", "1"))
    assert len(printed["loss"]) == 4 and len(printed["saved"]) == 1


@pytest.mark.heavy  # (about 100 s: 14 programs migrated three times; the README's suite migrates each once)
def test_the_rewrite_is_the_same_every_time() -> None:
    """The rewriter keys statements by id() while it transforms; ids of the nodes it frees were given to new ones, so a
    stale entry sometimes dropped an unrelated statement (a loop's `data = ...`, one run in ten). Every corpus program
    is rewritten to the same text, run after run (three runs of each of the 14: 28 chances for a one-in-ten slip)."""
    for program in sorted(CORPUS.glob("*.py")):
        source = program.read_text()
        texts = {migrate_source(source).migrated for _ in range(3)}
        assert len(texts) == 1, program.name
