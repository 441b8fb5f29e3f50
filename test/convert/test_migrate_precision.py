"""`fsdp-legacy migrate` on FSDP1's MixedPrecision where it stands on its own (a policy module's names, as in
pytorch/examples' and llama-recipes' policies/mixed_precision.py): rewritten in place with its comments where FSDP2
gets what FSDP1 did, kept and reported where it would not (a buffer_dtype nothing casts for, an FSDP(...) that takes
it and stays FSDP1)."""

from __future__ import annotations

import ast
import textwrap

import pytest

pytest.importorskip("libcst")

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
            model = FSDP(net, mixed_precision=fpSixteen, sharding_strategy=cfg.sharding_strategy)
            return model
        """
    )
    result = migrate_source(source)
    assert result.migrated == source
    assert sorted(f.line for f in result.findings) == [5, 15]  # the policy, the construction
