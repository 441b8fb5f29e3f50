"""The estimator against measurement: the peak per phase predicted on fake tensors and a fake process group, in the
pytest process, is within 10% of the peak the tracker measures on 2 real gloo ranks for the same configuration."""

import resource
import sys
import time

import pytest
import torch
import torch.distributed as dist

import repo_paths

sys.path.insert(0, str(repo_paths.TOOLS))
from fsdp_legacy import CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_legacy.memory import Phase, estimate_memory, profile_training
from fsdp_legacy.wrap import ModuleWrapPolicy
from gpt import GPT, Block, GPTConfig
from harness import run_on_ranks

SMALL = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=128)
TOLERANCE = 0.10
CONFIGS = {
    "full_shard": {},
    "shard_grad_op": dict(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP),
    "bf16": dict(mixed_precision=MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16)),
    "offload": dict(cpu_offload=CPUOffload(offload_params=True)),
    "use_orig_params": dict(use_orig_params=True),
}


def fsdp_kwargs(name: str) -> dict:
    return dict(auto_wrap_policy=ModuleWrapPolicy({Block}), **CONFIGS[name])


def gpt_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size))
    return model(x, x)[1]


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _measure(name: str):
    torch.manual_seed(dist.get_rank())
    return profile_training(GPT(SMALL), gpt_loss, fsdp_kwargs(name), adam)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_estimate_within_10_percent_of_measured(name: str) -> None:
    measured = run_on_ranks(_measure, 2, name)
    predicted = estimate_memory(lambda: GPT(SMALL), gpt_loss, 2, fsdp_kwargs(name), adam)
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, None):
        for rank, profile in enumerate(measured):
            real, guess = profile.peak(phase), predicted.peak(phase)
            assert abs(guess - real) <= TOLERANCE * real, f"{phase} rank {rank}: predicted {guess}, measured {real}"


def _measure_hybrid(strategy: str):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(dist.get_rank())
    options = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy])
    return profile_training(GPT(SMALL), gpt_loss, dict(options, device_mesh=mesh), adam)


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_hybrid_estimate_within_10_percent_of_measured(strategy: str) -> None:
    """4 ranks as 2 replicas of shard groups of 2 (a 2-D mesh), measured on real gloo ranks and estimated."""
    measured = run_on_ranks(_measure_hybrid, 4, strategy)
    options = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy])
    predicted = estimate_memory(lambda: GPT(SMALL), gpt_loss, 4, options, adam, hybrid_shape=(2, 2))
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, None):
        for rank, profile in enumerate(measured):
            real, guess = profile.peak(phase), predicted.peak(phase)
            assert abs(guess - real) <= TOLERANCE * real, f"{phase} rank {rank}: predicted {guess}, measured {real}"


def test_estimate_allocates_nothing() -> None:
    """A GPT of 1.2 B parameters on 8 ranks: the prediction exceeds a GiB per rank, the process grows far less."""
    big = GPTConfig(vocab_size=32000, block_size=512, n_layer=24, n_head=16, d_model=2048)

    def loss(model: torch.nn.Module, step: int) -> torch.Tensor:
        x = torch.randint(0, big.vocab_size, (1, big.block_size))
        return model(x, x)[1]

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    profile = estimate_memory(lambda: GPT(big), loss, 8, dict(auto_wrap_policy=ModuleWrapPolicy({Block})), steps=1)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    params = sum(12 * big.d_model**2 for _ in range(big.n_layer)) * 4  # fp32 bytes of the blocks alone
    assert profile.peak() > params / 8 > 2**29, "the estimate counts at least each rank's shard"
    assert grown < 2**28, f"estimating grew the process by {grown / 2**20:.0f} MiB"
    assert not dist.is_initialized(), "the fake process group is gone afterwards"
    print(f"estimated in {time.perf_counter() - start:.1f} s")


def test_refuses_inside_a_process_group() -> None:
    run_on_ranks(_estimate_inside_group, 2)


def _estimate_inside_group() -> None:
    with pytest.raises(RuntimeError, match="without a process group"):
        estimate_memory(lambda: GPT(SMALL), gpt_loss, 2)
