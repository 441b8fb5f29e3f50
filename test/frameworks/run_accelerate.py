"""Accelerate's FSDP plugin (fsdp_version=1) on 2 CPU ranks: train, clip, save_state, load_state, train on, for each
configuration; see common.py for the contract with test_frameworks.py."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass

import torch
from common import (
    Net,
    batch,
    check_impl,
    checksum,
    compiled_graphs,
    full_params,
    loss_of,
    max_difference,
    parse_args,
    run_all,
)


@dataclass(frozen=True)
class Run:
    name: str
    state_dict_type: str  # FULL_STATE_DICT | SHARDED_STATE_DICT
    mixed_precision: str = "no"  # no | bf16
    weights: str = "float32"  # the model's own dtype before wrapping
    use_orig_params: bool = False
    activation_checkpointing: bool = False
    dynamo_backend: str = "no"  # Accelerator(dynamo_backend=...): the whole wrapped model under torch.compile


RUNS = [
    Run("fp32_full", "FULL_STATE_DICT"),
    Run("fp32_sharded_uop", "SHARDED_STATE_DICT", use_orig_params=True),
    Run("bf16_sharded", "SHARDED_STATE_DICT", "bf16"),
    Run("bf16_full_uop", "FULL_STATE_DICT", "bf16", use_orig_params=True),
    Run("bf16_weights_full", "FULL_STATE_DICT", "bf16", "bfloat16"),
    Run("bf16_weights_sharded_uop", "SHARDED_STATE_DICT", "bf16", "bfloat16", use_orig_params=True),
    Run("ac_full_uop", "FULL_STATE_DICT", use_orig_params=True, activation_checkpointing=True),
    Run("ac_bf16_sharded", "SHARDED_STATE_DICT", "bf16", activation_checkpointing=True),
    Run("compiled_sharded_uop", "SHARDED_STATE_DICT", use_orig_params=True, dynamo_backend="inductor"),
    Run("compiled_bf16_full_uop", "FULL_STATE_DICT", "bf16", use_orig_params=True, dynamo_backend="inductor"),
]


def accelerator(run: Run):  # type: ignore[no-untyped-def]
    """An Accelerator with the FSDP plugin on CPU. Accelerate turns its FSDP plugin on only for GPU-like backends
    and otherwise silently uses DDP, so the state is set to FSDP by hand, as its FSDP branch would have."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    from common import Block
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # resolved at run time: ours under FSDP_LEGACY=1

    AcceleratorState._reset_state(reset_partial_state=True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        state_dict_type=run.state_dict_type,
        use_orig_params=run.use_orig_params,
        activation_checkpointing=run.activation_checkpointing,
    )
    torch._dynamo.reset()  # each run compiles its own model (the graphs of the run before would be reused)
    torch._dynamo.utils.counters.clear()  # and counts its own graphs
    acc = Accelerator(
        cpu=True, mixed_precision=run.mixed_precision, fsdp_plugin=plugin, dynamo_backend=run.dynamo_backend
    )
    acc.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    return acc


def train_run(run: Run, impl: str, directory: str) -> dict:
    acc = accelerator(run)
    torch.manual_seed(0)
    model = Net().to(getattr(torch, run.weights))
    model = acc.prepare(model)
    check_impl(impl, model)
    optim = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    dtype = torch.bfloat16 if run.weights == "bfloat16" and run.mixed_precision == "no" else torch.float32
    losses, grad_norms = [], []
    for step in range(3):
        x, y = batch(step, dtype)
        loss = loss_of(model(x), y)
        acc.backward(loss)
        grad_norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    flat_dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if acc.is_main_process and os.path.exists(directory):
        shutil.rmtree(directory)
    acc.wait_for_everyone()
    acc.save_state(directory)
    saved = full_params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc.load_state(directory)
    restored = full_params(model)
    x, y = batch(3, dtype)
    loss = loss_of(model(x), y)
    acc.backward(loss)
    optim.step()
    optim.zero_grad()
    result = dict(
        config=asdict(run),
        fsdp=check_impl(impl, model),
        losses=losses,
        grad_norms=grad_norms,
        param_dtypes=flat_dtypes,
        restored_max_difference=max_difference(saved, restored),
        loss_after_resume=loss.item(),
        params_after_resume=checksum(full_params(model)),
        compiled=compiled_graphs() > 0,
    )
    acc.wait_for_everyone()
    return result


def main() -> None:
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"  # otherwise Accelerate passes device_id=cpu:0, which FSDP1 refuses
    run_all(parse_args(), RUNS, train_run)


if __name__ == "__main__":
    main()
