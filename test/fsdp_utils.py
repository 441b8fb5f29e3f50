"""Helpers shared by the tests that run on ranks: building models, training steps, and reading full parameters."""

import contextlib
import copy
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdp_legacy
import models
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import wrap as our_wrap

FSDP_PREFIX = "_fsdp_wrapped_module."
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name before 2.13
MODELS = {
    "net": (models.Net, models.Net.batch, {"block": (models.Block,)}),
    "transformer": (models.Transformer, models.Transformer.batch, {"block": (models.TransformerBlock,)}),
    "moe": (models.MoE, models.MoE.batch, {"block": (models.Expert,)}),
    "frozen": (models.Frozen, models.Frozen.batch, {"block": (models.Block, nn.Sequential)}),
}


@dataclass(frozen=True)
class Config:
    """One point of the parity matrix."""

    model: str = "net"
    strategy: str = "FULL_SHARD"
    policy: str = "block"  # block | always | size | none
    use_orig_params: bool = False
    backward_prefetch: str | None = "BACKWARD_PRE"
    forward_prefetch: bool = False
    no_grad_step: int | None = None  # run an extra torch.no_grad() forward after this step
    steps: int = 4
    # zero_grad(set_to_none=False) keeps DDP comparable when a step leaves parameters unused on every rank: DDP then
    # has no gradient (SGD skips the parameter) where FSDP has a zero slice of the flat gradient.
    set_to_none: bool = True
    mixed_precision: tuple | None = None  # (param_dtype, reduce_dtype, buffer_dtype) names, e.g. ("bfloat16",)*3
    extra: dict = field(default_factory=dict, hash=False)

    def name(self) -> str:
        return "_".join(
            str(v)
            for v in (
                self.model,
                self.strategy,
                self.policy,
                "uop" if self.use_orig_params else "flat",
                self.backward_prefetch,
                "fwdpf" if self.forward_prefetch else "",
                f"nograd{self.no_grad_step}" if self.no_grad_step is not None else "",
                "mp_" + "_".join(map(str, self.mixed_precision)) if self.mixed_precision else "",
            )
            if v
        )


def policy_for(config: Config, wrap_module) -> Any:
    """The wrap policy of `config`, built from `wrap_module` (ours or torch's fsdp.wrap, for the same semantics)."""
    classes = MODELS[config.model][2]["block"]
    if config.policy == "block":
        return wrap_module.ModuleWrapPolicy(set(classes))
    if config.policy == "always":
        return wrap_module.always_wrap_policy
    if config.policy == "size":
        import functools

        return functools.partial(wrap_module.size_based_auto_wrap_policy, min_num_params=20)
    return None


def fsdp_kwargs(config: Config, enums) -> dict:
    """Constructor arguments for `config`; `enums` is the module providing ShardingStrategy/BackwardPrefetch."""
    prefetch = config.backward_prefetch
    extra = dict(config.extra)
    if config.mixed_precision is not None:
        *names, keep = (*config.mixed_precision, False)[:4]
        dtypes = [getattr(torch, name) if name else None for name in names]
        extra["mixed_precision"] = enums.MixedPrecision(*dtypes, keep_low_precision_grads=bool(keep))
    return dict(
        sharding_strategy=enums.ShardingStrategy[config.strategy],
        use_orig_params=config.use_orig_params,
        backward_prefetch=enums.BackwardPrefetch[prefetch] if prefetch else None,
        forward_prefetch=config.forward_prefetch,
        **extra,
    )


def build_ours(config: Config, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(reference copy, our FSDP model) from the same initialisation."""
    torch.manual_seed(seed)
    model = MODELS[config.model][0]()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = FSDP(model, auto_wrap_policy=policy_for(config, our_wrap), **fsdp_kwargs(config, fsdp_legacy))
    return reference, ours


def build_torch_fsdp(config: Config, seed: int = 0) -> nn.Module:
    import torch.distributed.fsdp as tfsdp
    import torch.distributed.fsdp.wrap as twrap

    torch.manual_seed(seed)
    model = MODELS[config.model][0]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tfsdp.FullyShardedDataParallel(
            model,
            auto_wrap_policy=policy_for(config, twrap),
            device_id=torch.device("cpu"),
            **fsdp_kwargs(config, tfsdp),
        )


def batch(config: Config, step: int) -> torch.Tensor:
    """Different data on every rank and step."""
    return MODELS[config.model][1](1000 * step + dist.get_rank())


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output if output.dim() == 0 else output.pow(2).sum()


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def clean(name: str) -> str:
    return name.replace(FSDP_PREFIX, "")


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every original parameter of our FSDP `model`, all-gathered from the shards, keyed by the unwrapped FQN."""
    result = {}
    for unit_name, unit in model.named_modules():
        for handle in unit._handles if isinstance(unit, FSDP) else ():
            flat = handle.local_shard.detach()
            if handle.sharded:
                flat = torch.empty(handle.layout.padded_numel, dtype=flat.dtype, device=flat.device)
                all_gather_single(flat, handle.local_shard.detach().contiguous(), group=handle.group)
            prefix = clean(unit_name + "." if unit_name else "")
            for info in handle.layout.params:
                result[prefix + info.fqn] = flat[info.offset : info.offset + info.numel].view(info.shape).clone()
            for shared in handle.layout.shared:
                name = f"{shared.module_name}.{shared.param_name}" if shared.module_name else shared.param_name
                result[prefix + name] = result[prefix + shared.primary.fqn]
    return result


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 1e-6, rtol: float = 1e-5
) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def assert_same_params(ours: nn.Module, reference: nn.Module, what: str = "") -> None:
    """Every parameter of the plain `reference` model equals the full parameter of our FSDP model."""
    full = full_params(ours)
    for name, param in reference.named_parameters():
        assert_close(full[name], param.detach(), f"{what}{name}")


def train_net_with_ddp(ours: nn.Module, reference: nn.Module, steps: int = 2) -> None:
    """SGD steps on models.Net batches, for our FSDP model and for DDP over the plain `reference` alike."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(reference)
    for model in (ours, ddp):
        opt = optimizer(model)
        for step in range(steps):
            loss_of(model(models.Net.batch(step + dist.get_rank()))).backward()
            opt.step()
            opt.zero_grad()


def train(model: nn.Module, config: Config, step_fn: Callable[[int], None] | None = None) -> list[float]:
    """SGD-with-momentum steps on per-rank data; `step_fn(step)` runs after each backward, before the step."""
    opt = optimizer(model)
    losses = []
    for step in range(config.steps):
        loss = loss_of(model(batch(config, step)))
        loss.backward()
        if step_fn is not None:
            step_fn(step)
        opt.step()
        opt.zero_grad(set_to_none=config.set_to_none)
        losses.append(loss.detach())
        if config.no_grad_step == step:
            with torch.no_grad():
                model(batch(config, 99))
    return losses


@contextlib.contextmanager
def layout_keys() -> Iterator[None]:
    """The opt-in that adds LOCAL layout records as `<flat key>_meta` tensors, the format of earlier versions."""
    os.environ["FSDP_LEGACY_LAYOUT_KEYS"] = "1"
    try:
        yield
    finally:
        del os.environ["FSDP_LEGACY_LAYOUT_KEYS"]


@contextlib.contextmanager
def switched_on() -> Iterator[None]:
    """The switch (fsdp_legacy.install()) on for the block: torch's FSDP1 names resolve to ours."""
    fsdp_legacy.install()
    try:
        yield
    finally:
        fsdp_legacy.uninstall()
