"""torch FSDP1's FlatParameter attributes, which research trainers' checkpointers and torch's own tests read
(`_shard_param_infos` to copy a full tensor into the local shard, `_fqns` / `_shapes` compared with a saved list,
`_params` walked for the original parameters, ...): on ours, the same names with torch's types and values for the
same model, across strategies, use_orig_params, mixed precision, offload, ignored and shared parameters, 1/2/4 ranks,
before and after forward and backward. torch's FSDP1 is the oracle, built side by side on the same ranks."""

import functools
import warnings
from typing import Any

import torch
from parameterized import parameterized
from torch import nn

from fsdp_legacy import FullyShardedDataParallel as FSDP
from harness import run_on_ranks

# Every metadata and runtime attribute torch's FSDP1 sets on a FlatParameter (but the hook state: autograd objects).
ATTRIBUTES = (
    "_unpadded_unsharded_size _padded_unsharded_size _sharded_size _num_params _param_infos _shapes _strides "
    "_contiguities _fqns _param_extensions _numels_with_padding _numels _shard_param_infos _shared_param_infos "
    "_modules _shard_numel_padded _is_padding_mask _params _shared_params _tensors _is_grad_none_mask _local_shard "
    "_full_param_padded _mp_shard _cpu_grad _saved_grad_shard _full_prec_full_param_padded"
).split()


class Net(nn.Module):
    """An embedding, a nested block, a module to ignore, a parameter on the wrapped module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.block = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 4, bias=False))
        self.side = nn.Linear(4, 4)  # ignored in the "ignored" case
        self.mix = nn.Parameter(torch.randn(4, 3))
        self.head = nn.Linear(3, 6, bias=False)
        self.head.weight = nn.Parameter(self.emb.weight[:, :3].detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.side(self.block(self.emb(x)))
        return self.head(h @ self.mix)


class Tied(Net):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.out(self.block(self.emb(x)))


def _describe(value: Any, names: dict[int, str]) -> Any:
    """A comparable picture of an attribute: types kept, modules by name, tensors by type, dtype, shape, whether their
    storage is allocated, and their values where it is."""
    if isinstance(value, torch.Tensor):
        allocated = value.untyped_storage().size() > 0 if value.numel() else None  # (no elements: nothing to read)
        data = value.detach().tolist() if allocated and value.dtype.is_floating_point else None
        return (type(value).__name__, value.dtype, tuple(value.shape), allocated, data)
    if isinstance(value, nn.Module):
        return ("module", names.get(id(value), "?"))
    if isinstance(value, set):
        return ("set", sorted(map(str, (_describe(v, names) for v in value))))
    if isinstance(value, (list, tuple)):  # named tuples too
        return (type(value).__name__, [_describe(v, names) for v in value])
    return (type(value).__name__, value)


def _attributes(ours: bool, config: str, strategy: str, use_orig_params: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    torch.manual_seed(0)
    model = Tied() if config == "tied" else Net()
    names = {id(module): name for name, module in model.named_modules()}
    kwargs: dict[str, Any] = dict(
        use_orig_params=use_orig_params, sharding_strategy=getattr(ShardingStrategy, strategy)
    )
    if config == "bf16":
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    wrapper = FSDP if ours else functools.partial(TorchFSDP, device_id=torch.device("cpu"))
    model.block = wrapper(model.block, **kwargs)
    fsdp = wrapper(model, ignored_modules=[model.side] if config == "ignored" else None, **kwargs)
    seen: dict[str, Any] = {}

    def record(phase: str) -> None:
        for index, unit in enumerate(m for m in fsdp.modules() if isinstance(m, (FSDP, TorchFSDP))):
            flat = unit._handle.flat_param
            for name in ATTRIBUTES:
                value = _describe(getattr(flat, name), names) if hasattr(flat, name) else "absent"
                if name == "_tensors" and value[0] == "list":  # torch keeps views of freed storage, ours drops them
                    value = (
                        "list",
                        [("NoneType", None) if v[0] == "Tensor" and v[3] is False else v for v in value[1]],
                    )
                seen[f"{phase} unit {index} {name}"] = value

    record("constructed")
    loss = fsdp(torch.tensor([[1, 2, 3, 4]])).float().sum()
    record("forward")
    loss.backward()
    record("backward")
    return seen


# Every strategy where the attributes depend on it (plain, and bf16's low-precision buffers); one sharded strategy for
# the layout cases (tied and ignored parameters, 1 and 4 ranks), whose attributes do not depend on which.
CASES = [
    (config, strategy, uop, world_size)
    for config, world_size, strategies in (
        ("plain", 2, ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")),
        ("bf16", 2, ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")),
        ("tied", 2, ("FULL_SHARD",)),
        ("ignored", 2, ("SHARD_GRAD_OP",)),
        ("plain", 1, ("FULL_SHARD",)),
        ("plain", 4, ("FULL_SHARD",)),
    )
    for strategy in strategies
    for uop in (False, True)
]


@parameterized.expand(CASES)
def test_flat_parameter_attributes_equal_torchs(config: str, strategy: str, uop: bool, world_size: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = run_on_ranks(_attributes, world_size, False, config, strategy, uop)
        ours = run_on_ranks(_attributes, world_size, True, config, strategy, uop)
    for rank, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
        # (where torch has not set an attribute yet, before its lazy initialisation, ours may have it already)
        differ = [
            f"{key}:\n  ours  {mine.get(key)}\n  torch {value}"
            for key, value in torchs.items()
            if value != "absent" and mine.get(key) != value
        ]
        assert not differ, f"rank {rank}: " + "\n".join(differ[:6])


def _offloaded(use_orig_params: bool) -> list[bool]:
    """CPU offload, which torch's FSDP1 refuses on a CPU-only machine: `_cpu_grad` is the sharded gradient after
    backward (what the flat parameter's or the original parameters' `.grad` hold), zeros before it."""
    from fsdp_legacy import CPUOffload

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    fsdp = FSDP(model, cpu_offload=CPUOffload(offload_params=True), use_orig_params=use_orig_params)
    flat = fsdp._handle.flat_param
    checks = [torch.equal(flat._cpu_grad, torch.zeros(flat._sharded_size))]
    fsdp(torch.randn(2, 4)).sum().backward()
    if use_orig_params:
        expected = torch.zeros(flat._sharded_size)
        for param, info in zip(flat._params, flat._shard_param_infos, strict=True):
            if info.in_shard:
                expected[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard] = param.grad
    else:
        expected = flat.grad
    checks.append(flat._cpu_grad.device.type == "cpu" and torch.equal(flat._cpu_grad, expected))
    checks.append(not hasattr(flat, "_full_prec_full_param_padded") and not hasattr(flat, "_mp_shard"))
    return checks


@parameterized.expand([(False,), (True,)])
def test_cpu_grad_is_the_offloaded_sharded_gradient(use_orig_params: bool) -> None:
    assert run_on_ranks(_offloaded, 2, use_orig_params) == [[True, True, True]] * 2


def _non_contiguous() -> list[Any]:
    """A parameter that is a transpose: both hold it in memory order and report its strides, so that torch's recipe
    (`param.as_strided((numel,), (1,))[start : end + 1]` for a non-contiguous parameter) is the piece in each, and
    both give the parameter's values back."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    results = []
    for wrapper in (FSDP, functools.partial(TorchFSDP, device_id=torch.device("cpu"))):
        torch.manual_seed(0)
        model = nn.Module()
        model.weight = nn.Parameter(torch.randn(3, 4).t())
        original = model.weight.detach().clone()
        fsdp = wrapper(model)
        flat = fsdp._handle.flat_param
        info = flat._shard_param_infos[0]
        recipe = (original.flatten() if flat._contiguities[0] else original.as_strided((original.numel(),), (1,)))[
            info.intra_param_start_idx : info.intra_param_end_idx + 1
        ]
        with type(fsdp).summon_full_params(fsdp):
            back = torch.equal(model.weight, original)
        results.append((flat._contiguities[0], torch.equal(flat[: info.numel_in_shard], recipe), back))
    return results


def test_a_non_contiguous_parameter_is_laid_out_as_reported() -> None:
    for ours, theirs in run_on_ranks(_non_contiguous, 2):
        assert ours == theirs == (False, True, True)
