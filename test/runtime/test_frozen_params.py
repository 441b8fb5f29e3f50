"""Frozen parameters inside a unit (use_orig_params=True): no gradient memory for them, and training that matches
plain data parallelism through every way a user handles gradients.

The oracle is data parallelism written out: a plain copy of the model whose gradients are all-reduced and averaged
by hand, which (unlike DDP) also allows freezing a parameter after construction.
"""

import warnings

import torch
import torch.distributed as dist
from parameterized import parameterized
from torch import nn

import fsdp_legacy
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_utils import Config, assert_close, assert_same_params, batch, build_ours, clean, loss_of, optimizer
from harness import run_on_ranks


class Mostly(nn.Module):
    """One unit, mostly frozen: a large frozen projection, a small trainable head, a frozen bias in between."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(32, 32)
        self.head = nn.Linear(32, 3)
        self.scale = nn.Parameter(torch.ones(3))
        self.frozen.requires_grad_(False)
        self.head.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.head(torch.tanh(self.frozen(x))) * self.scale).pow(2).sum()


def _grad_bytes(model: nn.Module) -> int:
    """Bytes of distinct storages behind every gradient the model holds, flat parameters' included."""
    storages = {}
    for module in model.modules():
        tensors = list(module._parameters.values())
        if isinstance(module, FSDP) and module._handle is not None:
            tensors.append(module._handle.flat_param)
        for param in tensors:
            if param is not None and param.grad is not None:
                storage = param.grad.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _frozen_costs_no_gradient_memory(strategy: str, extra: dict) -> None:
    torch.manual_seed(0)
    model = Mostly()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = FSDP(model, use_orig_params=True, sharding_strategy=fsdp_legacy.ShardingStrategy[strategy], **extra)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):  # the second backward accumulates into the first one's gradient
        ours(x).backward()
    total = torch.tensor(_grad_bytes(ours))
    dist.all_reduce(total)
    element_size = 4
    copies = 1 if strategy != "NO_SHARD" else dist.get_world_size()
    # Each trainable element's gradient lives on exactly one rank (every rank under NO_SHARD), nothing else does.
    assert total.item() == trainable * element_size * copies, (total.item(), trainable * element_size * copies)
    frozen = [name for name, p in ours.named_parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in ours.parameters() if not p.requires_grad)


@parameterized.expand(
    [
        ("FULL_SHARD", {}),
        ("SHARD_GRAD_OP", {}),
        ("NO_SHARD", {"cpu_offload": fsdp_legacy.CPUOffload(offload_params=True)}),
        ("FULL_SHARD", {"mixed_precision": fsdp_legacy.MixedPrecision(param_dtype=torch.float64)}),
    ]
)
def test_frozen_params_cost_no_gradient_memory(strategy: str, extra: dict) -> None:
    """The gradient bytes summed over ranks are exactly those of the trainable elements (torch FSDP1 keeps a
    shard-sized flat gradient, frozen elements and padding included)."""
    run_on_ranks(_frozen_costs_no_gradient_memory, 2, strategy, extra)


def _average_grads(reference: nn.Module) -> None:
    for param in reference.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()


def _train_like_data_parallel(strategy: str, mixed_precision: bool) -> None:
    """Mixed requires_grad in one unit; every step handles gradients differently, on both models alike."""
    extra = {"mixed_precision": fsdp_legacy.MixedPrecision(param_dtype=torch.float64)} if mixed_precision else {}
    config = Config("frozen", strategy, "none", True, extra=extra)
    reference, ours = build_ours(config)
    our_opt, ref_opt = optimizer(ours), optimizer(reference)

    def backward(step: int) -> None:
        loss_of(ours(batch(config, step))).backward()
        loss_of(reference(batch(config, step))).backward()

    def step(what: str) -> None:
        _average_grads(reference)
        ours_params = {clean(n): p for n, p in ours.named_parameters()}
        for name, param in reference.named_parameters():
            mine = ours_params[name]
            if mine.numel() == 0:  # no elements on this rank: no gradient either
                continue
            assert (param.grad is None) == (mine.grad is None), f"{what}: {name}.grad presence"
        our_opt.step()
        ref_opt.step()
        assert_same_params(ours, reference, f"{what}: ")

    backward(0)
    step("plain step")
    our_opt.zero_grad()
    ref_opt.zero_grad()
    backward(1)  # two backwards accumulate: averaging is linear, so the oracle averages their sum
    backward(2)
    step("accumulated")
    our_opt.zero_grad(set_to_none=False)
    ref_opt.zero_grad(set_to_none=False)
    backward(3)
    for model in (ours, reference):  # the user replaces gradient objects (not in place)
        for param in model.parameters():
            if param.grad is not None:
                param.grad = param.grad * 0.5
    backward(4)
    step("zeroed in place, then replaced by the user")
    our_opt.zero_grad()
    ref_opt.zero_grad()
    # Freezing after wrapping: the parameter gets no gradient and stops moving.
    {clean(n): p for n, p in ours.named_parameters()}["body.1.weight"].requires_grad_(False)
    reference.body[1].weight.requires_grad_(False)
    backward(5)
    step("frozen after wrapping")
    with FSDP.summon_full_params(ours, with_grads=True):
        ours_params = {clean(n): p for n, p in ours.named_parameters()}
        for name, param in reference.named_parameters():
            mine = ours_params[name]
            if param.grad is None:
                assert mine.grad is None, name
            else:
                assert_close(mine.grad, param.grad, f"summoned gradient of {name}")


@parameterized.expand(
    [("FULL_SHARD", False, 2), ("SHARD_GRAD_OP", False, 2), ("FULL_SHARD", True, 2), ("FULL_SHARD", False, 4)]
)
def test_frozen_params_train_like_data_parallel(strategy: str, mixed_precision: bool, world_size: int) -> None:
    run_on_ranks(_train_like_data_parallel, world_size, strategy, mixed_precision)


def _unfrozen_after_wrapping(ours: bool, strategy: str, use_orig_params: bool) -> tuple[list[float], list]:
    """A unit frozen when wrapped and unfrozen later (gradual unfreezing): its gradients are reduced from then on.
    Losses and full parameters after three SGD steps."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    wrapper = FSDP if ours else TorchFSDP
    kwargs: dict = dict(use_orig_params=use_orig_params, sharding_strategy=getattr(TorchStrategy, strategy))
    if not ours:
        kwargs["device_id"] = torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    model[1].requires_grad_(False)
    model[1] = wrapper(model[1], **kwargs)
    fsdp = wrapper(model, **kwargs)
    losses = []
    for step in range(3):
        if step == 1:
            model[1].requires_grad_(True)
        optim = torch.optim.SGD([p for p in fsdp.parameters() if p.requires_grad], lr=0.1)
        torch.manual_seed(step + dist.get_rank())
        loss = fsdp(torch.randn(4, 4)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    with wrapper.summon_full_params(fsdp):
        return losses, [p.detach().clone() for p in fsdp.parameters()]


@parameterized.expand([(s, u) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD") for u in (False, True)])
def test_unfrozen_after_wrapping_trains_as_torch(strategy: str, use_orig_params: bool) -> None:
    ours = run_on_ranks(_unfrozen_after_wrapping, 2, True, strategy, use_orig_params)
    theirs = run_on_ranks(_unfrozen_after_wrapping, 2, False, strategy, use_orig_params)
    for (our_losses, our_params), (their_losses, their_params) in zip(ours, theirs, strict=True):
        assert our_losses == their_losses
        for a, b in zip(our_params, their_params, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
