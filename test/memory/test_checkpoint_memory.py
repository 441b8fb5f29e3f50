"""Memory of taking a checkpoint (`model.state_dict()`, `FSDP.optim_state_dict`), the moment frameworks add to every
save: beside what the returned dict holds, a rank holds at most one unit's parameters or one of its optimizer states
whole (a gather buffer) and its local shard, since each parameter's value is cut out of it before the next gather.
Measured on the transformer of test_memory.py after a step of AdamW (two states per parameter) and zero_grad(), ours
beside torch's FSDP1 on the same ranks."""

import sys

import pytest
import torch
from torch import nn

import repo_paths

sys.path.insert(0, str(repo_paths.TOOLS))
from test_memory import CFG, WORLD, Sizes, loss_of, mib

from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy.memory import MemoryTracker
from fsdp_legacy.wrap import ModuleWrapPolicy
from gpt import GPT, Block
from harness import run_on_ranks
from scale_rig import fsdp1_save_configs, local_tensors, state_dict_nbytes

SCALARS = 4096  # 0-d states (AdamW's steps) and the state names exchanged between ranks


Saved = tuple[int, int, dict[str, torch.Tensor]]


def _save(impl: str, what: str, full: bool, use_orig_params: bool, settled: bool = False) -> Saved:
    """(the peak beyond what was live before, the bytes of the returned dict, its local values) of one `what`
    ("model": state_dict(), "optim": optim_state_dict()) on this rank, after a step of AdamW and zero_grad()."""
    if impl == "ours":
        wrapper: type[nn.Module] = FSDP
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as wrapper  # the oracle
    torch.manual_seed(0)
    with MemoryTracker() as tracker:
        model = wrapper(
            GPT(CFG),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=use_orig_params,
            device_id=torch.device("cpu"),
        )
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        loss_of(model, 0).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if settled:  # the next forward frees what zero_grad() dropped (use_orig_params: the sharded gradients)
            with torch.no_grad():
                loss_of(model, 1)
        # offload_to_cpu=False: with it torch's FSDP1 fails on the CPU (FSDP1_FACTS)
        with wrapper.state_dict_type(model, *fsdp1_save_configs(full, False)):  # type: ignore[attr-defined]
            before = tracker.current().total
            tracker.reset_peak()
            if what == "model":
                saved = model.state_dict()
            else:
                saved = wrapper.optim_state_dict(model, optim)  # type: ignore[attr-defined]
            peak = tracker.peak() - before
    return peak, state_dict_nbytes(saved), local_tensors(saved)


def _both(what: str, full: bool, use_orig_params: bool, settled: bool = False) -> dict[str, Saved]:
    return {impl: _save(impl, what, full, use_orig_params, settled) for impl in ("ours", "torch")}


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig_params"])
@pytest.mark.parametrize("full", [True, False], ids=["full_rank0_only", "sharded"])
@pytest.mark.parametrize("what", ["model", "optim"])
def test_saving_gathers_one_state_of_one_unit_at_a_time(what: str, full: bool, use_orig_params: bool) -> None:
    """The formula: the dict, plus one block whole and its shard. Gathering every optimizer state of a unit at once (as
    ours did) breaks it by a block's state (3 MiB of 17). Beside torch's FSDP1: ours holds no more, and with
    use_orig_params frees the sharded gradients that zero_grad() left to the next forward before gathering, as torch
    does (ours kept them, up to 4.9 MiB more than torch here). The one exception is rank 0 of a FULL optimizer state
    dict without offload_to_cpu, where torch returns views of its gather buffers and so needs no transient; ours
    copies each state out (a tensor of the dict never keeps a whole unit's buffer alive, and saves alone), within the
    formula."""
    s = Sizes.of(WORLD, 4)
    for rank, observed in enumerate(run_on_ranks(_both, WORLD, what, full, use_orig_params)):
        (ours, ours_held, values), (torch_peak, torch_held, torch_values) = observed["ours"], observed["torch"]
        assert values.keys() == torch_values.keys()
        for key, value in values.items():
            assert torch.equal(value, torch_values[key]), f"rank {rank}: {key} differs from torch's"
        bound = ours_held + s.block + s.block_shard + SCALARS
        assert ours <= bound, f"rank {rank}: {mib(ours)} > {mib(bound)} (dict {mib(ours_held)})"
        assert abs(ours_held - torch_held) <= 4096, f"rank {rank}: dict {mib(ours_held)} vs torch {mib(torch_held)}"
        if what == "model" or not full or rank != 0:
            assert ours <= torch_peak, f"rank {rank}: {mib(ours)} > torch FSDP1's {mib(torch_peak)}"


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig_params"])
@pytest.mark.parametrize("what", ["model", "optim"])
def test_sharded_save_holds_two_shards_beside_the_dict(what: str, use_orig_params: bool) -> None:
    """SHARDED values are dim-0 chunks, which the ranks exchange (each element of a shard goes to the one rank whose
    chunk holds it) rather than gather: beside the dict a rank holds two shards of one unit, where a gather holds the
    unit whole (4 shards at 4 ranks). The values equal torch's FSDP1's, whose shards split chunks differently here.
    Measured after a forward, so that no gradient freed by the save makes room for it."""
    s = Sizes.of(4, 4)
    for rank, observed in enumerate(run_on_ranks(_both, 4, what, False, use_orig_params, True)):
        (peak, held, values), (_, _, torch_values) = observed["ours"], observed["torch"]
        assert values.keys() == torch_values.keys()
        for key, value in values.items():
            assert torch.equal(value, torch_values[key]), f"rank {rank}: {key} differs from torch's"
        bound = held + 2 * s.block_shard + SCALARS
        assert peak <= bound, f"rank {rank}: {mib(peak)} > {mib(bound)} (dict {mib(held)})"
