"""Ranks that wrap different models (same_model.py): every rank raises one ValueError that names the first difference,
at the root's first forward or, with sync_module_states, at construction; torch's FSDP1 aborts, hangs or trains on
mixed-up values there. Ranks that wrap the same model pass the check: the rest of the suite."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from parameterized import parameterized
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_legacy import BackwardPrefetch, MixedPrecision, ShardingStrategy
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy.buckets import ENV_VAR
from fsdp_legacy.wrap import ModuleWrapPolicy
from harness import run_on_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _model(difference: str, rank: int) -> tuple[nn.Module, dict]:
    """Three blocks, except that the last rank's model differs as `difference` says."""
    odd = rank == dist.get_world_size() - 1 and difference != "none"
    widths = [4, 8, 8, 4]
    if odd and difference == "width":
        widths = [4, 8, 10, 4]
    blocks = [Block(a, b) for a, b in zip(widths, widths[1:], strict=False)]
    if odd and difference == "order":  # the same sizes everywhere: only the order of two parameters differs
        fc = blocks[1].fc
        weight, bias = fc._parameters.pop("weight"), fc._parameters.pop("bias")
        fc.register_parameter("bias", bias)
        fc.register_parameter("weight", weight)
    if odd and difference == "depth":
        blocks.append(Block(4, 4))
    model = nn.Sequential(*blocks)
    if odd and difference == "frozen":
        model[1].fc.bias.requires_grad_(False)
    if odd and difference == "budget":  # grouping units for their collectives differently (buckets.py)
        os.environ[ENV_VAR] = "0"
    kwargs: dict = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=difference == "frozen")
    if odd and difference == "precision":
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
    if odd and difference == "prefetch":  # collectives in another order
        kwargs["backward_prefetch"] = BackwardPrefetch.BACKWARD_POST
    return model, kwargs


def _wrap_and_step(difference: str, sync_module_states: bool) -> str:
    """The ValueError raised, else "warned: " and the warning, else "no error"."""
    torch.manual_seed(0)
    budget = os.environ.get(ENV_VAR)
    model, kwargs = _model(difference, dist.get_rank())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fsdp = FSDP(model, sync_module_states=sync_module_states, **kwargs)
            fsdp(torch.randn(2, 4)).sum().backward()
    except ValueError as error:
        return str(error)
    finally:
        if budget is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = budget
    found = [str(w.message) for w in caught if "differ by rank" in str(w.message)]
    return "warned: " + found[0] if found else "no error"


@parameterized.expand(
    [
        ("width", "'1.fc.weight' of shape (8, 8)", "'1.fc.weight' of shape (10, 8)"),
        ("order", "'1.fc.weight' of shape (8, 8)", "'1.fc.bias' of shape (8,)"),
        ("depth", "no more units", "'3.fc.weight' of shape (4, 4)"),
        ("precision", "gathered torch.float32", "gathered torch.bfloat16"),
        ("budget", "of 1048576 bytes", "of 0 bytes"),
        ("prefetch", "backward_prefetch=BACKWARD_PRE", "backward_prefetch=BACKWARD_POST"),
    ]
)
def test_every_rank_names_the_first_difference(difference: str, rank0_has: str, other_has: str) -> None:
    for world_size in (2, 3):
        errors = run_on_ranks(_wrap_and_step, world_size, difference, False)
        assert len(set(errors)) == 1, errors  # the same error on every rank
        assert "different model on different ranks" in errors[0], errors[0]
        first, second = errors[0].split(" where ")
        assert "group rank 0 has" in first and rank0_has in first, errors[0]
        assert f"group rank {world_size - 1} has" in second and other_has in second, errors[0]


def test_sync_module_states_compares_before_broadcasting() -> None:
    errors = run_on_ranks(_wrap_and_step, 2, "width", True)
    assert len(set(errors)) == 1, errors
    # The innermost unit that differs is the second block: rank 1's is Linear(8, 10).
    assert "parameter 'fc.weight' of shape (8, 8), torch.float32, in the unit wrapping a Block" in errors[0]
    assert "of shape (10, 8)" in errors[0], errors[0]


def test_the_same_model_passes() -> None:
    assert run_on_ranks(_wrap_and_step, 2, "none", True) == ["no error"] * 2


def _torch_mixes_up_values() -> bool:
    """torch's FSDP1 on the "order" models: no error, and the parameters it gathers are not the model's."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    torch.manual_seed(0)
    model, _ = _model("order", dist.get_rank())
    weight = model[1].fc.weight.detach().clone()
    fsdp = TorchFSDP(model, auto_wrap_policy=TorchPolicy({Block}), device_id=torch.device("cpu"))
    with TorchFSDP.summon_full_params(fsdp):
        return torch.equal(model[1].fc.weight, weight)


def test_torch_fsdp1_mixes_up_values_there() -> None:
    """What the check prevents: torch's FSDP1 wraps those models without a word, and gathers another rank's bias
    into one's weight."""
    assert run_on_ranks(_torch_mixes_up_values, 2) == [False, False]
    assert "rank 0 has parameter '1.fc.weight'" in run_on_ranks(_wrap_and_step, 2, "order", False)[0]


def _hybrid(odd_rank: int) -> str:
    shard, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    replicate, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    torch.manual_seed(0)
    # (_model changes the last rank's model only: build that one on `odd_rank`)
    model, kwargs = _model("width" if dist.get_rank() == odd_rank else "none", dist.get_world_size() - 1)
    kwargs.update(sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=(shard, replicate))
    try:
        fsdp = FSDP(model, **kwargs)
        fsdp(torch.randn(2, 4)).sum().backward()
    except ValueError as error:
        return str(error)
    return "no error"


def test_hybrid_ranks_all_raise() -> None:
    """Rank 2 differs: ranks 0 and 3 see it in one of their groups; rank 1 sees it in neither, and raises too."""
    errors = run_on_ranks(_hybrid, 4, 2)
    assert all("different model on different ranks" in error for error in errors), errors
    assert "this rank's groups agree, other ranks differ" in errors[1], errors[1]
    for rank in (0, 2, 3):
        assert "of shape (10, 8)" in errors[rank], errors[rank]


def _mesh_2d() -> str:
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    model, kwargs = _model("none", 0)
    FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh, **kwargs)(torch.randn(2, 4))
    return "no error"


def test_hybrid_same_model_passes() -> None:
    assert run_on_ranks(_mesh_2d, 4) == ["no error"] * 4


def test_requires_grad_alone_is_a_warning() -> None:
    """Their collectives pair up: every rank warns, naming the first difference, and none raises."""
    for world_size in (2, 3):
        results = run_on_ranks(_wrap_and_step, world_size, "frozen", False)
        assert len(set(results)) == 1, results
        assert results[0].startswith("warned: "), results[0]
        first, second = results[0].split(" where ")
        assert "'1.fc.bias' of shape (8,), requires_grad=True" in first, results[0]
        assert f"group rank {world_size - 1} has" in second and "requires_grad=False" in second, results[0]


# torch's own cases (test_fsdp_ignored_modules.py, test_fsdp_exec_order.py), which torch's FSDP1 runs: ours must too.


class _IgnoredLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def _rank_ignores_more(ours: bool, ignore_modules: bool, ignore_at_root: bool) -> list[float]:
    """Rank r ignores r + 1 modules inside `layer1`, so the same managed parameters sit under shifted names there."""
    wrapper = FSDP if ours else _torch_fsdp()
    torch.manual_seed(0)
    layer1 = nn.Sequential(
        nn.Linear(5, 4), nn.Linear(4, 4), *[_IgnoredLinear() for _ in range(dist.get_rank() + 1)], nn.Linear(4, 4)
    )
    model = nn.Sequential(nn.Linear(3, 5), layer1, nn.Linear(4, 2), nn.Linear(2, 2))

    def ignoring(modules: list[nn.Module]) -> dict:
        if ignore_modules:
            return {"ignored_modules": modules}
        return {"ignored_states": [p for m in modules for p in m.parameters()]}

    ignored = [m for m in model.modules() if isinstance(m, _IgnoredLinear)]
    model[1] = wrapper(model[1], **ignoring(ignored))
    model[3] = wrapper(model[3])
    fsdp = wrapper(model, **ignoring(ignored if ignore_at_root else []))
    optim = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        torch.manual_seed(10 + step)
        loss = fsdp(torch.randn(8, 3)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _torch_fsdp():
    from functools import partial

    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    return partial(TorchFSDP, device_id=torch.device("cpu"))


@parameterized.expand([(True, False), (True, True), (False, False), (False, True)])
def test_ranks_that_ignore_different_modules_train_as_torch(ignore_modules: bool, ignore_at_root: bool) -> None:
    theirs = run_on_ranks(_rank_ignores_more, 2, False, ignore_modules, ignore_at_root)
    ours = run_on_ranks(_rank_ignores_more, 2, True, ignore_modules, ignore_at_root)
    assert ours == theirs


class _TwoPaths(nn.Module):
    """torch's exec-order model: `layer1` and `layer2` flatten to 36 elements each, and a rank that flips the path
    runs the other one (frozen and unfrozen as it goes)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer0 = nn.Linear(5, 6)
        self.layer1 = nn.Linear(6, 6, bias=False)
        self.layer2 = nn.Sequential(nn.Linear(6, 3, bias=False), nn.ReLU(), nn.Linear(3, 6, bias=False))
        self.alternate = False
        self.layer2.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.layer0(x))
        return torch.relu(self.layer2(x) if self.alternate else self.layer1(x))

    def flip(self) -> None:
        self.layer1.requires_grad_(self.alternate)
        self.layer2.requires_grad_(not self.alternate)
        self.alternate = not self.alternate


def _two_paths_wrapped(ours: bool, strategy: str) -> nn.Module:
    """torch's wrapping of it: each path a unit, under a root."""
    wrapper = FSDP if ours else _torch_fsdp()
    model = _TwoPaths()
    sharding = getattr(ShardingStrategy, strategy)
    model.layer1 = wrapper(model.layer1, sharding_strategy=sharding)
    model.layer2 = wrapper(model.layer2, sharding_strategy=sharding)
    return wrapper(model, sharding_strategy=sharding)


def _flipped_first_forward(ours: bool, strategy: str) -> str:
    """torch's test_invalid_first_iter_order: every rank but 0 runs the other path from the first forward on."""
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        fsdp = _two_paths_wrapped(ours, strategy)
        if dist.get_rank() != 0:
            fsdp.module.flip()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fsdp(torch.randn(8, 5))
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    finally:
        dist.set_debug_level(level)
    return "no error"


@parameterized.expand([("FULL_SHARD",), ("SHARD_GRAD_OP",)])
def test_torch_order_check_reports_ranks_that_run_different_units(strategy: str) -> None:
    """torch's DETAIL-level order check, not the same-model check, reports it: the same error as torch's."""
    theirs = run_on_ranks(_flipped_first_forward, 2, False, strategy)
    ours = run_on_ranks(_flipped_first_forward, 2, True, strategy)
    assert theirs[0].startswith("RuntimeError: Forward order differs across ranks"), theirs
    assert ours == theirs


def _flipped_later(ours: bool, strategy: str, iterations_before: int) -> list[str]:
    """torch's test_invalid_later_iter_order: all ranks agree first, then every rank but 0 flips the path; the order
    warnings each rank gets over two more iterations."""
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        fsdp = _two_paths_wrapped(ours, strategy)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for iteration in range(iterations_before + 2):
                if iteration == iterations_before and dist.get_rank() != 0:
                    fsdp.module.flip()
                fsdp(torch.randn(8, 5)).sum().backward()
    finally:
        dist.set_debug_level(level)
    return [str(w.message).splitlines()[0] for w in caught if "order differs" in str(w.message)]


@parameterized.expand([("FULL_SHARD", 1), ("SHARD_GRAD_OP", 3)])
def test_a_later_change_of_order_warns_as_torch(strategy: str, iterations_before: int) -> None:
    theirs = run_on_ranks(_flipped_later, 2, False, strategy, iterations_before)
    ours = run_on_ranks(_flipped_later, 2, True, strategy, iterations_before)
    assert theirs[0] == [] and len(theirs[1]) == 1, theirs
    assert ours == theirs
