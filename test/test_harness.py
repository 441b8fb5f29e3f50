"""Tests of the multi-process harness itself (kept cheap: a handful of tiny jobs)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import RankError, run_on_ranks


def _all_reduce_rank() -> torch.Tensor:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t


def _describe(scale: float, *, offset: float) -> dict[str, Any]:
    rank = dist.get_rank()
    return {
        "rank": rank,
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]),
        "threads": torch.get_num_threads(),
        # a non-leaf tensor that requires grad: the harness must detach it to pickle it
        "value": torch.full((2,), rank * scale + offset, requires_grad=True) * 1,
        "rand": torch.rand(3),
    }


def _pid() -> int:
    return os.getpid()


def _raise_on_rank1() -> str:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    return "fine"


def _barrier_on_rank0() -> int:
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins: hangs
    return dist.get_rank()


def _raise_on_rank1_while_rank0_waits() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gives up")
    dist.barrier()


def _groups_and_a_mesh_op() -> dict[str, Any]:
    """Makes a subgroup and a 2-D mesh, and runs a DTensor op on it: what a parallelism test leaves behind."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    live_at_start = len(dist.distributed_c10d._world.pg_map)
    dist.new_group([0, 1], backend="gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    total = (distribute_tensor(torch.ones(4, 4), mesh["tp"], [Shard(0)]) * 2).sum()
    return {
        "live_at_start": live_at_start,
        "result_on_this_jobs_mesh": total.device_mesh.get_group().group_name == mesh["tp"].get_group().group_name,
        "total": total.full_tensor(),
    }


def _destroy_group() -> str:
    dist.destroy_process_group()
    return "destroyed"


@pytest.mark.parametrize("ws", [2, 4])
def test_all_reduce_sum(ws: int) -> None:
    results = run_on_ranks(_all_reduce_rank, ws)
    assert [t.item() for t in results] == [ws * (ws - 1) / 2] * ws


def test_results_per_rank_and_clean_state(ranks: Any) -> None:
    res = ranks(_describe, 2, 10.0, offset=1.0)
    for r, d in enumerate(res):
        assert d["rank"] == r and d["env"] == (str(r), "2", str(r)) and d["threads"] == 1
        assert torch.equal(d["value"], torch.full((2,), r * 10.0 + 1.0))
        assert not d["value"].requires_grad
    assert torch.equal(res[0]["rand"], res[1]["rand"])  # same seed on every rank
    again = ranks(_describe, 2, 10.0, offset=1.0)
    assert torch.equal(again[0]["rand"], res[0]["rand"])  # seed reset for each job


def test_exception_on_one_rank_is_reported_and_pool_respawned() -> None:
    before = run_on_ranks(_pid, 2)
    with pytest.raises(RankError) as info:
        run_on_ranks(_raise_on_rank1, 2)
    assert info.value.errors.keys() == {1} and info.value.silent == []
    msg = str(info.value)
    assert "===== rank 1 raised =====" in msg and "rank 0 raised" not in msg
    assert "in _raise_on_rank1" in msg and "ValueError: boom from rank 1" in msg
    after = run_on_ranks(_pid, 2)
    assert set(after).isdisjoint(before)  # fresh processes
    assert [t.item() for t in run_on_ranks(_all_reduce_rank, 2)] == [1.0, 1.0]


@pytest.mark.heavy  # (waits out a timeout)
def test_hang_times_out_and_pool_respawned() -> None:
    with pytest.raises(RankError, match=r"timed out after 5 s: ranks \[0\]") as info:
        run_on_ranks(_barrier_on_rank0, 2, timeout=5)
    assert info.value.silent == [0] and not info.value.errors
    assert "in _barrier_on_rank0" in str(info.value)  # rank 0's stack dump
    assert [t.item() for t in run_on_ranks(_all_reduce_rank, 2)] == [1.0, 1.0]


@pytest.mark.heavy  # (waits out a timeout)
def test_failure_while_other_rank_blocks_reports_both() -> None:
    with pytest.raises(RankError) as info:
        run_on_ranks(_raise_on_rank1_while_rank0_waits, 2, timeout=60)
    assert info.value.errors.keys() == {1} and info.value.silent == [0]
    assert "RuntimeError: rank 1 gives up" in str(info.value)
    assert run_on_ranks(_pid, 2)  # the pool works again


def test_a_jobs_subgroups_end_with_it() -> None:
    """The groups a job makes are destroyed after it: left alive, each gloo group's thread kept waking, and a pool
    gathered hundreds. DTensor's caches, which match a later job's equal mesh to the destroyed one's, go with them."""
    first, second = run_on_ranks(_groups_and_a_mesh_op, 4), run_on_ranks(_groups_and_a_mesh_op, 4)
    for job in (first, second):
        for rank in job:
            assert rank["live_at_start"] == first[0]["live_at_start"]  # nothing left from the job before
            assert rank["result_on_this_jobs_mesh"] and rank["total"].item() == 32.0


def test_destroyed_group_gets_respawned() -> None:
    assert run_on_ranks(_destroy_group, 1) == ["destroyed"]
    assert [t.item() for t in run_on_ranks(_all_reduce_rank, 1)] == [0.0]


def test_rejects_functions_workers_cannot_import() -> None:
    with pytest.raises(TypeError, match="module-level"):
        run_on_ranks(lambda: 0, 1)
