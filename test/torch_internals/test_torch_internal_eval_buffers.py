"""torch's test_fsdp_mixed_precision `test_full_precision_in_eval_buffers`, side by side with torch's FSDP1: with
MixedPrecision(buffer_dtype=float16), buffers are float16 after a training forward; in eval mode with
FSDP_USE_FULL_PREC_IN_EVAL=1 they are back in their own dtype (float64 here) when each unit's module runs and after
the forward, and float16 again after a training forward (without the variable they stay float16 throughout)."""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
from parameterized import parameterized
from torch import nn

from torch_side_by_side import _FSDP, _run


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10)
        self.register_buffer("buf", torch.ones(2, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _buffer_dtypes(full_precision_in_eval: bool, cast_forward_inputs: bool) -> dict[str, Any]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    policy = fsdp.MixedPrecision(
        param_dtype=torch.float16,
        reduce_dtype=torch.float16,
        buffer_dtype=torch.float16,
        cast_forward_inputs=cast_forward_inputs,
    )
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1" if full_precision_in_eval else "0"
    try:
        inner = [_FSDP(_WithBuffer(), mixed_precision=policy) for _ in range(2)]
        model = _FSDP(nn.Sequential(*inner), mixed_precision=policy)
        x = torch.randn(3, 10)
        seen: dict[str, Any] = {}

        def dtypes() -> list[str]:
            return [str(b.dtype) for b in model.buffers()]

        model(x)
        seen["train"] = dtypes()
        when_run: list[list[str]] = []
        hooks = [
            unit.module.register_forward_pre_hook(lambda m, _: when_run.append([str(b.dtype) for b in m.buffers()]))
            for unit in inner
        ]
        model.eval()
        model(x)
        seen["eval, as each module runs"] = when_run
        seen["eval"] = dtypes()
        for hook in hooks:
            hook.remove()
        model.train()
        model(x)
        seen["train again"] = dtypes()
        return seen
    finally:
        del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]


@parameterized.expand([(full, cast) for full in (True, False) for cast in (True, False)])
def test_buffers_in_full_precision_in_eval_as_torch(full_precision_in_eval: bool, cast_forward_inputs: bool) -> None:
    for observed in _run(_buffer_dtypes, full_precision_in_eval, cast_forward_inputs):
        expected = "torch.float64" if full_precision_in_eval else "torch.float16"
        assert observed["eval"] == [expected, expected], observed
        assert observed["train again"] == ["torch.float16", "torch.float16"], observed
