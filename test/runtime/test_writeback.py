"""use_orig_params=True writeback as torch's FSDP1 does it: a new tensor assigned to an original parameter's `.data`
(same size) or `.grad` between iterations reaches the flat parameter at the next unshard; a size change raises
torch's error; with mixed precision and with SHARD_GRAD_OP too. Also the names inside forward and no_sync under mixed
precision. Oracle: torch's FSDP1 doing the same."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp
from torch import nn

import fsdp_legacy
import models
from fsdp_utils import Config, batch, build_ours, build_torch_fsdp, clean, loss_of, optimizer
from harness import run_on_ranks

BF16 = ("bfloat16",) * 3


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with type(model).summon_full_params(model):
        return {clean(n): p.detach().float().clone() for n, p in model.named_parameters()}


def _edit_between_steps(model: nn.Module, config: Config, edit: str) -> Any:
    opt = optimizer(model)
    loss_of(model(batch(config, 0))).backward()
    opt.step()
    if edit == "grad":  # accumulate onto user-assigned gradients, no zero_grad
        for p in model.parameters():
            if p.grad is not None:
                p.grad = torch.full_like(p.grad, 0.25)
    else:
        opt.zero_grad()
    for p in model.parameters():
        if edit == "data" and p.numel():
            p.data = p.data * 0.5 + 0.1  # a new tensor, not an in-place edit
        if edit == "size" and p.numel():
            p.data = torch.zeros(p.numel() + 1)
            break
    try:
        losses = []
        for step in range(1, 3):
            loss = loss_of(model(batch(config, step)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    except RuntimeError as error:
        return str(error)
    return losses, _full(model)


def _same_as_torch(strategy: str, mixed: bool, edit: str) -> None:
    config = Config("net", strategy, use_orig_params=True, mixed_precision=BF16 if mixed else None)
    ours = _edit_between_steps(build_ours(config)[1], config, edit)
    theirs = _edit_between_steps(build_torch_fsdp(config), config, edit)
    if edit == "size":
        assert ours == theirs and ours.startswith("Cannot writeback when the parameter shape changes"), (ours, theirs)
        return
    for a, b in zip(ours[0], theirs[0], strict=True):
        torch.testing.assert_close(a, b, msg="losses")
    assert ours[1].keys() == theirs[1].keys()
    # bf16: torch's NO_SHARD all-reduces the gradient accumulated onto an existing float32 one in float32, ours
    # reduces this backward's gradient in the reduce dtype and then adds (compatibility.md): rounding differs.
    tolerance = {"atol": 1e-3, "rtol": 1e-2} if mixed else {}
    for name, value in ours[1].items():
        torch.testing.assert_close(value, theirs[1][name], msg=lambda m, name=name: f"{name}: {m}", **tolerance)


@pytest.mark.parametrize("edit", ["data", "grad", "size"])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_writeback_of_replaced_data_and_grads_as_torch(strategy: str, mixed: bool, edit: str) -> None:
    run_on_ranks(_same_as_torch, 2, strategy, mixed, edit)


@pytest.mark.parametrize("world_size", [1, 4])
def test_writeback_at_one_and_four_ranks_as_torch(world_size: int) -> None:
    # (not "size" at 4 ranks: each rank resizes its first non-empty piece, which at 4 ranks lies in different units
    # on different ranks, so some raise at the root's unshard while the others enter its all-gather; torch's FSDP1
    # does the same: the check is local to each rank)
    run_on_ranks(_same_as_torch, world_size, "FULL_SHARD", False, "data")


def _parameters_inside_forward(use_orig_params: bool, strategy: str) -> None:
    config = Config("net", strategy, use_orig_params=use_orig_params)
    seen = []
    for model in (build_ours(config)[1], build_torch_fsdp(config)):
        found: list[tuple[str, tuple[int, ...], torch.Tensor]] = []
        block = next(m for m in model.modules() if isinstance(m, models.Block))
        block.register_forward_pre_hook(
            lambda *_, model=model, found=found: found.extend(
                (n, tuple(p.shape), p.detach().clone()) for n, p in model.named_parameters()
            )
        )
        for step in range(2):
            loss_of(model(batch(config, step))).backward()
        seen.append(found)
    assert [n for n, _, _ in seen[0]] == [n for n, _, _ in seen[1]], (seen[0], seen[1])
    if not use_orig_params:
        return  # the flat parameter: ours keeps its world-size padding inside forward (compatibility.md)
    assert [s for _, s, _ in seen[0]] == [s for _, s, _ in seen[1]], (seen[0], seen[1])
    for (name, _, ours), (_, _, theirs) in zip(*seen, strict=True):
        torch.testing.assert_close(ours, theirs, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_named_parameters_inside_forward_as_torch(use_orig_params: bool, strategy: str) -> None:
    # uop=True: the unsharded views, as torch shows them there (names, shapes and values)
    run_on_ranks(_parameters_inside_forward, 2, use_orig_params, strategy)


def _no_sync_mixed_precision() -> None:
    config = Config("net", use_orig_params=True, mixed_precision=BF16)
    grads = []
    for model in (build_ours(config)[1], build_torch_fsdp(config)):
        with model.no_sync():
            loss_of(model(batch(config, 0))).backward()
        loss_of(model(batch(config, 1))).backward()
        grads.append({clean(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert grad.dtype == grads[1][name].dtype
        torch.testing.assert_close(grad, grads[1][name], msg=name)


def test_no_sync_with_mixed_precision_and_orig_params_gives_torchs_gradients() -> None:
    run_on_ranks(_no_sync_mixed_precision, 2)


# ---------------------------------------------------------------------------------------------------------------------
# torch's TestFSDPUseOrigParamsWriteback cases, side by side with torch's FSDP1: one unit (no policy) over two Linears


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.lin1 = nn.Linear(5, 5)
        self.lin2 = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


def _two_linear(fsdp_module: Any, strategy: str, mixed: bool) -> nn.Module:
    extra: dict[str, Any] = {"device_id": torch.device("cpu")} if fsdp_module is torch.distributed.fsdp else {}
    if mixed:
        extra["mixed_precision"] = fsdp_module.MixedPrecision(param_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fsdp_module.FullyShardedDataParallel(
            TwoLinear(), sharding_strategy=fsdp_module.ShardingStrategy[strategy], use_orig_params=True, **extra
        )


def _both(strategy: str, mixed: bool) -> tuple[nn.Module, nn.Module]:
    import torch.distributed.fsdp as tfsdp

    return _two_linear(fsdp_legacy, strategy, mixed), _two_linear(tfsdp, strategy, mixed)


def _inp() -> torch.Tensor:
    return torch.randn(2, 5, generator=torch.Generator().manual_seed(dist.get_rank()))


def _assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], mixed: bool) -> None:
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    tolerance = {"atol": 1e-3, "rtol": 1e-2} if mixed else {}
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], msg=lambda m, name=name: f"{name}: {m}", **tolerance)


def _param_writeback(strategy: str, mixed: bool, first: bool, change_data: bool) -> None:
    seen = []
    for model in _both(strategy, mixed):
        linear = model.module.lin1 if first else model.module.lin2
        new = nn.Parameter(torch.ones_like(linear.weight) * 2)
        if change_data:
            linear.weight.data = new
        else:
            linear.weight = new  # the parameter variable itself
        before = _full(model)
        loss_of(model(_inp())).backward()  # the replaced parameter takes part in training
        seen.append((before, _full(model), {clean(n): p.shape for n, p in model.named_parameters()}))
    for ours, theirs in zip(seen[0][:2], seen[1][:2], strict=True):
        _assert_same(ours, theirs, mixed)
    assert seen[0][2] == seen[1][2], (seen[0][2], seen[1][2])


@pytest.mark.parametrize("change_data", [False, True], ids=["variable", "data"])
@pytest.mark.parametrize("first", [False, True], ids=["lin2", "lin1"])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_param_writeback_as_torch(strategy: str, mixed: bool, first: bool, change_data: bool) -> None:
    run_on_ranks(_param_writeback, 2, strategy, mixed, first, change_data)


def _grad_writeback(strategy: str, mixed: bool, first: bool, change_data: bool, set_to_none: bool) -> None:
    seen = []
    for model in _both(strategy, mixed):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        loss_of(model(_inp())).backward()
        weight = (model.module.lin1 if first else model.module.lin2).weight
        if change_data:
            if weight.grad is not None:
                weight.grad.data = torch.ones_like(weight) * 2
        else:
            weight.grad = None if set_to_none else torch.ones_like(weight) * 2
        opt.step()
        after_step = _full(model)
        loss_of(model(_inp())).backward()  # no zero_grad: accumulates onto the written-back gradient
        opt.step()
        seen.append((after_step, _full(model)))
    for ours, theirs in zip(*seen, strict=True):
        _assert_same(ours, theirs, mixed)


@pytest.mark.parametrize(
    "change_data,set_to_none", [(False, False), (False, True), (True, False)], ids=["new", "none", "data"]
)
@pytest.mark.parametrize("first", [False, True], ids=["lin2", "lin1"])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_grad_writeback_as_torch(strategy: str, mixed: bool, first: bool, change_data: bool, set_to_none: bool):
    run_on_ranks(_grad_writeback, 2, strategy, mixed, first, change_data, set_to_none)


def _reshape_and_summon(model: nn.Module, what: str, ranks: tuple[int, ...]) -> str:
    """Rank 0 changes lin1.weight, rank 1 lin2.weight (the piece each holds), with one more element per dimension."""
    if dist.get_rank() in ranks:
        linear = model.module.lin1 if dist.get_rank() == 0 else model.module.lin2
        shape = [n + 1 for n in linear.weight.shape]
        if what == "parameter":
            linear.weight = nn.Parameter(torch.randn(shape))
            linear.weight.grad = torch.randn(shape)
        else:  # only the gradient: `.grad.data` takes any shape
            linear.weight.grad = torch.ones_like(linear.weight)
            linear.weight.grad.data = torch.randn(shape)
    try:
        with type(model).summon_full_params(model):
            pass
    except (RuntimeError, AssertionError) as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


def _shape_mismatch(strategy: str, what: str) -> None:
    ours, theirs = (_reshape_and_summon(model, what, (0, 1)) for model in _both(strategy, False))
    assert ours == theirs and ours.startswith(f"RuntimeError: Cannot writeback when the {what}"), (ours, theirs)


@pytest.mark.parametrize("what", ["parameter", "gradient"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_summon_after_a_shape_change_raises_torchs_error(strategy: str, what: str) -> None:
    run_on_ranks(_shape_mismatch, 2, strategy, what)


def _shape_change_on_one_rank() -> str:
    model = _two_linear(fsdp_legacy, "FULL_SHARD", False)
    result = _reshape_and_summon(model, "parameter", (0,))
    # Every rank raises (torch's other ranks would wait in the all-gather), and the unit stays usable.
    if dist.get_rank() == 0:
        model.module.lin1.weight = nn.Parameter(torch.zeros(model.module.lin1.weight.numel() - 1))  # (25,) again
    loss_of(model(_inp())).backward()
    return result


def test_a_shape_change_on_one_rank_raises_on_every_rank() -> None:
    results = run_on_ranks(_shape_change_on_one_rank, 2)
    assert results[0].startswith("RuntimeError: Cannot writeback when the parameter shape changes"), results
    assert results[1].startswith("RuntimeError: Cannot writeback: another rank"), results


# ---------------------------------------------------------------------------------------------------------------------
# The original parameters between forward and backward (torch's test_access_params_after_forward), side by side


class NoBiasFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.lin1 = nn.Linear(5, 5, bias=False)
        self.lin2 = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


def _every_linear_a_unit(fsdp_module: Any, strategy: str, net: nn.Module, policy: bool = True, **kwargs: Any):
    if fsdp_module is torch.distributed.fsdp:
        kwargs["device_id"] = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fsdp_module.FullyShardedDataParallel(
            net,
            auto_wrap_policy=fsdp_module.wrap.ModuleWrapPolicy({nn.Linear}) if policy else None,
            sharding_strategy=fsdp_module.ShardingStrategy[strategy],
            use_orig_params=True,
            **kwargs,
        )


def _shown(model: nn.Module) -> list[tuple[str, str, tuple[int, ...], torch.Tensor]]:
    return [(clean(n), type(p).__name__, tuple(p.shape), p.detach().clone()) for n, p in model.named_parameters()]


def _params_between_forward_and_backward(strategy: str, root_holds_params: bool) -> None:
    import torch.distributed.fsdp as tfsdp

    seen = []
    for fsdp_module in (fsdp_legacy, tfsdp):
        # (root_holds_params: lin2 belongs to the root, which keeps its gathered parameters for backward)
        net = NoBiasFirst()
        if root_holds_params:
            net.lin1 = _every_linear_a_unit(fsdp_module, strategy, net.lin1)
            model = _every_linear_a_unit(fsdp_module, strategy, net, policy=False)
        else:
            model = _every_linear_a_unit(fsdp_module, strategy, net)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        shown = []
        for _ in range(2):
            out = model(_inp())
            shown.append(_shown(model))  # after forward, before backward
            attributes = [(f"{n}.weight", model.module.get_submodule(n).weight) for n in ("lin1", "lin2")]
            shown.append([(n, type(p).__name__, tuple(p.shape), p.detach().clone()) for n, p in attributes])
            out.sum().backward()
            opt.step()
            shown.append(_shown(model))
        seen.append(shown)
    for when, (ours, theirs) in enumerate(zip(*seen, strict=True)):
        assert [r[:3] for r in ours] == [r[:3] for r in theirs], (when, ours, theirs)
        for (name, *_, a), (*_, b) in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, msg=lambda m, name=name, when=when: f"{when} {name}: {m}")


@pytest.mark.parametrize("root_holds_params", [False, True], ids=["units", "root"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_parameters_between_forward_and_backward_as_torch(strategy: str, root_holds_params: bool) -> None:
    run_on_ranks(_params_between_forward_and_backward, 2, strategy, root_holds_params)


def _change_between_forward_and_backward(how: str) -> str:
    """torch's test_writeback_between_fwd_and_bwd_for_no_reshard_raises: SHARD_GRAD_OP keeps the unsharded views from
    forward to backward, and changing one in between raises in backward."""
    results = []
    for fsdp_module in (fsdp_legacy, torch.distributed.fsdp):
        model = _every_linear_a_unit(fsdp_module, "SHARD_GRAD_OP", TwoLinear())
        loss = model(_inp()).sum()
        if how == "data":
            model.lin1.weight.data = model.lin1.weight.clone()
        else:
            model.lin1._fsdp_wrapped_module.weight = nn.Parameter(model.lin1.weight.clone())
        try:
            loss.backward()
            results.append("ok")
        except AssertionError as error:
            results.append(f"AssertionError: {error}")
    assert results[0] == results[1] and results[0].startswith("AssertionError: FSDP does not support"), results
    return results[0]


@pytest.mark.parametrize("how", ["data", "variable"])
def test_changing_a_kept_view_between_forward_and_backward_raises_as_torch(how: str) -> None:
    run_on_ranks(_change_between_forward_and_backward, 2, how)


def _no_false_writeback(full_precision_in_eval: bool) -> None:
    """torch's test_no_reshard_and_mixed_precision: SHARD_GRAD_OP + float16 through train forward -> summon -> train
    forward, train forward -> eval forward, and train step -> eval forward -> SHARDED state dict round trip -> step;
    nothing raises and the parameters stay torch's."""
    import os

    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1" if full_precision_in_eval else "0"
    try:
        seen = []
        for fsdp_module in (fsdp_legacy, torch.distributed.fsdp):
            mp = fsdp_module.MixedPrecision(param_dtype=torch.float16)
            model = _every_linear_a_unit(fsdp_module, "SHARD_GRAD_OP", TwoLinear(), mixed_precision=mp)
            inp = _inp()
            model(inp)
            inside = _full(model)
            model(inp).sum()
            model.train()
            model(inp)
            model.eval()
            model(inp)
            model.train()
            model(inp).sum().backward()
            model.eval()
            model(inp)
            with type(model).state_dict_type(model, fsdp_module.StateDictType.SHARDED_STATE_DICT):
                model.load_state_dict(model.state_dict())
            model.train()
            model(inp).sum().backward()
            seen.append((inside, _full(model)))
        for ours, theirs in zip(*seen, strict=True):
            _assert_same(ours, theirs, True)
    finally:
        del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]


@pytest.mark.parametrize("full_precision_in_eval", [False, True])
def test_no_reshard_with_mixed_precision_writes_nothing_back_as_torch(full_precision_in_eval: bool) -> None:
    run_on_ranks(_no_false_writeback, 2, full_precision_in_eval)


@pytest.mark.parametrize("world_size", [1, 4])
def test_writeback_and_views_at_one_and_four_ranks_as_torch(world_size: int) -> None:
    run_on_ranks(_param_writeback, world_size, "FULL_SHARD", False, True, False)
    run_on_ranks(_grad_writeback, world_size, "SHARD_GRAD_OP", False, False, False, False)
    run_on_ranks(_parameters_inside_forward, world_size, True, "FULL_SHARD")
    run_on_ranks(_params_between_forward_and_backward, world_size, "SHARD_GRAD_OP", True)
    run_on_ranks(_params_between_forward_and_backward, world_size, "FULL_SHARD", True)
