"""Real QLoRA on fsdp_legacy: bitsandbytes' NF4 `Linear4bit` layers (frozen uint8 `Params4bit` weights carrying their
`quant_state`) with PEFT's LoRA adapters around them, two per block, in FSDP units that mix uint8 and float32
parameters (one flat parameter per dtype). Oracle: DDP over the same quantized PEFT model built again from the same
seed (bf16 mixed precision: the same data parallelism written out by hand). Equal: losses, the adapters after training,
the 4-bit weights (bit for bit, unchanged), the FULL state dict (bitsandbytes' quantization state keys included); the
weights stay `Params4bit` with their `quant_state` in forward, outside it and inside summon_full_params.

Needs bitsandbytes and peft (the `frameworks` extra); CI runs these with `pytest -m frameworks`. Runs on CPU:
bitsandbytes quantizes, dequantizes and multiplies NF4 weights there (its optional `kernels` package missing only
costs speed, and prints a message).
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.distributed as dist
from parameterized import parameterized
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp_legacy
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import StateDictType
from fsdp_legacy.wrap import ModuleWrapPolicy
from fsdp_utils import assert_close, full_params
from harness import run_on_ranks

pytestmark = pytest.mark.frameworks
bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

from bitsandbytes.nn.modules import Params4bit  # noqa: E402

D_IN, WIDTH, STEPS = 16, 32, 4
BF16 = torch.bfloat16


def _linear4bit(d_in: int, d_out: int, bias: bool, compute_dtype: torch.dtype) -> nn.Module:
    """An NF4 layer quantized from a float Linear, as a 4-bit checkpoint is loaded: `.to("cpu")` quantizes, leaving a
    uint8 Params4bit of shape [d_in * d_out / 2, 1] whose quant_state (absmax, nested absmax, code book) dequantizes
    it."""
    dense = nn.Linear(d_in, d_out, bias=bias)
    layer = bnb.nn.Linear4bit(d_in, d_out, bias=bias, compute_dtype=compute_dtype, quant_type="nf4")
    layer.load_state_dict(dense.state_dict())
    # In eval mode under no_grad, on CPUs with AVX512-BF16, Linear4bit repacks its weight in forward: it assigns a
    # new tensor of another shape to `weight.data` and rewrites the quant_state in place. A sharded copy cannot follow
    # that (the next forward pairs the unsharded weight with the rewritten state, silently wrong), on any FSDP.
    layer.support_avx512bf16_for_cpu = False
    return layer.to("cpu")


class Block(nn.Module):
    def __init__(self, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = _linear4bit(WIDTH, 2 * WIDTH, True, compute_dtype)
        self.down = _linear4bit(2 * WIDTH, WIDTH, False, compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """A float32 input projection and head (frozen by PEFT, in the root unit) around two 4-bit blocks."""

    is_loaded_in_4bit = True  # what transformers sets on 4-bit models: PEFT then wraps Linear4bit in lora.Linear4bit

    def __init__(self, compute_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, WIDTH)
        self.blocks = nn.ModuleList(Block(compute_dtype) for _ in range(2))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(seed: int = 0, train_norms: bool = False, compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """The PEFT model: LoRA on every Linear4bit (PEFT freezes everything else). `train_norms` also trains the blocks'
    LayerNorms and the 4-bit layers' biases, so that each block's float32 parameters are all trainable, as
    use_orig_params=False needs (requires_grad uniform per flat parameter, so per dtype)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["up", "down"], bias="lora_only" if train_norms else "none"
    )
    model = peft.get_peft_model(Net(compute_dtype), config)
    if train_norms:
        for block in model.base_model.model.blocks:
            block.norm.requires_grad_(True)
    return model


def _quantized(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def _batch(step: int) -> torch.Tensor:
    return torch.randn(6, D_IN, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    return model(_batch(step)).float().pow(2).mean()


def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for p in params if p.requires_grad], lr=1e-2)


def _global(loss: torch.Tensor) -> float:
    losses = torch.tensor([loss.item()])
    dist.all_reduce(losses)
    return losses.item()


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    loss = _loss(model, step)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return _global(loss)


def _wrap(model: nn.Module, **kwargs) -> FSDP:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)


def _full_state_dict(model: FSDP) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # state_dict_type's deprecation notice
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            return model.state_dict()


def _assert_typed(layers: dict[str, nn.Module], states: dict, where: str) -> None:
    for name, layer in layers.items():
        weight = layer.weight
        assert type(weight) is Params4bit, f"{where}: {name}.weight is a {type(weight).__name__}"
        assert weight.quant_state is states[name], f"{where}: {name}.weight lost its quant_state"


def _record_forward_weights(layers: dict[str, nn.Module], states: dict, shapes: dict) -> list[str]:
    """Names of the layers whose forward found a Params4bit of the packed shape with its own quant_state, checked
    before Linear4bit.forward would recover a lost quant_state from the module (which it does silently)."""
    seen: list[str] = []

    def check(name: str, layer: nn.Module) -> None:
        weight = layer.weight
        if type(weight) is Params4bit and weight.quant_state is states[name] and weight.shape == shapes[name]:
            seen.append(name)

    for name, layer in layers.items():
        layer.register_forward_pre_hook(lambda m, _, name=name: check(name, m))
    return seen


def _trains_like_ddp(strategy: str, use_orig_params: bool, train_norms: bool) -> None:
    if not use_orig_params:  # PEFT's own freezing (frozen norms and biases beside trainable adapters) is refused
        with pytest.raises(ValueError, match="requires_grad=True and False"):
            _wrap(build(), use_orig_params=False)
    reference = build(train_norms=train_norms)
    model = build(train_norms=train_norms)
    layers = _quantized(model)
    states = {name: layer.weight.quant_state for name, layer in layers.items()}
    packed = {name: layer.weight.detach().clone() for name, layer in layers.items()}
    ours = _wrap(model, sharding_strategy=fsdp_legacy.ShardingStrategy[strategy], use_orig_params=use_orig_params)
    blocks = [m for m in ours.modules() if isinstance(m, FSDP) and isinstance(m.module, Block)]
    assert len(blocks) == 2
    for unit in blocks:  # one flat parameter per dtype; the uint8 one frozen
        handles = {h.local_shard.dtype: h for h in unit._handles}
        assert sorted(h.flat_name for h in unit._handles) == ["_flat_param", "_flat_param_1"], unit._handles
        assert set(handles) == {torch.uint8, torch.float32}, set(handles)
        assert not handles[torch.uint8].flat_param.requires_grad
    _assert_typed(layers, states, "outside forward")
    seen = _record_forward_weights(layers, states, {name: w.shape for name, w in packed.items()})

    ddp = DDP(reference)
    our_opt, ref_opt = _adam(ours.parameters()), _adam(ddp.parameters())
    for step in range(STEPS):
        our_loss = _step(ours, our_opt, step)
        ref_loss = _step(ddp, ref_opt, step)
        assert abs(our_loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (step, our_loss, ref_loss)
    assert sorted(seen) == sorted(list(layers) * STEPS), seen
    _assert_typed(layers, states, "after training")
    for unit in blocks:  # the 4-bit weights never get a gradient
        for handle in unit._handles:
            if handle.local_shard.dtype == torch.uint8:
                assert handle.flat_param.grad is None and handle.local_sharded_grad() is None

    full = full_params(ours)
    for name, param in reference.named_parameters():
        if param.requires_grad:
            assert_close(full[name], param.detach(), name, atol=1e-6, rtol=1e-5)
        else:  # the 4-bit weights and the frozen float ones: bit for bit
            assert torch.equal(full[name], param.detach()), name
    for name, weight in packed.items():  # as quantized
        assert torch.equal(full[name + ".weight"], weight), name

    with FSDP.summon_full_params(ours):
        _assert_typed(layers, states, "inside summon_full_params")
        for name, layer in layers.items():
            assert torch.equal(layer.weight.detach(), packed[name]), name
    _assert_typed(layers, states, "after summon_full_params")

    # Inference: eval mode, no_grad.
    ours.eval()
    reference.eval()
    with torch.no_grad():
        for step in range(2):
            assert_close(ours(_batch(10 + step)), reference(_batch(10 + step)), "eval", atol=1e-6, rtol=1e-5)
    ours.train()
    reference.train()

    # FULL state dict: DDP's keys (with each 4-bit layer's absmax, quant_map, nested_* and packed quant_state) and
    # values. (Key order with use_orig_params=False and the values' classes: see the tests below.)
    state = _full_state_dict(ours)
    expected = ddp.module.state_dict()
    assert sorted(state) == sorted(expected), sorted(set(state) ^ set(expected))
    assert sum(key.endswith(".weight.quant_state.bitsandbytes__nf4") for key in state) == len(layers)
    trainable = {name for name, p in reference.named_parameters() if p.requires_grad}
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and state[key].shape == value.shape, key
        if key in trainable:
            assert_close(state[key], value, key, atol=1e-6, rtol=1e-5)
        else:
            assert torch.equal(state[key], value), key
    _assert_typed(layers, states, "after state_dict")


@parameterized.expand(
    [
        ("FULL_SHARD", True, False, 2),
        ("SHARD_GRAD_OP", True, False, 2),
        ("NO_SHARD", True, False, 2),
        ("FULL_SHARD", False, True, 2),
        ("SHARD_GRAD_OP", False, True, 2),
        ("FULL_SHARD", True, False, 4),
        ("FULL_SHARD", False, True, 4),
    ]
)
def test_qlora_trains_like_ddp(strategy: str, use_orig_params: bool, train_norms: bool, world_size: int) -> None:
    """LoRA on NF4 Linear4bit layers under FSDP: DDP's losses, adapters and eval outputs; the 4-bit weights unchanged
    bit for bit, without gradients, and Params4bit with their quant_state in forward, outside it and inside
    summon_full_params; the FULL state dict holds DDP's keys and values, bitsandbytes' quantization state included.
    use_orig_params=False trains the norms and biases too (PEFT's freezing alone is refused, with the reason)."""
    run_on_ranks(_trains_like_ddp, world_size, strategy, use_orig_params, train_norms)


def _mixed_precision_like_by_hand(use_orig_params: bool, train_norms: bool) -> None:
    """MixedPrecision(param_dtype=bf16, reduce_dtype=fp32), 4-bit layers computing in bf16, against the same data
    parallelism by hand: a bf16 copy of the fp32 master model computes each step's gradients, which are cast to fp32,
    averaged over the ranks and stepped on by Adam on the master. (DDP's own mixed precision would cast the uint8
    weights too.)"""
    policy = fsdp_legacy.MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
    model = build(train_norms=train_norms, compute_dtype=BF16)
    layers = _quantized(model)
    states = {name: layer.weight.quant_state for name, layer in layers.items()}
    seen = _record_forward_weights(layers, states, {name: layer.weight.shape for name, layer in layers.items()})
    ours = _wrap(model, use_orig_params=use_orig_params, mixed_precision=policy)
    for unit in ours.modules():
        for handle in unit._handles if isinstance(unit, FSDP) else ():
            expected = torch.uint8 if handle.local_shard.dtype == torch.uint8 else BF16
            assert handle.compute_dtype == expected, (handle.flat_name, handle.compute_dtype)  # uint8 never cast

    master = build(train_norms=train_norms, compute_dtype=BF16)
    compute = build(train_norms=train_norms, compute_dtype=BF16)
    pairs = [(m, c) for m, c in zip(master.parameters(), compute.parameters(), strict=True) if m.is_floating_point()]
    for _, low in pairs:
        low.data = low.data.to(BF16)
    our_opt, ref_opt = _adam(ours.parameters()), _adam(master.parameters())
    world = dist.get_world_size()
    for step in range(STEPS):
        our_loss = _step(ours, our_opt, step)
        with torch.no_grad():
            for high, low in pairs:
                low.copy_(high)
        loss = compute(_batch(step).to(BF16)).float().pow(2).mean()
        loss.backward()
        for high, low in pairs:
            if high.requires_grad:
                grad = low.grad.float()
                dist.all_reduce(grad)
                high.grad, low.grad = grad / world, None
        ref_opt.step()
        ref_opt.zero_grad()
        ref_loss = _global(loss)
        assert abs(our_loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (step, our_loss, ref_loss)
    assert sorted(seen) == sorted(list(layers) * STEPS), seen
    full = full_params(ours)
    for name, param in master.named_parameters():
        assert param.dtype == full[name].dtype, name  # fp32 masters, uint8 weights
        if param.requires_grad:
            assert_close(full[name], param.detach(), name, atol=1e-6, rtol=1e-5)
        else:
            assert torch.equal(full[name], param.detach()), name


@parameterized.expand([("uop", True, False), ("flat", False, True)])
def test_qlora_bf16_mixed_precision(_: str, use_orig_params: bool, train_norms: bool) -> None:
    """bf16 MixedPrecision over NF4 layers computing in bf16: casts the float parameters only (the uint8 weights keep
    their dtype and class), and trains like the same bf16-compute, fp32-master data parallelism written out."""
    run_on_ranks(_mixed_precision_like_by_hand, 2, use_orig_params, train_norms)


def _full_state_dict_key_order(use_orig_params: bool) -> None:
    reference = build(train_norms=True)
    state = _full_state_dict(_wrap(build(train_norms=True), use_orig_params=use_orig_params))
    assert list(state) == list(reference.state_dict()), (list(state), list(reference.state_dict()))


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_full_state_dict_keeps_the_module_key_order(use_orig_params: bool) -> None:
    """The FULL state dict lists its keys as the plain model's state_dict does."""
    run_on_ranks(_full_state_dict_key_order, 2, use_orig_params)


def _full_state_dict_loads_weights_only() -> None:
    reference = build()
    state = _full_state_dict(_wrap(build(), use_orig_params=True))
    for source in (reference.state_dict(), state):  # what Accelerate's save_fsdp_model / load_fsdp_model do
        buffer = io.BytesIO()
        torch.save(source, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        assert all(torch.equal(loaded[key], value) for key, value in reference.state_dict().items())


def test_full_state_dict_loads_with_weights_only() -> None:
    """A FULL state dict saved with torch.save loads with torch.load(weights_only=True), torch's default and what
    Accelerate's FSDP checkpoint loading uses, as the plain model's does."""
    run_on_ranks(_full_state_dict_loads_weights_only, 2)
