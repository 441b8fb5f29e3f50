"""`fsdp-legacy migrate` on FSDP1's MixedPrecision where it stands on its own (a policy module's names, as in
pytorch/examples' and llama-recipes' policies/mixed_precision.py): rewritten in place with its comments where FSDP2
gets what FSDP1 did, kept and reported where it would not (a buffer_dtype nothing casts for, an FSDP(...) that takes
it and stays FSDP1)."""

from __future__ import annotations

import ast
import importlib
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from fsdp_legacy.migrate.program import migrate_program
from fsdp_legacy.migrate.report import MigrationResult
from fsdp_legacy.migrate.rewriter import migrate_source

_POLICIES = """
import torch
from torch.distributed.fsdp import MixedPrecision

fpSixteen = MixedPrecision(
    param_dtype=torch.float16,  # the weights
    # Gradient communication precision.
    reduce_dtype=torch.float16,
    cast_forward_inputs=True,  # FSDP2 casts each unit's inputs
)
"""


def test_a_policy_without_buffer_dtype_keeps_its_comments() -> None:
    result = migrate_source(_POLICIES)
    assert result.findings == []
    assert "fpSixteen = MixedPrecisionPolicy(\n    param_dtype=torch.float16,  # the weights\n" in result.migrated
    assert "    # Gradient communication precision.\n    reduce_dtype=torch.float16,\n" in result.migrated
    assert "# FSDP2 casts each unit's inputs" in result.migrated and "cast_forward_inputs" not in result.migrated
    call = ast.parse(result.migrated).body[-1].value  # type: ignore[attr-defined]
    assert [k.arg for k in call.keywords] == ["param_dtype", "reduce_dtype"]


def test_a_buffer_dtype_no_construction_casts_for_is_kept_and_reported() -> None:
    """FSDP2's policy has no buffer_dtype: dropped, the buffers would silently stay in their own dtype."""
    source = _POLICIES.replace("cast_forward_inputs=True", "buffer_dtype=torch.float16")
    result = migrate_source(source)
    assert result.migrated == source
    assert [f.line for f in result.findings] == [5] and "buffer_dtype" in result.findings[0].why


def test_with_the_construction_that_casts_the_buffers_it_is_rewritten() -> None:
    source = _POLICIES.replace("cast_forward_inputs=True", "buffer_dtype=torch.float16") + textwrap.dedent(
        """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def build(net):
            model = FSDP(net, mixed_precision=fpSixteen)
            return model
        """
    )
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    assert "fpSixteen = MixedPrecisionPolicy(" in result.migrated and "buffer_dtype=" not in result.migrated
    assert "buffer.data = buffer.data.to(torch.float16)" in result.migrated


def test_the_policy_of_a_construction_that_stays_fsdp1_stays_fsdp1s() -> None:
    """A kept FSDP(...) given FSDP2's policy fails (AttributeError keep_low_precision_grads): all or nothing."""
    source = _POLICIES + textwrap.dedent(
        """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def build(net, cfg):
            model = FSDP(net, *cfg.fsdp_args, mixed_precision=fpSixteen)
            return model
        """
    )
    result = migrate_source(source)
    assert result.migrated == source
    assert sorted(f.line for f in result.findings) == [5, 15]  # the policy, the construction


# -- a policy of another file of the program, and FSDP(...)'s positional arguments --------------------------------

_POLICY_FILES = {
    "policies/__init__.py": "from .mixed_precision import *\n",
    "policies/mixed_precision.py": textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import MixedPrecision

        bfSixteen = MixedPrecision(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.bfloat16,  # gradient communication
            buffer_dtype=torch.bfloat16,
        )
        bf16_params = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        """
    ),
}

_TRAIN = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from policies import POLICY
PRELUDE

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 1.0 / 3))

    def forward(self, x):
        return self.lin(x.to(self.lin.weight.dtype)) * self.scale  # (FSDP1 casts only the root unit's inputs)


def run():
    torch.manual_seed(0)
    net = nn.Sequential(Scaled(), Scaled(), Scaled())
    model = FSDP(
        net, auto_wrap_policy=ModuleWrapPolicy({Scaled}), mixed_precision=POLICY, device_id=torch.device("cpu")EXTRA
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(4):
        torch.manual_seed(1 + 10 * dist.get_rank() + step)  # different data on each rank
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, sorted({str(b.dtype) for b in model.buffers()})
"""


_COMPUTED = """from torch.distributed.fsdp import ShardingStrategy

STRATEGY = getattr(ShardingStrategy, "FULL_SHARD")
FSDP_EXTRA = {"sharding_strategy": STRATEGY}
FSDP_ARGS = ()  # (arguments by position the text does not show: the construction stays FSDP1)
"""


def _train(policy: str, extra: str = "") -> dict[str, str]:
    prelude = _COMPUTED if extra else ""
    train = _TRAIN.replace("POLICY", policy).replace("EXTRA", extra).replace("PRELUDE", prelude)
    return {**_POLICY_FILES, "train.py": train}


def _migrated(files: dict[str, str], root: Path) -> dict[str, MigrationResult]:
    program = migrate_program({str(root / name): text for name, text in files.items()})
    assert program.unparsable == {}
    return {name: program.results[str(root / name)] for name in files}


def _run_program(files: dict[str, str]) -> Any:
    """On a rank: the program's files written to a fresh directory, `train.run()` run from there."""
    root = Path(tempfile.mkdtemp())
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("train").run()
    finally:
        sys.path.remove(str(root))
        for module in [m for m in sys.modules if m == "train" or m.split(".")[0] == "policies"]:
            del sys.modules[module]


def _both_programs(original: dict[str, str], migrated: dict[str, str]) -> list[Any]:
    return [_run_program(original), _run_program(migrated)]


def test_a_policy_of_another_file_becomes_fsdp2s_with_its_construction(ranks: Any, tmp_path: Path) -> None:
    """Before, the trainer's `mixed_precision=bfSixteen` (an imported name) could not be read, so its FSDP(...)
    stayed FSDP1 while the policy file alone kept bfSixteen (buffer_dtype: nothing there casts) and rewrote the other
    one. Migrated together, both become FSDP2's, the trainer casting the buffers, and train as torch's FSDP1 did."""
    files = _train("bfSixteen")
    results = _migrated(files, tmp_path)
    for name, result in results.items():
        assert result.findings == [], [f.format(name) for f in result.findings]
    policies = results["policies/mixed_precision.py"].migrated
    assert "bfSixteen = MixedPrecisionPolicy(" in policies and "buffer_dtype" not in policies
    assert "# gradient communication" in policies
    train = results["train.py"].migrated
    assert '"mp_policy": bfSixteen' in train and "buffer.data = buffer.data.to(torch.bfloat16)" in train
    assert not results["policies/__init__.py"].changed
    migrated = {name: result.migrated for name, result in results.items()}
    for (losses1, buffers1), (losses2, buffers2) in ranks(_both_programs, 2, files, migrated):
        assert buffers1 == buffers2 == ["torch.bfloat16"]
        torch.testing.assert_close(losses2, losses1, rtol=1e-3, atol=0)  # bf16 (test_migrate_corpus.BF16_RTOL)


def test_a_policy_whose_construction_stays_fsdp1_stays_fsdp1s_across_files(ranks: Any, tmp_path: Path) -> None:
    """The trainer's FSDP(...) stays FSDP1 (keywords the text does not show): its policy, in another file, stays
    FSDP1's too (alone, that file rewrote it, and FSDP1 then failed on FSDP2's policy), and the program runs as it
    did; a policy nothing uses is still rewritten."""
    files = _train("bf16_params", ", *FSDP_ARGS")
    alone = migrate_source(files["policies/mixed_precision.py"])
    assert "bf16_params = MixedPrecisionPolicy(" in alone.migrated  # the file alone: the wrong half
    results = _migrated(files, tmp_path)
    assert results["train.py"].migrated == files["train.py"]
    reported = " ".join(f.what + ": " + f.why for f in results["train.py"].findings)
    assert "*args" in reported
    policies = results["policies/mixed_precision.py"]
    assert "bf16_params = MixedPrecision(param_dtype" in policies.migrated  # FSDP1's, as the construction's
    assert [f.line for f in policies.findings] == [5, 10]  # bfSixteen (buffer_dtype, unused), bf16_params (kept)
    migrated = {name: result.migrated for name, result in results.items()}
    for (losses1, buffers1), (losses2, buffers2) in ranks(_both_programs, 2, files, migrated):
        assert buffers1 == buffers2 == ["torch.float32"]
        torch.testing.assert_close(losses2, losses1, rtol=0, atol=0)


_USES_ELSEWHERE = {
    "passed on by another file": (
        "utils.py",
        "from policies import bf16_params\n\n\ndef get():\n    return bf16_params\n",
    ),
    "read as a module's attribute": ("utils.py", "import policies\n\nchoice = {'bf16': policies.bf16_params}\n"),
    "through a submodule": (
        "utils.py",
        "from policies import mixed_precision\n\nchoice = {'bf16': mixed_precision.bf16_params}\n",
    ),
}


@pytest.mark.parametrize(("name", "text"), _USES_ELSEWHERE.values(), ids=list(_USES_ELSEWHERE))
def test_a_policy_used_other_than_by_a_construction_stays_fsdp1s(tmp_path: Path, name: str, text: str) -> None:
    """It may reach an FSDP(...) the text does not show: FSDP1's. The construction taking it reads it at run time
    (fsdp1_options takes FSDP1's MixedPrecision), imported from fsdp_legacy, not torch's FSDP1."""
    files = {**_train("bf16_params"), name: text}
    results = _migrated(files, tmp_path)
    assert "bf16_params = MixedPrecision(param_dtype" in results["policies/mixed_precision.py"].migrated
    train = results["train.py"]
    assert train.findings == [], [f.format("train.py") for f in train.findings]
    assert "fsdp_kwargs = fsdp1_options(mixed_precision=bf16_params)" in train.migrated
    assert "FullyShardedDataParallel" not in train.migrated and "from fsdp_legacy.wrap import" in train.migrated


def test_a_policy_fsdp2_cannot_take_keeps_the_construction_in_another_file(tmp_path: Path) -> None:
    files = _train("bf16_params")
    files["policies/mixed_precision.py"] = files["policies/mixed_precision.py"].replace(
        "reduce_dtype=torch.bfloat16)", "reduce_dtype=torch.bfloat16, keep_low_precision_grads=True)"
    )
    results = _migrated(files, tmp_path)
    assert results["train.py"].migrated == files["train.py"]
    assert any("keep_low_precision_grads" in f.why for f in results["train.py"].findings)


def test_positional_arguments_are_reported_and_their_policy_kept() -> None:
    """FSDP1's parameters after `module` changed order between releases: the construction stays, reported once
    with why, and the policy it takes by position stays FSDP1's (before, it became FSDP2's under an FSDP1 call)."""
    source = textwrap.dedent(
        """
        import torch
        import torch.nn as nn
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


        def build(net):
            model = FSDP(net, None, ShardingStrategy.FULL_SHARD, None, ModuleWrapPolicy({nn.Linear}), None, mp)
            return model
        """
    )
    result = migrate_source(source)
    assert result.migrated == source
    assert [f.line for f in result.findings] == [7, 11]
    assert result.findings[1].what == "FSDP(module, None, ...): 6 argument(s) by position"
    assert "changed order between releases" in result.findings[1].why and "by keyword" in result.findings[1].fix


def test_a_policy_without_arguments() -> None:
    """`MixedPrecision()` (torch's own default, `mixed_precision or MixedPrecision()`) made the rewriter fail."""
    result = migrate_source("from torch.distributed.fsdp import MixedPrecision\n\nmp = MixedPrecision()\n")
    assert (result.migrated.splitlines()[-1], result.findings) == ("mp = MixedPrecisionPolicy()", [])
