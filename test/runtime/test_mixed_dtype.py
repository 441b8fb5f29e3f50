"""Units whose parameters differ in dtype (issue 13): frozen packed uint8 weights, their scales and trainable adapters
in one unit, one flat parameter per dtype. Oracles: DDP over a plain copy (training, gradients, clipping, no_sync,
state dicts), torch's FSDP1 holding the packed weights as buffers (mixed precision), and the analytic byte count.
"""

import copy
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from parameterized import parameterized
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fsdp_legacy
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_legacy import StateDictType
from fsdp_legacy.convert.record import records_in_metadata
from fsdp_legacy.wrap import ModuleWrapPolicy
from fsdp_utils import assert_close, clean, full_params
from harness import run_on_ranks
from mixed_dtype_models import PackedWeight, QLoRABlock, QLoRANet

# uop=False needs requires_grad uniform within each dtype: bf16 frozen scales, fp32 trainable adapters and norms.
BF16_SCALES = {"scale_dtype": torch.bfloat16}


def _build(model_kwargs: dict, seed: int = 0, **fsdp_kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = QLoRANet(**model_kwargs)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({QLoRABlock}), **fsdp_kwargs)
    return reference, ours


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, clip: float | None = None) -> tuple[float, float]:
    loss = model(QLoRANet.batch(100 * step + dist.get_rank())).pow(2).mean()
    loss.backward()
    norm = float("nan")
    if clip is not None:
        if isinstance(model, FSDP):
            norm = float(model.clip_grad_norm_(clip))
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
    opt.step()
    opt.zero_grad()
    losses = torch.tensor([loss.item()])
    dist.all_reduce(losses)
    return losses.item(), norm


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _assert_matches(ours: nn.Module, reference: nn.Module, what: str) -> None:
    full = full_params(ours)
    for name, param in reference.named_parameters():
        if param.dtype == torch.uint8 or not param.requires_grad:  # frozen: bit for bit
            assert torch.equal(full[name], param.detach()), f"{what}: frozen {name} changed"
        else:
            assert_close(full[name], param.detach(), f"{what}: {name}", atol=1e-5, rtol=1e-4)


def _trains_like_ddp(strategy: str, use_orig_params: bool, extra: dict, model_kwargs: dict) -> None:
    if "HYBRID" in strategy:  # 4 ranks: sharded across pairs, replicated across the two pairs
        from torch.distributed.device_mesh import init_device_mesh

        extra = dict(extra, device_mesh=init_device_mesh("cpu", (2, 2)))
    reference, ours = _build(
        model_kwargs,
        sharding_strategy=fsdp_legacy.ShardingStrategy[strategy],
        use_orig_params=use_orig_params,
        **extra,
    )
    block = ours.blocks[0]
    names = [h.flat_name for h in block._handles]
    dtypes = [h.local_shard.dtype for h in block._handles]
    scale_dtype = model_kwargs.get("scale_dtype", torch.float32)
    expected = [torch.uint8, scale_dtype] + ([torch.float32] if scale_dtype != torch.float32 else [])
    assert dtypes == expected and names == ["_flat_param", "_flat_param_1", "_flat_param_2"][: len(dtypes)], (
        names,
        dtypes,
    )
    assert block._handle is block._handles[0]
    assert not block._handles[0].flat_param.requires_grad
    ddp = DDP(reference)
    our_opt, ref_opt = _adam(ours), _adam(ddp)
    for step in range(3):
        our_loss, our_norm = _step(ours, our_opt, step, clip=0.5)
        ref_loss, ref_norm = _step(ddp, ref_opt, step, clip=0.5)
        assert abs(our_loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (step, our_loss, ref_loss)
        assert abs(our_norm - ref_norm) <= 1e-5 * max(1.0, ref_norm), (step, our_norm, ref_norm)
    _assert_matches(ours, reference, f"{strategy} uop={use_orig_params}")
    for handle in block._handles:  # integer and frozen groups never get a gradient
        if not handle.flat_param.requires_grad:
            assert handle.flat_param.grad is None and handle.local_sharded_grad() is None


@parameterized.expand(
    [
        ("FULL_SHARD", False, {}, BF16_SCALES, 2),
        ("SHARD_GRAD_OP", False, {}, BF16_SCALES, 2),
        ("NO_SHARD", False, {}, BF16_SCALES, 2),
        ("FULL_SHARD", True, {}, {}, 2),
        ("SHARD_GRAD_OP", True, {}, {}, 2),
        ("FULL_SHARD", True, {"cpu_offload": fsdp_legacy.CPUOffload(offload_params=True)}, {}, 2),
        ("FULL_SHARD", False, {"cpu_offload": fsdp_legacy.CPUOffload(offload_params=True)}, BF16_SCALES, 2),
        ("FULL_SHARD", True, {}, {}, 4),
        ("FULL_SHARD", False, {}, BF16_SCALES, 4),
        ("FULL_SHARD", True, {}, {}, 1),
        ("HYBRID_SHARD", True, {}, {}, 4),
        ("_HYBRID_SHARD_ZERO2", False, {}, BF16_SCALES, 4),
    ]
)
def test_trains_like_ddp(strategy: str, use_orig_params: bool, extra: dict, model_kwargs: dict, world_size: int):
    """Same losses, gradient norms (clipped over the trainable parameters) and adapters as DDP; the packed weights
    and scales bit-identical after training; one flat parameter per dtype, integer ones without gradients."""
    run_on_ranks(_trains_like_ddp, world_size, strategy, use_orig_params, extra, model_kwargs)


def _mixed_precision_like_torch(strategy: str) -> None:
    import torch.distributed.fsdp as tfsdp

    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    _, ours = _build(
        {},
        sharding_strategy=fsdp_legacy.ShardingStrategy[strategy],
        use_orig_params=True,
        mixed_precision=fsdp_legacy.MixedPrecision(**policy),
    )
    uint8 = ours.blocks[0]._handles[0]
    assert uint8.compute_dtype == torch.uint8 and uint8.full_padded.dtype == torch.uint8  # never cast
    torch.manual_seed(0)
    theirs_model = QLoRANet(weight_as_buffer=True)  # same draws: the packed weights become buffers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = tfsdp.FullyShardedDataParallel(
            theirs_model,
            auto_wrap_policy=tfsdp.wrap.ModuleWrapPolicy({QLoRABlock}),
            sharding_strategy=tfsdp.ShardingStrategy[strategy],
            use_orig_params=True,
            mixed_precision=tfsdp.MixedPrecision(**policy),
            device_id=torch.device("cpu"),
        )
    our_opt, their_opt = _adam(ours), _adam(theirs)
    for step in range(3):
        our_loss, _ = _step(ours, our_opt, step)
        their_loss, _ = _step(theirs, their_opt, step)
        assert our_loss == their_loss, (step, our_loss, their_loss)
    with FSDP.summon_full_params(ours), tfsdp.FullyShardedDataParallel.summon_full_params(theirs):
        mine = {clean(n): p.detach().clone() for n, p in ours.named_parameters()}
        for name, param in theirs.named_parameters():
            assert torch.equal(mine[clean(name)], param.detach()), name


@parameterized.expand([("FULL_SHARD",), ("SHARD_GRAD_OP",)])
def test_mixed_precision_casts_floating_point_only(strategy: str) -> None:
    """param_dtype=bf16 casts scales and adapters, never the uint8 weights: the same losses and parameters as torch's
    FSDP1 (bit for bit) on the same layers holding their packed weights as buffers."""
    run_on_ranks(_mixed_precision_like_torch, 2, strategy)


def _subclass_and_state_dicts(use_orig_params: bool) -> None:
    kwargs = {} if use_orig_params else BF16_SCALES
    reference, ours = _build(kwargs, use_orig_params=use_orig_params)
    DDP(reference)  # (the same broadcast of initial states as in training)
    expected = reference.state_dict()
    weight = ours.blocks[0].proj.weight  # outside forward: the placeholder or the sharded parameter
    assert isinstance(weight, PackedWeight) and weight.quant_state == reference.blocks[0].proj.weight.quant_state
    with FSDP.summon_full_params(ours, writeback=True):
        weight = ours.blocks[0].proj.weight
        assert isinstance(weight, PackedWeight) and weight.quant_state == reference.blocks[0].proj.weight.quant_state
        assert torch.equal(weight.detach(), reference.blocks[0].proj.weight.detach())
        ours.head.lora_b.data.add_(1.0)
    reference.head.lora_b.data.add_(1.0)
    # FULL: every value equals the plain model's; the packed weights keep their class and quantization state.
    with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT):
        full = ours.state_dict()
    assert list(full) == list(reference.state_dict()), (list(full), list(reference.state_dict()))
    expected = reference.state_dict()
    for key, value in expected.items():
        assert torch.equal(full[key], value) and full[key].dtype == value.dtype, key
    # As nn.Module saves them (the parameter's detach(): a plain tensor), so torch.load(weights_only=True) reads them.
    assert all(type(full[key]) is type(value) for key, value in expected.items())
    # Hugging Face safetensors, streamed out and back in: the uint8 weights as U8, exactly.
    from safetensors.torch import load_file

    from fsdp_legacy.checkpoint import load_full_model, save_full_model

    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    save_full_model(ours, directory[0])
    if dist.get_rank() == 0:
        stored = load_file(os.path.join(directory[0], "model.safetensors"))
        assert stored.keys() == expected.keys()
        assert all(torch.equal(stored[k], v) and stored[k].dtype == v.dtype for k, v in expected.items())
    _, fresh = _build(kwargs, seed=2, use_orig_params=use_orig_params)
    load_full_model(fresh, directory[0])
    with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
        assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    # SHARDED and LOCAL round trips through DCP, into a model whose every parameter differs.
    for kind in (StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT):
        with FSDP.state_dict_type(ours, kind):
            saved = ours.state_dict()
        if kind == StateDictType.LOCAL_STATE_DICT:
            names = [h.flat_name for h in ours.blocks[0]._handles]
            assert names[:2] == ["_flat_param", "_flat_param_1"], names
            assert all(f"blocks.0.{n}" in saved and f"blocks.0.{n}_meta" not in saved for n in names), list(saved)
            records = records_in_metadata(saved._metadata, "saved")  # outside the keys, one per flat parameter
            assert {r.flat_key for r in records} >= {f"blocks.0.{n}" for n in names}
        directory = tempfile.mkdtemp() if dist.get_rank() == 0 else None
        shared = [directory]
        dist.broadcast_object_list(shared)
        _, other = _build(kwargs, seed=1, use_orig_params=use_orig_params)
        with FSDP.state_dict_type(other, kind):
            if kind == StateDictType.SHARDED_STATE_DICT:  # through DCP
                dcp.save({"model": saved}, checkpoint_id=shared[0])
                target = {"model": other.state_dict()}
                dcp.load(target, checkpoint_id=shared[0])
                other.load_state_dict(target["model"])
            else:  # per-rank files, as LOCAL checkpoints are kept (use_orig_params' views differ in size by rank)
                torch.save(saved, os.path.join(shared[0], f"rank{dist.get_rank()}.pt"))
                other.load_state_dict(saved)
        with FSDP.state_dict_type(other, StateDictType.FULL_STATE_DICT):
            loaded = other.state_dict()
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), f"{kind.name}: {key}"
        if kind == StateDictType.LOCAL_STATE_DICT and dist.get_rank() == 0:
            _converts_offline(shared[0], expected)
        dist.barrier()


def _converts_offline(local_dir: str, expected: dict[str, torch.Tensor]) -> None:
    """A LOCAL checkpoint of mixed-dtype units converts to FSDP2's layout and to a full file, integers exact."""
    from fsdp_legacy.convert import convert_checkpoint

    with tempfile.TemporaryDirectory() as out:
        convert_checkpoint(local_dir, os.path.join(out, "fsdp2"), to="dcp")
        convert_checkpoint(os.path.join(out, "fsdp2"), os.path.join(out, "full.pt"), to="full")
        full = torch.load(os.path.join(out, "full.pt"), weights_only=True)["model"]
        for key, value in expected.items():
            assert torch.equal(full[key], value) and full[key].dtype == value.dtype, key
        convert_checkpoint(
            os.path.join(out, "full.pt"), os.path.join(out, "local4"), to="local", world_size=4, layout_from=local_dir
        )


@parameterized.expand([("uop", True), ("flat", False)])
def test_subclass_identity_and_state_dicts(_: str, use_orig_params: bool) -> None:
    """The packed weights are PackedWeight with their quant_state outside forward and inside summon_full_params;
    FULL, SHARDED and LOCAL state dicts equal the plain model's (values of the types it saves) and load back exactly;
    the LOCAL
    checkpoint converts offline to FSDP2's layout, a full file and back."""
    run_on_ranks(_subclass_and_state_dicts, 2, use_orig_params)


def _no_sync_like_ddp() -> None:
    reference, ours = _build({}, use_orig_params=True)
    ddp = DDP(reference)
    our_opt, ref_opt = _adam(ours), _adam(ddp)
    for model, opt in ((ours, our_opt), (ddp, ref_opt)):
        with model.no_sync():
            model(QLoRANet.batch(7 + dist.get_rank())).pow(2).mean().backward()
        model(QLoRANet.batch(9 + dist.get_rank())).pow(2).mean().backward()
        opt.step()
    _assert_matches(ours, reference, "no_sync")


def test_no_sync_like_ddp() -> None:
    run_on_ranks(_no_sync_like_ddp, 2)


def _memory_is_real_bytes(strategy: str) -> None:
    _, ours = _build({}, sharding_strategy=fsdp_legacy.ShardingStrategy[strategy], use_orig_params=True)
    world, sharded = dist.get_world_size(), strategy != "NO_SHARD"
    for unit in (ours, ours.blocks[0], ours.blocks[1]):
        uint8 = unit._handles[0]
        assert uint8.local_shard.dtype == uint8.full_padded.dtype == torch.uint8
        for info in uint8.layout.params:  # two 4-bit codes per byte
            rows, cols = info.module.weight.quant_state.shape
            assert info.param_name == "weight" and info.numel == rows * cols // 2
        for handle in unit._handles:
            itemsize = handle.local_shard.element_size()
            count = len(handle.layout.params)
            real = sum(info.numel for info in handle.layout.params) * itemsize
            unsharded = handle.layout.padded_numel * handle.full_padded.element_size()
            # at most 16 bytes of alignment before each parameter, and less than one element per rank at the end
            assert real <= unsharded < real + 16 * count + world * itemsize, (handle.flat_name, real, unsharded)
            shard = handle.local_shard.numel() * itemsize
            assert shard == (unsharded // world if sharded else handle.layout.numel * itemsize), (shard, unsharded)
    if sharded:  # the packed weights are unsharded for their unit's backward only, not until the end of backward
        seen = []
        later, earlier = ours.blocks[1], ours.blocks[0]
        earlier._handles[1].flat_param.register_post_accumulate_grad_hook(
            lambda _: seen.append((later._handles[0].is_unsharded, earlier._handles[0].is_unsharded))
        )
        ours(QLoRANet.batch(0)).sum().backward()
        assert seen == [(False, True)], seen  # block 1's backward is over, block 0's is on
        assert not any(h.is_unsharded for unit in (ours, earlier, later) for h in unit._handles)


@parameterized.expand([("FULL_SHARD",), ("NO_SHARD",)])
def test_integer_weights_cost_their_own_bytes(strategy: str) -> None:
    run_on_ranks(_memory_is_real_bytes, 2, strategy)


def _uniform_requires_grad_per_dtype() -> None:
    with pytest.raises(ValueError, match="requires_grad=True and False"):
        _build({}, use_orig_params=False)  # fp32 frozen scales beside fp32 trainable adapters


def test_flat_units_need_uniform_requires_grad_per_dtype() -> None:
    run_on_ranks(_uniform_requires_grad_per_dtype, 2)


def _wrapper_subclass_refused() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(TwoTensor(torch.randn(4, 4), torch.randn(4, 4)), requires_grad=False)
    with pytest.raises(ValueError, match="'weight' of Linear holds a TwoTensor, a tensor subclass with its own inner"):
        FSDP(model)


def test_wrapper_tensor_subclasses_are_refused_with_the_fix() -> None:
    """A parameter whose data is a wrapper tensor subclass (inner tensors, as torchao's NF4Tensor) cannot be flattened
    byte for byte: every rank gets a ValueError naming it and what to do instead."""
    run_on_ranks(_wrapper_subclass_refused, 2)


WIDE = 256  # large enough that parameters, not bookkeeping, make the peaks


def _qlora_loss(model: nn.Module, step: int) -> torch.Tensor:
    return model(QLoRANet.batch(step, WIDE)).pow(2).mean()


def _qlora_adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for p in params if p.requires_grad], lr=1e-3)


def _measure_qlora(use_orig_params: bool):
    from fsdp_legacy.memory import profile_training

    torch.manual_seed(0)
    kwargs = dict(auto_wrap_policy=ModuleWrapPolicy({QLoRABlock}), use_orig_params=use_orig_params)
    return profile_training(QLoRANet(WIDE, **BF16_SCALES), _qlora_loss, kwargs, _qlora_adam)


@parameterized.expand([("uop", True), ("flat", False)])
def test_estimator_predicts_mixed_dtype_units(_: str, use_orig_params: bool) -> None:
    """estimate_memory on fake tensors predicts each phase's peak of a QLoRA-style model within 10% of the peak
    measured on 2 ranks (the uint8 weights counted at one byte per element)."""
    from fsdp_legacy.memory import Phase, estimate_memory

    measured = run_on_ranks(_measure_qlora, 2, use_orig_params)
    kwargs = dict(auto_wrap_policy=ModuleWrapPolicy({QLoRABlock}), use_orig_params=use_orig_params)
    predicted = estimate_memory(lambda: QLoRANet(WIDE, **BF16_SCALES), _qlora_loss, 2, kwargs, _qlora_adam)
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, None):
        for rank, profile in enumerate(measured):
            real, guess = profile.peak(phase), predicted.peak(phase)
            assert abs(guess - real) <= 0.10 * real, f"{phase} rank {rank}: predicted {guess}, measured {real}"
