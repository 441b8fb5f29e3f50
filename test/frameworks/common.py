"""What the framework runs share: the model, the data, the launch contract with test_frameworks.py, results, and the
workarounds every run needs on a CPU-only machine (facts of the frameworks and of torch's FSDP1, not of ours).

A run is `torchrun --nproc-per-node=2 run_<framework>.py --impl ours|torch --out DIR`: `ours` is launched with
FSDP_LEGACY=1 in the environment (the supported switch, nothing else), `torch` without it. Each run trains every
configuration of its framework in turn and writes DIR/results.json (rank 0) and each configuration's checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

WIDTH, OUT = 16, 4  # the head is 4 wide: DCP cannot reload (with Accelerate) a parameter whose dim 0 < world size


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.fc(x)) + x)


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data on every rank and step."""
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(8, 8, generator=generator).to(dtype), torch.randn(8, OUT, generator=generator)


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.float() - target) ** 2).mean()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ours", "torch"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", help="run these configurations only")
    args = parser.parse_args()
    if args.impl == "ours" and os.environ.get("FSDP_LEGACY") != "1":
        raise SystemExit("--impl ours runs with FSDP_LEGACY=1 in the environment (the switch under test)")
    if args.impl == "torch":
        patch_torch_fsdp1_for_cpu()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def fsdp_class() -> type:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def check_impl(impl: str, model: nn.Module) -> str:
    """The framework really wrapped the model with the implementation under test; returns its module."""
    expected = "fsdp_legacy" if impl == "ours" else "torch.distributed.fsdp"
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule around the wrapped model
    modules = [cls.__module__ for cls in type(model).__mro__]
    assert any(m.startswith(expected) for m in modules), f"--impl {impl}, but the framework built a {type(model)}"
    return next(m for m in modules if m.startswith(expected))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters by clean name (summon_full_params, no writeback)."""
    fsdp = fsdp_class()
    with fsdp.summon_full_params(model, writeback=False):
        return {
            name.replace("_fsdp_wrapped_module.", "")
            .replace("_checkpoint_wrapped_module.", "")
            .removeprefix("_orig_mod."): p.detach().float().clone()
            for name, p in model.named_parameters()
        }


def hf_fsdp_arguments(use_orig_params: bool, state_dict_type: str) -> dict[str, Any]:
    """transformers' TrainingArguments (and TRL's configs, which extend them) for FSDP1 on CPU ranks, per
    LlamaDecoderLayer. sync_module_states=False: the Trainer's default True makes Accelerate's plugin look for a GPU."""
    return dict(
        use_cpu=True,
        fsdp=True,
        fsdp_config={
            "version": 1,
            "reshard_after_forward": "full_shard",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "use_orig_params": use_orig_params,
            "state_dict_type": state_dict_type,
            "sync_module_states": False,
        },
    )


def hf_trainer_on_cpu(base: type) -> type:
    """`base` (transformers' Trainer or a TRL trainer) with its accelerator's state set to FSDP after it is built, as
    Accelerate's FSDP branch would on a GPU: on CPU the Trainer's Accelerator silently uses DDP. The Trainer is told
    (`is_fsdp_enabled`) and then wraps, clips, saves and loads through FSDP as on a GPU."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    class OnCPU(base):  # type: ignore[misc, valid-type]
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if self.args.fsdp_plugin_args is None or self.is_fsdp_enabled:
                return
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)  # as the Trainer builds it
            state = self.accelerator.state
            state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            state.fsdp_plugin = plugin
            if self.accelerator.mixed_precision != "no":
                plugin.set_mixed_precision(self.accelerator.mixed_precision)
            self.is_fsdp_enabled = True  # what the Trainer derives from state.fsdp_plugin (its checks then pass)

    return OnCPU


def compiled_graphs() -> int:
    """How many graphs torch.compile has built in this process so far (0: nothing was compiled)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def checksum(params: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: float(p.double().sum()) for name, p in params.items()}


@contextlib.contextmanager
def results_file(out: Path) -> Iterator[dict[str, Any]]:
    results: dict[str, Any] = {}
    try:
        yield results
    finally:
        if not dist.is_initialized() or dist.get_rank() == 0:
            (out / "results.json").write_text(json.dumps(results, indent=1))


def run_all(
    args: argparse.Namespace, runs: list[Any], train: Callable[[Any, str, str], dict], suffix: str = ""
) -> None:
    """Train every configuration (or the --only ones) in turn, `train(run, impl, checkpoint_path)`; rank 0 writes
    the results; then every rank leaves its collectives behind together before the process group goes."""
    with results_file(args.out) as results:
        for run in runs:
            if not args.only or run.name in args.only:
                results[run.name] = train(run, args.impl, str(args.out / f"{run.name}{suffix}"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    exit_now()


def exit_now(code: int = 0) -> NoReturn:
    """Out without the interpreter's teardown, once everything is written: a gloo worker thread that lets go of the
    last reference to a tensor of the final collectives while the interpreter shuts down aborts the process (torch
    takes the GIL from that thread; Python ends it: "terminate called without an active exception", rarely, under
    load; see tools/process_exit.py)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def patch_torch_fsdp1_for_cpu() -> None:
    """torch's FSDP1 bugs on a CPU compute device (the oracle's, not ours; ../shared/FSDP1_FACTS.md), both triggered
    by the offload_to_cpu that Accelerate and Lightning always ask for in FULL state dicts:
    1. the model state dict frees the storage the unsharded parameter still uses (FlatParamHandle.to_cpu moves
       nothing, then frees): `setStorage ... out of bounds`, or a segfault with use_orig_params=True. Skip the
       move-and-free on CPU, which is what it would amount to.
    2. the optimizer state dict with use_orig_params=True returns every state of a unit as a view of one reused
       buffer (exp_avg == exp_avg_sq). Run it with offload_to_cpu=False, which on CPU only adds the missing clone."""
    import dataclasses

    from torch.distributed.fsdp import FullOptimStateDictConfig, FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    original_optim_state_dict = FullyShardedDataParallel.optim_state_dict

    def optim_state_dict(model, optim, optim_state_dict=None, group=None):  # type: ignore[no-untyped-def]
        units = FullyShardedDataParallel.fsdp_modules(model)
        configs = [unit._optim_state_dict_config for unit in units]
        for unit, config in zip(units, configs, strict=True):
            if isinstance(config, FullOptimStateDictConfig) and config.offload_to_cpu:
                unit._optim_state_dict_config = dataclasses.replace(config, offload_to_cpu=False)
        try:
            return original_optim_state_dict(model, optim, optim_state_dict, group)
        finally:
            for unit, config in zip(units, configs, strict=True):
                unit._optim_state_dict_config = config

    FullyShardedDataParallel.optim_state_dict = staticmethod(optim_state_dict)

    original = FlatParamHandle.to_cpu

    @contextlib.contextmanager
    def to_cpu(self):  # type: ignore[no-untyped-def]
        if self.device.type == "cpu":
            yield
        else:
            with original(self):
                yield

    FlatParamHandle.to_cpu = to_cpu
