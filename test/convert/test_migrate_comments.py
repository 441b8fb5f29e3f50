"""`fsdp-legacy migrate` keeps the comments written inside an `FSDP(...)` call (beside a keyword, on a line of their
own, after the closing parenthesis): above the fully_shard code it became, after the tool's own notes, once."""

from __future__ import annotations

import pytest

pytest.importorskip("libcst")

from fsdp_legacy.migrate.rewriter import migrate_source

_PROGRAM = """
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def build():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    # above the call
    model = FSDP(
        net,  # the whole network
        # one unit per layer
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,  # keep them after forward
        device_id=torch.device("cpu"),
    )  # done
    return model
"""


def test_the_comments_inside_a_construction_are_kept() -> None:
    result = migrate_source(_PROGRAM)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert "fully_shard(net, **fsdp_kwargs)" in out
    expected = ["# above the call", "# the whole network", "# one unit per layer", "# keep them after forward"]
    expected.append("# done")
    comments = [line.strip() for line in out.splitlines() if line.strip().startswith("#")]
    assert [c for c in comments if not c.startswith("# fsdp-legacy migrate:")] == expected
    assert comments.index("# the whole network") > max(
        i for i, c in enumerate(comments) if c.startswith("# fsdp-legacy migrate:")
    )
    again = migrate_source(out)  # a second pass finds nothing left
    assert (again.migrated, again.findings) == (out, [])
