"""Training bit for bit with torch's FSDP1, where a last-bit difference compounds (as clip_grad_norm_'s did in verl's
PPO runs): the same model, data and optimizer on both, and after every backward the sharded gradients, after every
step the parameters, and at the end the FULL and SHARDED optimizer state must be equal in every bit. Covers the
gradient reductions and their pre/post divide factors (2 and 4 ranks, uneven shards), mixed-precision casts (bf16
and fp16 compute, fp32 or low-precision reduction, low-precision gradients kept), NO_SHARD's all-reduce, frozen
parameters and the optimizer-state flattening."""

import warnings
from typing import Any

import torch
import torch.distributed as dist
from parameterized import parameterized
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from fsdp_utils import Config, batch, build_ours, build_torch_fsdp, loss_of
from harness import run_on_ranks


def _named(model: nn.Module, what: str) -> dict[str, torch.Tensor]:
    if what == "grad":
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_bits(ours: Any, theirs: Any, what: str) -> None:
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), f"{what}: keys {list(ours)} vs {list(theirs)}"
        for key in theirs:
            _assert_bits(ours[key], theirs[key], f"{what}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), what
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _assert_bits(a, b, f"{what}[{index}]")
    elif isinstance(theirs, ShardedTensor):
        _assert_bits([s.tensor for s in ours.local_shards()], [s.tensor for s in theirs.local_shards()], what)
    elif isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, f"{what}: {ours.dtype}{tuple(ours.shape)}"
        assert torch.equal(ours, theirs), f"{what}: off torch's FSDP1 by {float((ours - theirs).abs().max())}"
    else:
        assert ours == theirs, f"{what}: {ours!r} vs {theirs!r}"


def _optim_state(implementation: Any, model: nn.Module, optim: Any, kind: str) -> dict[str, Any]:
    fsdp = implementation.FullyShardedDataParallel
    configs = {
        "FULL_STATE_DICT": (implementation.FullStateDictConfig(), implementation.FullOptimStateDictConfig(False)),
        "SHARDED_STATE_DICT": (implementation.ShardedStateDictConfig(), implementation.ShardedOptimStateDictConfig()),
    }
    model_config, optim_config = configs[kind]
    with fsdp.state_dict_type(model, implementation.StateDictType[kind], model_config, optim_config):
        return fsdp.optim_state_dict(model, optim)["state"]


def _train_side_by_side(config: Config, optimizer: str) -> None:
    import torch.distributed.fsdp as torch_fsdp

    import fsdp_legacy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models_ = {"ours": build_ours(config)[1], "torch": build_torch_fsdp(config)}
        make = {
            "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
            "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
        }[optimizer]
        optims = {name: make(model.parameters()) for name, model in models_.items()}
        for step in range(3):
            for model in models_.values():
                loss_of(model(batch(config, step))).float().backward()
            _assert_bits(_named(models_["ours"], "grad"), _named(models_["torch"], "grad"), f"step {step} gradient")
            for optim in optims.values():
                optim.step()
                optim.zero_grad()
            _assert_bits(_named(models_["ours"], "param"), _named(models_["torch"], "param"), f"step {step} params")
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            states = {
                name: _optim_state(fsdp_legacy if name == "ours" else torch_fsdp, model, optims[name], kind)
                for name, model in models_.items()
            }
            _assert_bits(states["ours"], states["torch"], f"{kind} optimizer state")
    dist.barrier()


def _config(strategy: str, uop: bool, mixed: tuple | None = None, model: str = "transformer") -> Config:
    return Config(model, strategy, "block", uop, mixed_precision=mixed)


CASES = [
    (f"{strategy}_{'uop' if uop else 'flat'}_w{world}_{opt}", _config(strategy, uop), opt, world)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    for uop in (False, True)
    for world, opt in ((2, "adamw"), (4, "sgd"))
] + [
    ("bf16_fp32_reduce", _config("FULL_SHARD", True, ("bfloat16", "float32")), "adamw", 2),
    ("bf16_all", _config("FULL_SHARD", False, ("bfloat16", "bfloat16", "bfloat16")), "adamw", 2),
    ("fp16_all_w4", _config("FULL_SHARD", True, ("float16", "float16", "float16")), "sgd", 4),
    ("bf16_low_precision_grads", _config("SHARD_GRAD_OP", False, ("bfloat16", None, None, True)), "sgd", 2),
    ("bf16_no_shard", _config("NO_SHARD", True, ("bfloat16",)), "adamw", 2),
    ("frozen_flat", _config("FULL_SHARD", False, model="frozen"), "adamw", 2),
    ("frozen_uop", _config("FULL_SHARD", True, model="frozen"), "adamw", 4),
]


@parameterized.expand(CASES)
def test_training_bits_equal_torch_fsdp1(_: str, config: Config, optimizer: str, world_size: int) -> None:
    run_on_ranks(_train_side_by_side, world_size, config, optimizer, timeout=240)
