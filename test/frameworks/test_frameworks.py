"""Unmodified frameworks on fsdp_legacy through the supported switch (FSDP_LEGACY=1), against the same runs on torch's
own FSDP1: Accelerate's FSDP plugin, Lightning's FSDPStrategy (Fabric and Trainer), transformers' Trainer (with PEFT
LoRA) and TRL's SFT, DPO and GRPO trainers, each configuration trained on 2 CPU ranks, clipped, saved, loaded or
resumed, and trained on (test/frameworks/run_*.py). Equal: losses, gradient norms, parameter dtypes, what was restored,
the training after resuming, and every tensor of every checkpoint file.

Needs the `frameworks` extra (pip install -e '.[frameworks]'); CI runs these with `pytest -m frameworks`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from torchrun import torchrun

pytestmark = pytest.mark.frameworks
# pickled RNG states, training arguments and the like: not tensors of ours (rng_state_*.pth and training_args.bin do not
# load with weights_only=True)
SKIPPED_FILES = ("random_states", "scheduler", "scaler", "rng_state", "training_args")


def _launch(script: str, impl: str, out: Path) -> dict[str, Any]:
    done = torchrun(script, ["--impl", impl, "--out", str(out)], ours=impl == "ours")
    assert done.returncode == 0, f"{script} --impl {impl} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def workdir() -> Any:
    with tempfile.TemporaryDirectory() as directory:
        yield Path(directory)


def _runs(script: str, workdir: Path) -> tuple[dict, dict, Path, Path]:
    ours, theirs = workdir / f"{script}-ours", workdir / f"{script}-torch"
    return _launch(script, "ours", ours), _launch(script, "torch", theirs), ours, theirs


@pytest.fixture(scope="module")
def accelerate_runs(workdir: Path) -> tuple[dict, dict, Path, Path]:
    pytest.importorskip("accelerate")
    return _runs("run_accelerate.py", workdir)


@pytest.fixture(scope="module")
def lightning_runs(workdir: Path) -> tuple[dict, dict, Path, Path]:
    pytest.importorskip("lightning")
    return _runs("run_lightning.py", workdir)


@pytest.fixture(scope="module")
def transformers_runs(workdir: Path) -> tuple[dict, dict, Path, Path]:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    return _runs("run_transformers.py", workdir)


@pytest.fixture(scope="module")
def trl_runs(workdir: Path) -> tuple[dict, dict, Path, Path]:
    pytest.importorskip("trl")
    return _runs("run_trl.py", workdir)


def _close(value: Any, expected: Any, what: str) -> bool:
    """Whether two figures agree (parameter checksums by name, float lists, or anything else exactly)."""
    if isinstance(value, dict) and all(isinstance(v, float) for v in value.values()):
        return value.keys() == expected.keys() and all(
            abs(total - expected[param]) <= 1e-5 * max(1.0, abs(expected[param])) for param, total in value.items()
        )
    if isinstance(value, list) and value and isinstance(value[0], float):
        return torch.allclose(torch.tensor(value), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    return value == expected


def _same_figures(ours: dict, theirs: dict) -> None:
    """Every figure of every run equal to torch's FSDP1's, except the resumes torch gets wrong (_resumes_exactly)."""
    assert ours.keys() == theirs.keys()
    for name, mine in ours.items():
        torch_run = theirs[name]
        assert mine["fsdp"].startswith("fsdp_legacy") and torch_run["fsdp"].startswith("torch.distributed.fsdp")
        assert mine.keys() == torch_run.keys(), name
        for figure, value in mine.items():
            if figure in ("fsdp", "ref_fsdp"):  # the implementations (checked above and in the tests)
                continue
            if figure.endswith("_after_resume") and "uninterrupted_losses" in mine:
                continue
            assert _close(value, torch_run[figure], figure), f"{name}: {figure}: {value} != {torch_run[figure]}"


def _resumes_exactly(ours: dict, theirs: dict) -> int:
    """The SHARDED_STATE_DICT resumes, through Accelerate's load_fsdp_optimizer: a fresh optimizer's
    FSDP.optim_state_dict filled by dcp.load. Ours resumes as the same steps run without a break (the uninterrupted
    figures, equal to torch's above); torch's FSDP1 restores no optimizer state there, so its resumed steps differ
    from its own uninterrupted ones (docs/compatibility.md). The number of such runs."""
    count = 0
    for name, mine in ours.items():
        if "uninterrupted_losses" not in mine:
            continue
        count += 1
        torch_run = theirs[name]
        for resumed, whole in (
            ("losses_after_resume", "uninterrupted_losses"),
            ("params_after_resume", "params_uninterrupted"),
        ):
            assert _close(mine[resumed], mine[whole], resumed), f"{name}: {resumed} {mine[resumed]} != {mine[whole]}"
            assert not _close(torch_run[resumed], torch_run[whole], resumed), f"{name}: torch's {resumed} is right now"
    return count


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (a torch.save or safetensors file, or a DCP directory), by its path in the nested
    dict."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return {f"/{key}": value for key, value in load_file(path).items()}
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as scratch:
            dcp_to_torch_save(path, Path(scratch) / "whole.pt")
            return _tensors(Path(scratch) / "whole.pt")
    found: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}/{index}", item)

    walk("", torch.load(path, weights_only=True, map_location="cpu"))
    return found


def _checkpoints(root: Path) -> list[Path]:
    """The checkpoint files and DCP directories a run wrote, relative to its directory."""
    found = []
    for path in sorted(root.rglob("*")):
        if path.is_dir() and (path / ".metadata").exists():
            found.append(path.relative_to(root))
        elif (
            path.is_file()
            and path.suffix in (".bin", ".pt", ".ckpt", ".pth", ".safetensors")
            and not path.parent.joinpath(".metadata").exists()
        ):
            if not path.name.startswith(SKIPPED_FILES):
                found.append(path.relative_to(root))
    return found


def _expected_file(ours: Path, theirs: Path, relative: Path) -> Path:
    """torch's file at `relative`; for a checkpoint saved after a SHARDED resume, where torch's FSDP1 lost the
    optimizer's state (_resumes_exactly), our own uninterrupted run's file of the same step instead (itself compared
    with torch's)."""
    run, rest = relative.parts[0], Path(*relative.parts[1:])
    whole = ours / f"{run}-uninterrupted" / rest
    return whole if not run.endswith("-uninterrupted") and whole.exists() else theirs / relative


def _same_checkpoints(ours: Path, theirs: Path) -> int:
    files = _checkpoints(ours)
    assert files == _checkpoints(theirs)
    compared = 0
    for relative in files:
        mine, torch_s = _tensors(ours / relative), _tensors(_expected_file(ours, theirs, relative))
        assert mine.keys() == torch_s.keys(), relative
        for key, value in mine.items():
            expected = torch_s[key]
            assert value.dtype == expected.dtype and value.shape == expected.shape, f"{relative}{key}"
            low = value.dtype in (torch.bfloat16, torch.float16)
            torch.testing.assert_close(value, expected, rtol=1e-2 if low else 1e-5, atol=1e-5, msg=f"{relative}{key}")
            compared += 1
    return compared


def test_accelerate_trains_saves_and_resumes_as_on_torch_fsdp1(accelerate_runs: tuple) -> None:
    ours, theirs, _, _ = accelerate_runs
    _same_figures(ours, theirs)
    assert all(r["restored_max_difference"] == 0.0 for r in ours.values())
    compiled = [r for r in ours.values() if r["config"]["dynamo_backend"] != "no"]
    assert compiled and all(r["compiled"] for r in compiled)  # Accelerator(dynamo_backend="inductor") compiled


def test_accelerate_checkpoints_hold_torch_fsdp1s_tensors(accelerate_runs: tuple) -> None:
    _, _, ours, theirs = accelerate_runs
    assert _same_checkpoints(ours, theirs) > 100


def test_lightning_fabric_and_trainer_train_save_and_resume_as_on_torch_fsdp1(lightning_runs: tuple) -> None:
    ours, theirs, _, _ = lightning_runs
    _same_figures(ours, theirs)
    assert {r["config"]["api"] for r in ours.values()} == {"fabric", "trainer"}


def test_lightning_checkpoints_hold_torch_fsdp1s_tensors(lightning_runs: tuple) -> None:
    _, _, ours, theirs = lightning_runs
    assert _same_checkpoints(ours, theirs) > 100


def test_transformers_trainer_and_peft_lora_train_save_and_resume_as_on_torch_fsdp1(transformers_runs: tuple) -> None:
    ours, theirs, _, _ = transformers_runs
    _same_figures(ours, theirs)
    assert _resumes_exactly(ours, theirs) == 1
    assert {r["config"]["lora"] for r in ours.values()} == {False, True}
    for run in ours.values():
        if run["config"]["lora"]:  # only the adapters train
            assert run["lora_params"] and all(".lora_" in name for name in run["lora_params"])
            assert run["frozen_max_change"] == 0.0 and run["lora_min_change"] > 0.0
        elif run["config"]["torch_compile"]:  # the whole wrapped model compiled (run_transformers.py: no resuming)
            assert run["compiled"] and len(run["losses"]) == 3
        else:  # resumed from checkpoint-3 to step 5
            assert run["compute_dtype"] == ("torch.bfloat16" if run["config"]["bf16"] else "None")
            assert run["step"] == 5 and len(run["losses"]) == 3 and len(run["losses_after_resume"]) == 2


def test_transformers_checkpoints_hold_torch_fsdp1s_tensors(transformers_runs: tuple) -> None:
    _, _, ours, theirs = transformers_runs
    assert _same_checkpoints(ours, theirs) > 100


def test_trl_sft_dpo_and_grpo_train_as_on_torch_fsdp1(trl_runs: tuple) -> None:
    ours, theirs, _, _ = trl_runs
    _same_figures(ours, theirs)
    assert _resumes_exactly(ours, theirs) == 1
    assert {r["config"]["trainer"] for r in ours.values()} == {"sft", "dpo", "grpo"}
    for name, run in ours.items():
        assert run["gradient_checkpointing"], "TRL's default, checkpointing inside the units, is under test"
        assert max(run["logged_grad_norm"]) > 0.0
        if run["config"]["trainer"] == "sft":
            if not run["config"]["lora"]:  # resumed from checkpoint-3 to step 5
                assert run["step"] == 5 and len(run["losses_after_resume"]) == 2
        else:  # the reference model TRL wrapped itself
            assert run["ref_fsdp"].startswith("fsdp_legacy") and run["params_ref_model"]
            assert theirs[name]["ref_fsdp"].startswith("torch.distributed.fsdp")
        if run["config"]["trainer"] == "grpo":  # completions sampled inside summon_full_params scored differently
            assert max(run["logged_reward"]) > 0.0 and min(run["logged_frac_reward_zero_std"]) < 1.0


def test_trl_checkpoints_hold_torch_fsdp1s_tensors(trl_runs: tuple) -> None:
    _, _, ours, theirs = trl_runs
    assert _same_checkpoints(ours, theirs) > 100
