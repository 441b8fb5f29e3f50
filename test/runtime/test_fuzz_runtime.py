"""The runtime fuzzer (test/runtime_fuzz.py, tools/fuzz_runtime.py): seeded cases, each a small model, an FSDP
configuration and a program, run on 2 (and 4) gloo ranks with torch's FSDP1 and with ours under the switch; every loss,
gradient, clip norm, eval output, summoned parameter and state dict must be equal bit for bit, and where torch raises
ours must raise the same type. Oracle: torch's FSDP1 itself (where it hangs or hits a known CPU bug the case counts
as one without an oracle, and a campaign must keep those few). The draw is checked to be deterministic and to reach
the configurations it is meant to."""

from __future__ import annotations

import collections

import pytest

from runtime_fuzz import run_seed
from runtime_fuzz_cases import draw


def _campaign(seeds: range | tuple[int, ...], world_size: int = 2) -> tuple[list, str]:
    outcomes = [run_seed(seed, world_size=world_size) for seed in seeds]
    report = "\n".join(o.line()[:1500] for o in outcomes if o.difference or o.torch_failed)
    different = [o for o in outcomes if o.difference is not None]
    return different, report + "\n" + "\n".join(o.case.describe() for o in different)


def test_a_seed_draws_one_case() -> None:
    assert draw(7) == draw(7) and draw(7) != draw(8)
    cases = [draw(seed) for seed in range(300)]
    strategies = collections.Counter(c.strategy for c in cases)
    assert len(strategies) == 5, strategies
    assert {c.use_orig_params for c in cases} == {True, False}
    assert {c.policy[0] for c in cases} == {"none", "classes", "size"}
    ops = {op[0] for c in cases for op in c.program}
    assert ops == {"step", "no_sync", "eval", "summon", "save_load"}, ops
    assert any(c.tied for c in cases) and any(c.ignored for c in cases) and any(c.offload for c in cases)
    assert any(c.mixed_precision and c.mixed_precision[3] for c in cases)  # keep_low_precision_grads
    assert {op[1] for c in cases for op in c.program if op[0] == "save_load"} == {"FULL", "SHARDED", "LOCAL"}
    wide = [draw(seed, world_size=4) for seed in range(100)]
    assert {c.world_size for c in wide} == {4} and {c.mesh_shape for c in wide} == {(1, 4), (2, 2)}


# Seeds whose cases once differed (test_fuzz_runtime_findings.py has each reduced): buffers saved before the first
# forward (109), NO_SHARD's low-precision gradients (5), gradients and optimizer state of parameters without elements
# (18, 114, 117, 48, 57; under no_sync: 377), a unit without parameters casting its inputs (327). Their draws may
# change with the generator; the focused tests there stay.
FOUND_SEEDS = (5, 18, 48, 57, 109, 114, 117, 327, 377)


def test_the_seeds_that_found_differences_match_torch() -> None:
    different, report = _campaign(FOUND_SEEDS)
    assert not different, report


@pytest.mark.heavy  # 30 seeds, 1-2 minutes on 2 CPU cores (each of torch's hangs costs 30 s); longer campaigns:
def test_a_campaign_matches_torch() -> None:  # `python tools/fuzz_runtime.py --seeds 300` (15-20 minutes)
    seeds = range(100, 130)
    different, report = _campaign(seeds)
    assert not different, report


@pytest.mark.heavy  # 12 seeds on 4 ranks: HYBRID on (1, 4) and (2, 2) meshes, uneven shards of four; 1-3 minutes
def test_a_campaign_on_four_ranks_matches_torch() -> None:  # longer: `tools/fuzz_runtime.py --world-size 4 --seeds 60`
    different, report = _campaign(range(200, 212), world_size=4)
    assert not different, report
