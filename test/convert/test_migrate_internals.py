"""`fsdp-legacy migrate` on FSDP1's private modules (`torch.distributed.fsdp._runtime_utils._lazy_init`,
`_common_utils.clean_tensor_name` / `TrainingState`, `_reshard`): before, they were left in place without a word.
Each is now a finding of its own kind ("internal"), at its import with the lines that use it, and the rest of the
file migrates as usual. The oracle for "the rest as usual": torch's FSDP1 running the original and FSDP2 running the
migration at 2 ranks give the same losses and, through the kept `clean_tensor_name`, the same parameter names."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from fsdp_legacy.migrate.rewriter import migrate_source

_USES = textwrap.dedent(
    """
    import torch.distributed.fsdp._traversal_utils as traversal
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._common_utils import TrainingState, clean_tensor_name
    from torch.distributed.fsdp._runtime_utils import _lazy_init, _reshard
    from torch.distributed.fsdp._fully_shard import FSDPModule


    def step(net):
        model = FSDP(net)
        _lazy_init(model, model)
        if model.training_state == TrainingState.IDLE:
            names = [clean_tensor_name(n) for n, _ in model.named_parameters()]
        _reshard(model, model._handle, True)
        return names, traversal._get_fsdp_states(model), FSDPModule
    """
)


def test_each_internal_is_reported_with_its_uses() -> None:
    result = migrate_source(_USES)
    internal = {f.what.split("`")[1]: f for f in result.findings if f.kind == "internal"}
    base = "torch.distributed.fsdp."
    assert set(internal) == {
        base + "_traversal_utils",
        base + "_common_utils.TrainingState",
        base + "_common_utils.clean_tensor_name",
        base + "_runtime_utils._lazy_init",
        base + "_runtime_utils._reshard",
        base + "_traversal_utils._get_fsdp_states",
    }  # FSDP2's own private package is not FSDP1's
    lazy = internal[base + "_runtime_utils._lazy_init"]
    assert lazy.line == 5 and "used at line 11" in lazy.why and "first forward" in lazy.fix
    assert "used at line 13" in internal[base + "_common_utils.clean_tensor_name"].why
    assert "FSDP2 parameter names carry no FSDP prefixes" in internal[base + "_common_utils.clean_tensor_name"].fix
    # the rest migrates: the construction, and the private attribute is the usual finding
    assert "fully_shard(net)" in result.migrated
    # FSDP1's own attribute (FSDP2's module has no training_state) and the private one: the usual findings
    assert {f.line for f in result.findings if f.kind != "internal"} == {12, 14}  # model.training_state, ._handle
    for line in _USES.splitlines()[1:6]:  # the imports stay as written
        if "_fully_shard" not in line and "import FullyShardedDataParallel" not in line:
            assert line in result.migrated


def test_a_file_without_internals_has_no_such_finding() -> None:
    source = (
        "from torch.distributed.fsdp import fully_shard\nfrom torch.distributed.fsdp._fully_shard import FSDPModule\n"
    )
    result = migrate_source(source)
    assert (result.migrated, result.findings) == (source, [])


_PROGRAM = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._common_utils import clean_tensor_name
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def run():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    policy = ModuleWrapPolicy({nn.Linear})
    model = FSDP(net, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(4):
        torch.manual_seed(100 + 10 * dist.get_rank() + step)  # different data on each rank
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, sorted(clean_tensor_name(name) for name, _ in model.named_parameters())
"""


def _both(fsdp1_source: str, migrated_source: str) -> list[Any]:
    seen = []
    for source in (fsdp1_source, migrated_source):
        scope: dict[str, Any] = {}
        exec(compile(source, "program.py", "exec"), scope)
        seen.append(scope["run"]())
    return seen


def test_the_rest_of_the_file_trains_as_fsdp1(ranks: Any) -> None:
    result = migrate_source(_PROGRAM)
    assert [(f.line, f.kind) for f in result.findings] == [(6, "internal")], [f.format("x.py") for f in result.findings]
    assert "from torch.distributed.fsdp._common_utils import clean_tensor_name" in result.migrated
    assert "fully_shard(module)" in result.migrated
    for (losses1, names1), (losses2, names2) in ranks(_both, 2, _PROGRAM, result.migrated):
        assert names1 == names2 == ["0.bias", "0.weight", "2.bias", "2.weight"]
        torch.testing.assert_close(losses2, losses1, rtol=1e-5, atol=0)
