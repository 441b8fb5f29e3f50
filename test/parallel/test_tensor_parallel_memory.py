"""The memory tracker and estimator with tensor parallelism (torch's 2-D recipe): DTensor parameters in the flat
parameters of FSDP over mesh["dp"]. The estimate (fake tensors, a fake 2 x 2 world, in the pytest process) is within
10% of the peak the tracker measures on 4 real gloo ranks at dp x tp = 2 x 2, per phase and rank."""

import sys

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import repo_paths

sys.path.insert(0, str(repo_paths.TOOLS))
from fsdp_legacy import MixedPrecision
from fsdp_legacy.memory import Category, Phase, estimate_memory, profile_training
from fsdp_legacy.wrap import ModuleWrapPolicy
from gpt import GPT, Block, GPTConfig
from harness import run_on_ranks

SMALL = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=128)
TOLERANCE = 0.10
CONFIGS = {
    "full_shard": {},
    "uop_bf16": dict(
        use_orig_params=True, mixed_precision=MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16)
    ),
}


def local_shard_bytes(dp: int, tp: int) -> int:
    """The analytic size of one rank's shards (fp32, no alignment padding): each block holds its attention and norms
    whole, its MLP's tp piece (fc's rows and bias split, proj's columns split, proj's bias whole); the root holds the
    embeddings (the LM head tied to one) and the final norm; each unit's numel is padded to a multiple of dp."""
    d, padded = SMALL.d_model, lambda n: -(-n // dp) * dp
    block = (4 * d * d + 4 * d) + 4 * d + (4 * d * d + 4 * d) // tp + 4 * d * d // tp + d
    root = SMALL.vocab_size * d + SMALL.block_size * d + 2 * d
    return (SMALL.n_layer * padded(block) + padded(root)) // dp * 4


def tp_gpt(mesh: DeviceMesh) -> nn.Module:
    """The GPT with each block's MLP tensor-parallel (fc column-wise, proj row-wise) over mesh["tp"]."""
    model = GPT(SMALL)
    for block in model.blocks:
        parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    return model


def gpt_loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size), generator=torch.Generator().manual_seed(step))
    return model(x, x)[1]


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _measure(name: str):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    kwargs = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), device_mesh=mesh["dp"], **CONFIGS[name])
    return profile_training(tp_gpt(mesh), gpt_loss, kwargs, adam)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_estimate_within_10_percent_of_measured_at_2x2(name: str) -> None:
    measured = run_on_ranks(_measure, 4, name)
    kwargs = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), **CONFIGS[name])
    predicted = estimate_memory(tp_gpt, gpt_loss, 4, kwargs, adam, mesh_shape=(2, 2))
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, None):
        for rank, profile in enumerate(measured):
            real, guess = profile.peak(phase), predicted.peak(phase)
            assert abs(guess - real) <= TOLERANCE * real, f"{phase} rank {rank}: predicted {guess}, measured {real}"
    # The DTensor parameters are counted once, as the flat parameters' tp pieces: nothing left as an activation
    for profile in (*measured, predicted):
        split = profile.split(Phase.OPTIMIZER)
        assert split.get(Category.ACTIVATION, 0) == split.get(Category.UNSHARDED_PARAM, 0) == 0, split
        if name == "full_shard":
            assert split[Category.SHARDED_PARAM] == local_shard_bytes(2, 2), split
            assert split[Category.SHARDED_GRAD] == local_shard_bytes(2, 2), split


def test_mesh_shape_must_cover_the_world() -> None:
    with pytest.raises(ValueError, match=r"mesh_shape=\(2, 3\) must be \(dp, tp\) with dp \* tp = world_size = 4"):
        estimate_memory(tp_gpt, gpt_loss, 4, mesh_shape=(2, 3))
    with pytest.raises(TypeError, match="build takes the 2-D device mesh"):
        estimate_memory(lambda: GPT(SMALL), gpt_loss, 4, mesh_shape=(2, 2))
