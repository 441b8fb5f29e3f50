"""torch's own FSDP1 parity check, `FSDPTestMixin._test_fsdp_parity` (torch/testing/_internal/common_fsdp.py), run on
fsdp_legacy: its test models build their units with `FullyShardedDataParallel` and `wrap` from torch's namespace,
which the switch (`fsdp_legacy.install()`) points at ours, and it trains each against DDP (or its DummyDDP for the
mixture of experts), then compares the losses and the full parameters (summon_full_params), saving and reloading the
model's state dict on the way. The matrix follows torch's test_fsdp_core: every sharding strategy, use_orig_params,
parameter CPU offload and backward prefetch, the device before / after / never, forward prefetch, the sharded grad
scaler and a longer run.

Left out, as on torch's FSDP1 on this CPU: its mixed-precision and pure-fp16 variants (the DDP reference autocasts to
bfloat16 on a CPU, and fp16 embeddings index with halves), its CUDA-only delays, `NonUniformReqGradNWM` without
use_orig_params (torch's test uses it with), and offload with the device after (which expects parameters on an
accelerator).
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch.distributed as dist

import fsdp_legacy
from harness import run_on_ranks

MODELS = (
    "NestedWrappedModule",
    "AlwaysWrapNestedWrappedModule",
    "TransformerWithSharedParams",
    "MixtureOfExperts",
    "NonUniformReqGradNWM",
)


def _parity_checker():  # type: ignore[no-untyped-def]
    """An object carrying torch's parity methods over this process's default group."""
    from torch.testing._internal.common_fsdp import FSDPTestMixin
    from torch.testing._internal.common_utils import TestCase

    class Parity(FSDPTestMixin, TestCase):
        def runTest(self) -> None:  # (TestCase needs a method to be built around)
            pass

        @property
        def process_group(self):  # type: ignore[no-untyped-def]
            return dist.distributed_c10d._get_default_group()

        @property
        def rank(self) -> int:
            return dist.get_rank()

        @property
        def world_size(self) -> int:
            return dist.get_world_size()

    return Parity()


def _configurations(model: str) -> list[tuple[str, dict]]:
    from torch.testing._internal.common_fsdp import DEVICEInitMode

    from fsdp_legacy import BackwardPrefetch, CPUOffload, ShardingStrategy

    strategies = list(ShardingStrategy)[:3]  # FULL_SHARD, SHARD_GRAD_OP, NO_SHARD
    uops = [True] if model == "NonUniformReqGradNWM" else [False, True]
    found = []
    for strategy, uop, offload, prefetch in itertools.product(
        strategies, uops, [False, True], [None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST]
    ):
        found.append(
            (
                "DEVICE_BEFORE",
                dict(
                    sharding_strategy=strategy,
                    use_orig_params=uop,
                    cpu_offload=CPUOffload(offload_params=offload),
                    backward_prefetch=prefetch,
                ),
            )
        )
    for strategy, uop in itertools.product(strategies, uops):
        base = dict(sharding_strategy=strategy, use_orig_params=uop)
        found += [
            ("DEVICE_AFTER", base),
            ("DEVICE_NEVER", base),
            ("DEVICE_BEFORE", base | dict(forward_prefetch=True)),
            ("DEVICE_BEFORE", base | dict(enable_sharded_grad_scaler=True)),
            ("DEVICE_BEFORE", base | dict(num_iters=3, save_model=False)),
        ]
    assert all(hasattr(DEVICEInitMode, mode) for mode, _ in found)
    return found


def _run_torch_parity(model_name: str) -> int:
    fsdp_legacy.install()
    try:
        from torch.testing._internal import common_fsdp

        assert common_fsdp.FSDP is fsdp_legacy.FullyShardedDataParallel, "the switch reaches torch's test models"
        model_class = getattr(common_fsdp, model_name)
        checker = _parity_checker()
        ran = 0
        for device_mode, kwargs in _configurations(model_name):
            if model_name == "MixtureOfExperts":  # its experts are not replicated: torch's DummyDDP is the reference
                kwargs = kwargs | dict(ref_init_fn=common_fsdp.DummyDDP)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    checker._test_fsdp_parity(
                        model_class,
                        common_fsdp.FSDPInitMode.RECURSIVE,
                        common_fsdp.DEVICEInitMode[device_mode],
                        **kwargs,
                    )
                except Exception as error:
                    raise AssertionError(f"{model_name}, {device_mode}, {kwargs}: {error}") from error
            ran += 1
        return ran
    finally:
        fsdp_legacy.uninstall()


@pytest.mark.heavy  # torch's own parity check on its models: CI runs it after the README's tests (pytest -m heavy)
@pytest.mark.parametrize("model_name", MODELS)
def test_torchs_fsdp_parity_check_passes_on_fsdp_legacy(model_name: str) -> None:
    ran = run_on_ranks(_run_torch_parity, 2, model_name)
    assert ran[0] == ran[1] >= 30
