"""The public surface against torch's FSDP1: names, enum values, config defaults, constructor signature,
attributes, static helpers, warnings, and the clear refusals of options whose feature is not built yet."""

import dataclasses
import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import fsdp_legacy
import models
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy.wrap import ModuleWrapPolicy
from harness import run_on_ranks

ENUMS = ["ShardingStrategy", "BackwardPrefetch", "StateDictType", "OptimStateKeyType"]
CONFIGS = [
    "MixedPrecision",
    "CPUOffload",
    "StateDictConfig",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "ShardedStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
]


def test_exports_cover_torch_fsdp1_names() -> None:
    fsdp1_names = {
        "BackwardPrefetch",
        "CPUOffload",
        "FullOptimStateDictConfig",
        "FullStateDictConfig",
        "FullyShardedDataParallel",
        "LocalOptimStateDictConfig",
        "LocalStateDictConfig",
        "MixedPrecision",
        "OptimStateDictConfig",
        "OptimStateKeyType",
        "ShardedOptimStateDictConfig",
        "ShardedStateDictConfig",
        "ShardingStrategy",
        "StateDictConfig",
        "StateDictSettings",
        "StateDictType",
    }
    assert fsdp1_names <= set(torch_fsdp.__all__)
    assert fsdp1_names <= set(fsdp_legacy.__all__)


@pytest.mark.parametrize("name", ENUMS)
def test_enum_members_and_values_match_torch(name: str) -> None:
    ours, theirs = getattr(fsdp_legacy, name), getattr(torch_fsdp, name)
    assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_fields_and_defaults_match_torch(name: str) -> None:
    ours, theirs = getattr(fsdp_legacy, name), getattr(torch_fsdp, name)
    fields = lambda cls: [(f.name, f.default) for f in dataclasses.fields(cls)]  # noqa: E731
    assert fields(ours) == fields(theirs)


def test_constructor_signature_matches_torch() -> None:
    ours = inspect.signature(FSDP.__init__).parameters
    theirs = inspect.signature(torch_fsdp.FullyShardedDataParallel.__init__).parameters
    assert list(ours) == list(theirs)
    for name in theirs:
        assert str(ours[name].default) == str(theirs[name].default), name


def test_static_method_signatures_match_torch() -> None:
    for name in ("fsdp_modules",):
        ours = inspect.signature(getattr(FSDP, name))
        theirs = inspect.signature(getattr(torch_fsdp.FullyShardedDataParallel, name))
        assert list(ours.parameters) == list(theirs.parameters), name


def _surface() -> None:
    torch.manual_seed(0)
    net = models.Net()
    fsdp = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({models.Block}))
    # Wrapping replaced the child in place and nests _fsdp_wrapped_module like torch.
    assert isinstance(net.block, FSDP) and fsdp.module is net
    assert fsdp.l1 is net.l1, "__getattr__ forwards to the wrapped module"
    assert [type(u.module).__name__ for u in FSDP.fsdp_modules(fsdp)] == ["Net", "Block"]
    assert FSDP.fsdp_modules(fsdp, root_only=True) == [fsdp]
    assert FSDP.fsdp_modules(nn.Sequential(fsdp), root_only=True) == [fsdp]
    names = [name for name, _ in fsdp.named_parameters()]
    assert names == ["_fsdp_wrapped_module._flat_param", "_fsdp_wrapped_module.block._fsdp_wrapped_module._flat_param"]
    assert [p.shape for p in fsdp.params] == [torch.Size([14])]
    assert isinstance(fsdp.params[0], torch_fsdp.FlatParameter), "torch's isinstance check accepts our flat params"
    assert fsdp.sharding_strategy == fsdp_legacy.ShardingStrategy.FULL_SHARD
    assert fsdp.backward_prefetch == fsdp_legacy.BackwardPrefetch.BACKWARD_PRE
    assert (fsdp.rank, fsdp.world_size) == (dist.get_rank(), 2)
    assert fsdp.cpu_offload == fsdp_legacy.CPUOffload() and fsdp.mixed_precision == fsdp_legacy.MixedPrecision()
    assert fsdp.check_is_root() and not net.block.check_is_root()
    fsdp._assert_state(fsdp.training_state.__class__.IDLE)
    with pytest.raises(ValueError):
        fsdp._assert_state(fsdp.training_state.__class__.FORWARD_BACKWARD)
    seq = FSDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert isinstance(seq[1], nn.Linear), "__getitem__ forwards to the wrapped module"
    # Outside forward the original attributes keep their shapes (use_orig_params=False), so repr works.
    assert net.l1.weight.shape == (5, 3)
    assert repr(fsdp) == _torch_repr()


def _torch_repr() -> str:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torch_fsdp.FullyShardedDataParallel(
            models.Net(),
            auto_wrap_policy=torch_fsdp.wrap.ModuleWrapPolicy({models.Block}),
            device_id=torch.device("cpu"),
        )
    return repr(theirs)


def test_surface() -> None:
    run_on_ranks(_surface, 2)


def _torch_enums_accepted() -> None:
    fsdp = FSDP(
        models.Net(),
        sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
        backward_prefetch=torch_fsdp.BackwardPrefetch.BACKWARD_POST,
    )
    assert fsdp.sharding_strategy is fsdp_legacy.ShardingStrategy.SHARD_GRAD_OP
    assert fsdp.backward_prefetch is fsdp_legacy.BackwardPrefetch.BACKWARD_POST


def test_torch_enums_are_accepted() -> None:
    run_on_ranks(_torch_enums_accepted, 2)


def _device_mesh() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    fsdp = FSDP(models.Net(), device_mesh=mesh)
    assert fsdp.process_group.size() == 2 and fsdp._device_mesh is mesh
    fsdp(models.Net.batch(0)).sum().backward()
    assert fsdp.params[0].grad.shape == fsdp.params[0].shape


def test_1d_device_mesh() -> None:
    run_on_ranks(_device_mesh, 2)


def _warnings() -> None:
    with pytest.warns(FutureWarning, match="The `NO_SHARD` sharding strategy is deprecated"):
        FSDP(models.Net(), sharding_strategy=fsdp_legacy.ShardingStrategy.NO_SHARD)
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    with pytest.warns(UserWarning, match="switching to use `NO_SHARD` instead of ShardingStrategy.FULL_SHARD"):
        fsdp = FSDP(models.Net(), process_group=groups[dist.get_rank()])
    assert fsdp.sharding_strategy == fsdp_legacy.ShardingStrategy.NO_SHARD


def test_warnings() -> None:
    run_on_ranks(_warnings, 2)


def _errors() -> None:
    net = models.Net()
    with pytest.raises(ValueError, match="Cannot pass both ignored_modules and ignored_states"):
        FSDP(net, ignored_modules=[net.l1], ignored_states=[net.l1])
    with pytest.raises(ValueError, match="Cannot pass both process_group and device_mesh"):
        FSDP(net, process_group=dist.group.WORLD, device_mesh=object())
    scalar = nn.Module()
    scalar.w = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="FSDP doesn't support scalar parameters. Change w to a 1D tensor"):
        FSDP(scalar)
    mixed = models.Net()
    mixed.l1.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="uniform `requires_grad`"):
        FSDP(mixed)


def test_errors() -> None:
    run_on_ranks(_errors, 2)


def _tied_across_units() -> None:
    with pytest.raises(
        ValueError,
        match=r"Parameter 'weight' of Linear is tied to 'weight' of the FSDP unit wrapping "
        r"Embedding.*change the auto_wrap_policy",
    ):
        FSDP(models.Transformer(), auto_wrap_policy=ModuleWrapPolicy({nn.Embedding, nn.Linear}))


def test_tied_parameters_across_units_are_refused() -> None:
    run_on_ranks(_tied_across_units, 2)


def test_needs_an_initialized_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        FSDP(models.Net())
