"""Two ranks on gloo gather and reduce-scatter by an exchange of halves (collectives.py): the results must be c10d's
own all-gather and reduce-scatter (what torch's FSDP1 calls) bit for bit, on values chosen to expose any difference
in the sums (signed zeros, infinities, subnormals, magnitudes far apart), for whole buffers and a bucket's pieces, on
the world and on a pair of ranks inside a larger world (a hybrid shard group)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

import fsdp_legacy.collectives as comm
from harness import run_on_ranks

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the name before 2.13)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _hostile(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values spread over many magnitudes, with signed zeros, infinities and subnormals among them."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.randint(-30, 30, (numel,), generator=g)
    values = torch.randn(numel, generator=g, dtype=torch.float64) * magnitudes
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-45, 3.0, -3.0], dtype=torch.float64)
    picks = torch.randint(0, numel, (numel // 4,), generator=g)
    values[picks] = special[torch.randint(0, len(special), (len(picks),), generator=g)]
    if dtype == torch.bool:
        return values > 0
    return values.to(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype != torch.bool else tensor


@contextmanager
def _counting(record: Counter) -> Iterator[None]:
    names = ["all_to_all_single", "all_reduce", "all_gather_into_tensor"]
    names += [name for name in ("all_gather_single",) if hasattr(dist, name)]
    originals = {name: getattr(dist, name) for name in names}

    def counted(name: str):
        def call(*args, **kwargs):
            record[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counted(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _against_c10d(dtype_name: str, pairs: bool) -> dict[str, object]:
    """comm's gather, reduce-scatter and bucket reduce-scatter against c10d's, on the world or on a pair of ranks."""
    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    group = dist.group.WORLD
    if pairs:  # ranks {0, 1} and {2, 3}: every rank makes both groups, in the same order
        made = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group = made[rank // 2]
    size = group.size()
    seen: dict[str, object] = {}
    calls: Counter = Counter()
    for numel in (1, 7, 4096, 100_003):
        shard = _hostile(numel, dtype, seed=rank * 1000 + numel)
        expected = torch.empty(size * numel, dtype=dtype)
        if dtype == torch.bool:
            _all_gather(expected.view(torch.uint8), shard.view(torch.uint8), group=group)
        else:
            _all_gather(expected, shard, group=group)
        got = torch.empty_like(expected)
        with _counting(calls):
            comm.all_gather(got, shard, group).wait()
        assert torch.equal(_bits(got), _bits(expected)), f"gather of {numel} {dtype_name}"
        if dtype == torch.bool:
            continue
        full = _hostile(size * numel, dtype, seed=7 + rank * 1000 + numel)
        expected = torch.empty(numel, dtype=dtype)
        _reduce_scatter(expected, full.clone(), group=group)
        got = torch.empty(numel, dtype=dtype)
        with _counting(calls):
            comm.reduce_scatter(got, full.clone(), group).wait()
        assert torch.equal(_bits(got), _bits(expected)), f"reduce-scatter of {numel} {dtype_name}"
        if numel > 3:  # a bucket: the chunk lands in several outputs, in order
            pieces = [torch.empty(n, dtype=dtype) for n in (1, numel // 2, numel - 1 - numel // 2)]
            with _counting(calls):
                comm.reduce_scatter_pieces(pieces, full.clone(), group).wait()
            assert torch.equal(_bits(torch.cat(pieces)), _bits(expected)), f"pieces of {numel} {dtype_name}"
    seen["calls"] = dict(calls)
    return seen


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16", "bool"])
def test_exchange_of_halves_is_c10d_bit_for_bit(dtype: str) -> None:
    calls = run_on_ranks(_against_c10d, 2, dtype, False)[0]["calls"]
    # Between two ranks gloo's own collectives never run: the gathers, and the float32 / float64 reductions, go
    # through the exchange; the half-precision sums stay gloo's all-reduce.
    assert "all_gather_into_tensor" not in calls and "all_gather_single" not in calls, calls
    reductions = 0 if dtype == "bool" else 4 + 3  # four sizes, three of them with pieces as well
    exchanged = 4 + (reductions if dtype in ("float32", "float64") else 0)
    assert calls.get("all_to_all_single", 0) == exchanged, calls
    assert calls.get("all_reduce", 0) == reductions - (exchanged - 4), calls


def test_exchange_within_pairs_of_a_larger_world() -> None:
    for seen in run_on_ranks(_against_c10d, 4, "float32", True):
        assert seen["calls"].get("all_to_all_single", 0) == 4 + 7, seen


def test_more_than_two_ranks_keep_gloos_collectives() -> None:
    calls = run_on_ranks(_against_c10d, 4, "float32", False)[0]["calls"]
    assert "all_to_all_single" not in calls and calls.get("all_reduce", 0) == 7, calls
