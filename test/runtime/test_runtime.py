"""The runtime state machine: no_grad/inference/eval forwards, several forwards before one backward, forwards never
backpropagated, what is sharded when, manual wrapping, and the flat-parameter layout metadata against torch's."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from parameterized import parameterized
from torch.nn.parallel import DistributedDataParallel as DDP

import models
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy.unit import TrainingState
from fsdp_legacy.wrap import enable_wrap, wrap
from fsdp_utils import Config, assert_close, assert_same_params, build_ours, build_torch_fsdp, loss_of, optimizer
from harness import run_on_ranks


def _unsharded_storage(unit: FSDP) -> int:
    return unit._handle.full_padded.untyped_storage().size()


def _is_sharded(unit: FSDP) -> bool:
    handle = unit._handle
    return handle.flat_param.numel() == handle.layout.shard_numel and _unsharded_storage(unit) == 0


def _no_grad_paths(strategy: str, use_orig_params: bool) -> None:
    config = Config("net", strategy, "block", use_orig_params)
    reference, ours = build_ours(config)
    ddp = DDP(reference)
    units = FSDP.fsdp_modules(ours)
    x = models.Net.batch(dist.get_rank())
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            out = ours(x)
        assert not out.requires_grad
        assert all(_is_sharded(u) for u in units), f"{context.__name__}: every unit, the root too, reshards"
        assert all(u.training_state == TrainingState.IDLE for u in units)
        with torch.no_grad():
            assert_close(out, ddp(x), f"{context.__name__} forward output")
    ours.eval()
    with torch.no_grad():
        ours(x)
    ours.train()
    # Backward through a no_grad output is autograd's own error, and FSDP stays usable afterwards.
    with torch.no_grad():
        out = ours(x)
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()
    # Then training proceeds exactly like DDP.
    our_opt, ddp_opt = optimizer(ours), optimizer(ddp)
    for step in range(3):
        batch = models.Net.batch(10 * step + dist.get_rank())
        for model, opt in ((ours, our_opt), (ddp, ddp_opt)):
            loss_of(model(batch)).backward()
            opt.step()
            opt.zero_grad()
    assert_same_params(ours, reference)
    assert all(_is_sharded(u) for u in units), "everything resharded after backward"


@parameterized.expand([(s, u) for s in ("FULL_SHARD", "SHARD_GRAD_OP") for u in (False, True)])
def test_no_grad_inference_and_eval(strategy: str, use_orig_params: bool) -> None:
    run_on_ranks(_no_grad_paths, 2, strategy, use_orig_params)


def _what_is_sharded_when(strategy: str) -> None:
    _, ours = build_ours(Config("net", strategy, "block"))
    root, block = FSDP.fsdp_modules(ours)
    loss = loss_of(ours(models.Net.batch(0)))
    if strategy == "FULL_SHARD":
        assert _unsharded_storage(block) == 0, "FULL_SHARD frees a non-root unit after its forward"
    else:
        assert _unsharded_storage(block) > 0, "SHARD_GRAD_OP keeps it until backward"
    assert _unsharded_storage(root) > 0, "the root keeps its parameters for the backward that follows"
    loss.backward()
    assert _is_sharded(root) and _is_sharded(block)
    assert block._handle.flat_param.grad.shape == block._handle.flat_param.shape


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_unsharded_memory_is_freed(strategy: str) -> None:
    run_on_ranks(_what_is_sharded_when, 2, strategy)


def _several_forwards(use_orig_params: bool, prefetch: bool) -> None:
    """Two forwards then one backward; then a forward that is never backpropagated; then a normal step."""
    config = Config("transformer", "FULL_SHARD", "block", use_orig_params, forward_prefetch=prefetch)
    reference, ours = build_ours(config)
    # (torch 2.11's DDP re-broadcasts buffers in place at every forward, which breaks the first forward's backward)
    ddp = DDP(reference, broadcast_buffers=False)
    x1, x2 = models.Transformer.batch(dist.get_rank()), models.Transformer.batch(7 + dist.get_rank())
    our_opt, ddp_opt = optimizer(ours), optimizer(ddp)
    for model, opt in ((ours, our_opt), (ddp, ddp_opt)):
        (model(x1) + 2 * model(x2)).backward()
        opt.step()
        opt.zero_grad()
        model(x1)  # never backpropagated
        loss_of(model(x2)).backward()
        opt.step()
    assert_same_params(ours, reference)


@parameterized.expand([(False, False), (True, True)])
def test_several_forwards_before_backward(use_orig_params: bool, prefetch: bool) -> None:
    run_on_ranks(_several_forwards, 2, use_orig_params, prefetch)


def _manual_wrap(use_orig_params: bool) -> None:
    torch.manual_seed(0)
    reference = models.Nested()
    torch.manual_seed(0)
    with enable_wrap(wrapper_cls=FSDP, use_orig_params=use_orig_params):
        ours = wrap(models.Nested(wrap=wrap))
    assert isinstance(ours, FSDP)
    assert [type(u.module).__name__ for u in FSDP.fsdp_modules(ours)] == ["Nested", "Linear", "Sequential", "Linear"]
    ddp = DDP(reference)
    our_opt, ddp_opt = optimizer(ours), optimizer(ddp)
    for step in range(3):
        x = models.Nested.batch(step * 10 + dist.get_rank())
        for model, opt in ((ours, our_opt), (ddp, ddp_opt)):
            model(x).backward()
            opt.step()
            opt.zero_grad()
    assert_same_params(ours, reference)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_manual_wrap_matches_ddp(use_orig_params: bool) -> None:
    run_on_ranks(_manual_wrap, 2, use_orig_params)


def _layout_matches_torch(model: str, use_orig_params: bool) -> None:
    config = Config(model, "FULL_SHARD", "block", use_orig_params)
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    for a, b in zip(FSDP.fsdp_modules(ours), torch_fsdp.FullyShardedDataParallel.fsdp_modules(theirs), strict=True):
        ours_flat, theirs_flat = a._flat_param, b._flat_param
        assert list(ours_flat._fqns) == list(theirs_flat._fqns)
        assert list(ours_flat._shapes) == list(theirs_flat._shapes)
        assert list(ours_flat._numels_with_padding) == list(theirs_flat._numels_with_padding)
        assert torch.equal(ours_flat.detach(), theirs_flat.detach()), "the local shard, element for element"
        theirs_shared = [
            (s.param_name, s.module_name, s.prim_param_name, s.prim_module_name)
            for s in theirs_flat._shared_param_infos
        ]
        ours_shared = [
            (s.param_name, s.module_name, s.primary.param_name, s.primary.module_name) for s in a._handle.layout.shared
        ]
        assert ours_shared == theirs_shared
    ours_names = [(n, p.shape) for n, p in ours.named_parameters()]
    theirs_names = [(n, p.shape) for n, p in theirs.named_parameters()]
    assert ours_names == theirs_names


@parameterized.expand([(m, u, w) for m in ("net", "transformer") for u in (False, True) for w in (2, 4)])
def test_layout_matches_torch(model: str, use_orig_params: bool, world_size: int) -> None:
    run_on_ranks(_layout_matches_torch, world_size, model, use_orig_params)


def _originals_released(use_orig_params: bool) -> None:
    torch.manual_seed(0)
    net = models.Net()
    originals = dict(net.named_parameters())
    fsdp = FSDP(net, use_orig_params=use_orig_params)
    handle = fsdp._handle
    shard_bytes = handle.local_shard.untyped_storage().nbytes()
    assert shard_bytes == handle.layout.shard_numel * 4
    for name, param in originals.items():
        if use_orig_params:
            # The original parameter is now a 1-D view into the local shard: no storage of its own.
            assert param.untyped_storage().data_ptr() == handle.local_shard.untyped_storage().data_ptr(), name
        else:
            assert param.untyped_storage().nbytes() == 0, f"{name} still holds its unsharded data"
    assert handle.full_padded.untyped_storage().nbytes() == 0, "no unsharded buffer outside forward"


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_construction_keeps_only_the_shard(use_orig_params: bool) -> None:
    run_on_ranks(_originals_released, 2, use_orig_params)


def _accumulation(strategy: str, use_orig_params: bool) -> None:
    """Two backward passes without zero_grad in between add up, as in DDP (the saved sharded gradient path)."""
    config = Config("net", strategy, "block", use_orig_params)
    reference, ours = build_ours(config)
    ddp = DDP(reference)
    our_opt, ddp_opt = optimizer(ours), optimizer(ddp)
    for step in range(2):
        for model, opt in ((ours, our_opt), (ddp, ddp_opt)):
            for micro in range(2):
                loss_of(model(models.Net.batch(100 * step + 10 * micro + dist.get_rank()))).backward()
            opt.step()
            opt.zero_grad()
    assert_same_params(ours, reference)


@parameterized.expand([(s, u) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD") for u in (False, True)])
def test_gradient_accumulation_without_zero_grad(strategy: str, use_orig_params: bool) -> None:
    run_on_ranks(_accumulation, 2, strategy, use_orig_params)


def _zero_grad_between_forward_and_backward(strategy: str, use_orig_params: bool) -> None:
    """What the optimizer sees follows the user's zero_grad also between forward and backward, and gradients from
    before a no_sync() run are kept, as with DDP."""
    config = Config("net", strategy, "block", use_orig_params)
    reference, ours = build_ours(config)
    ddp = DDP(reference)
    our_opt, ddp_opt = optimizer(ours), optimizer(ddp)
    for model, opt in ((ours, our_opt), (ddp, ddp_opt)):
        data = [models.Net.batch(10 * i + dist.get_rank()) for i in range(6)]
        loss_of(model(data[0])).backward()
        opt.step()  # gradients left in place
        output = model(data[1])
        opt.zero_grad(set_to_none=True)
        loss_of(output).backward()
        opt.step()
        output = model(data[2])
        opt.zero_grad(set_to_none=False)
        loss_of(output).backward()
        opt.step()
        loss_of(model(data[3])).backward()
        with model.no_sync():
            loss_of(model(data[4])).backward()
        loss_of(model(data[5])).backward()
        opt.step()
    assert_same_params(ours, reference)


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head, self.aux = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.head(h).pow(2).sum(), self.aux(h).pow(2).sum()


def _zero_grad_of_a_unit_backward_skips(strategy: str, use_orig_params: bool) -> None:
    """A unit whose forward ran but which backward never reaches keeps the gradient zero_grad left it (none)."""
    import copy

    from fsdp_legacy import ShardingStrategy
    from fsdp_legacy.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    reference = TwoHeads()
    ours = FSDP(
        copy.deepcopy(reference),
        auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=use_orig_params,
    )
    ddp = DDP(reference, find_unused_parameters=True)
    for model in (ours, ddp):
        opt = optimizer(model)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        sum(model(x)).backward()
        opt.step()  # gradients left in place, the aux head's too
        main, _ = model(x)
        opt.zero_grad(set_to_none=True)
        main.backward()  # never reaches the aux head: its parameters must not move in this step
        opt.step()
    assert_same_params(ours, reference)


@parameterized.expand([(s, u) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD") for u in (False, True)])
def test_zero_grad_between_forward_and_backward(strategy: str, use_orig_params: bool) -> None:
    run_on_ranks(_zero_grad_between_forward_and_backward, 2, strategy, use_orig_params)
    run_on_ranks(_zero_grad_of_a_unit_backward_skips, 2, strategy, use_orig_params)
