"""The estimate of identical layers from traces of 3, 4 and 5 of them (fsdp_legacy/memory/repeated.py) against the
oracle, the full trace of the same model (estimate_memory): every phase's peak, and its breakdown by module (the
layers' modules summed) and category, equal to the byte, over configurations (QLoRA, CPU offload, activation
checkpointing, mixed precision, sharding strategies, world sizes), and the full trace itself where the layers are not
identical."""

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

from fsdp_legacy import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_legacy.cli.llama import MLP, DecoderLayer, Llama, LlamaConfig
from fsdp_legacy.cli.qlora import to_qlora
from fsdp_legacy.memory import Phase, estimate_memory
from fsdp_legacy.memory.repeated import _grouped, estimate_memory_repeated
from fsdp_legacy.wrap import ModuleWrapPolicy

# Units over the all-gather bucket's budget (1 MiB), as a real model's layers are: one collective per layer.
CONFIG = LlamaConfig(256, 768, 12, 4, 2, 512, rope_theta=10000.0)
BATCH = (2, 64)
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)


def builder(
    qlora: bool = False, checkpointing: bool = False, odd_layer: int | None = None, config: LlamaConfig = CONFIG
) -> Callable:
    def build(n: int) -> nn.Module:
        model = Llama(config.with_layers(n))
        if odd_layer is not None and odd_layer < n:  # one layer with a wider MLP: not identical
            model.layers[odd_layer].mlp = MLP(replace(CONFIG, intermediate_size=2 * CONFIG.intermediate_size))
        if qlora:
            to_qlora(model, rank=8)
        if checkpointing:
            apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, DecoderLayer))
        return model

    return build


def loss(model: nn.Module, step: int) -> torch.Tensor:
    ids = torch.randint(0, CONFIG.vocab_size, BATCH)
    return F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


CASES = {
    "qlora_checkpointing_bf16_offload_ws2": (
        dict(qlora=True, checkpointing=True),
        dict(mixed_precision=BF16, cpu_offload=CPUOffload(offload_params=True), use_orig_params=True),
        2,
        8,
    ),
    "checkpointing_bf16_ws8": (dict(checkpointing=True), dict(mixed_precision=BF16), 8, 10),
    "fp32_forward_prefetch_ws4": ({}, dict(forward_prefetch=True), 4, 8),
    "shard_grad_op_ws2": ({}, dict(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP), 2, 8),
    "prefetch_post_orig_params_ws64": (
        {},
        dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST, use_orig_params=True, mixed_precision=BF16),
        64,
        12,
    ),
}


def _both(build: Callable, layers: int, kwargs: dict, world_size: int, **extra: Any):
    policy = dict(auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}), **kwargs)
    fast = estimate_memory_repeated(build, layers, DecoderLayer, loss, world_size, policy, adamw, **extra)
    full = estimate_memory(lambda: build(layers), loss, world_size, policy, adamw, **extra)
    return fast, full


def _assert_equal(fast, full) -> None:
    assert list(fast.peaks) == list(full.peaks)
    for phase in Phase:
        assert fast.peak(phase) == full.peak(phase), phase
        assert fast.split(phase) == full.split(phase), phase
        assert fast.peaks.get(phase) == _grouped(full.peaks.get(phase, {}), "layers."), phase


HEAVY_CASES = {
    "qlora_checkpointing_bf16_offload_ws2",
    "prefetch_post_orig_params_ws64",
    "fp32_forward_prefetch_ws4",
    "checkpointing_bf16_ws8",
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.heavy) if c in HEAVY_CASES else c for c in CASES]
)  # (the heavy ones 9-26 s each; mem-report's QLoRA case also runs in test_mem_report_qlora)
def test_extrapolated_equals_the_full_trace(case: str) -> None:
    setup, kwargs, world_size, layers = CASES[case]
    fast, full = _both(builder(**setup), layers, kwargs, world_size)
    assert fast.method == "extrapolated from 3, 4 and 5 layers"
    _assert_equal(fast, full)


@pytest.mark.heavy  # traced whole and in samples, about 11 s: CI runs it after the README's tests (pytest -m heavy)
def test_hybrid_sharding() -> None:
    kwargs = dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD, mixed_precision=BF16)
    fast, full = _both(builder(checkpointing=True), 9, kwargs, 4, hybrid_shape=(2, 2))
    assert fast.method.startswith("extrapolated")
    _assert_equal(fast, full)


def test_layers_not_identical_are_traced_whole() -> None:
    """Layer 6 of 8 is wider: the samples (3 to 5 layers) cannot see it, the check of the whole model does."""
    fast, full = _both(builder(odd_layer=6), 8, {}, 2)
    assert fast.method == "traced (the DecoderLayer layers are not identical)"
    assert fast.peaks == full.peaks


@pytest.mark.heavy  # traced whole and in samples, about 10 s: CI runs it after the README's tests (pytest -m heavy)
def test_layers_in_shared_buckets_are_traced_whole() -> None:
    """Layers under the bucket's budget share all-gathers and reductions, several at a time: memory is not the same
    from one layer to the next, the checks say so and the model is traced whole."""
    fast, full = _both(builder(config=LlamaConfig(64, 192, 12, 4, 2, 512, tie_embeddings=True)), 9, {}, 2)
    assert fast.method.startswith("traced (") and "arithmetic progression" in fast.method
    assert fast.peaks == full.peaks


def test_marks_change_nothing_measured() -> None:
    """The segment marks (hooks on the layers) leave the phases' peaks as they are."""
    from fsdp_legacy.memory.repeated import _marker

    policy = dict(auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}), mixed_precision=BF16)
    build = builder(checkpointing=True)
    plain = estimate_memory(lambda: build(4), loss, 2, policy, adamw)
    marked = estimate_memory(lambda: build(4), loss, 2, policy, adamw, instrument=_marker("layers."))
    assert marked.peaks == plain.peaks and not plain.segments
    assert len(marked.segments) > 4 * 3 * 2  # three marks per layer and step, and more
