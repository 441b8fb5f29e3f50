"""The chunk exchange of SHARDED saves (fsdp_legacy/state/chunk_exchange.py), played for every rank in one process:
what each rank receives must be exactly `param.chunk(world_size)[rank]` of every parameter, torch FSDP1's SHARDED
layout, for layouts with alignment padding, parameters with fewer rows than ranks, and shards that split a chunk."""

import pytest
import torch
from torch import nn

from fsdp_legacy.flat_param import ParamRef, build_layout, flatten
from fsdp_legacy.state.chunk_exchange import ChunkPlan, can_exchange

SHAPES = [(5, 3), (2, 7), (13,), (1, 4), (9, 2, 2), (16, 1)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("aligned_numel", [0, 4], ids=["packed", "aligned"])
def test_every_rank_receives_its_dim0_chunks(world_size: int, aligned_numel: int) -> None:
    torch.manual_seed(0)
    module = nn.Module()
    for i, shape in enumerate(SHAPES):
        module.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape)))
    layout = build_layout([ParamRef("", module, n, p) for n, p in module.named_parameters()], world_size, aligned_numel)
    assert can_exchange(layout)
    params = {info: getattr(module, info.param_name).detach() for info in layout.params}
    shards = flatten(layout, params, "cpu", torch.float32).chunk(world_size)
    plans = [ChunkPlan.of(layout, rank) for rank in range(world_size)]
    # The all-to-all: rank s sends rank r the next send_sizes[r] elements of what it lays out to send.
    outgoing = [torch.cat([shards[s][a:b] for a, b in plan.send] + [torch.empty(0)]) for s, plan in enumerate(plans)]
    for rank, plan in enumerate(plans):
        pieces = []
        for source, sent in enumerate(plans):
            assert sent.send_sizes[rank] == plan.receive_sizes[source]
            start = sum(sent.send_sizes[:rank])
            pieces.append(outgoing[source][start : start + sent.send_sizes[rank]])
        incoming, offset = torch.cat(pieces), 0
        expected = {info: p.chunk(world_size)[rank] for info, p in params.items() if rank < len(p.chunk(world_size))}
        assert {r.info for r in plan.chunks} == expected.keys()
        for r in plan.chunks:
            assert torch.equal(incoming[offset : offset + r.end - r.start].view(r.shape), expected[r.info])
            offset += r.end - r.start
        assert offset == incoming.numel()


def test_a_parameter_held_in_memory_order_is_gathered_instead() -> None:
    module = nn.Module()
    module.weight = nn.Parameter(torch.randn(4, 6).t())  # a transpose: held in memory order, chunks not contiguous
    layout = build_layout([ParamRef("", module, "weight", module.weight)], 2, 0)
    assert not can_exchange(layout)
