"""What the runtime fuzzer (test_fuzz_runtime.py) found, each reduced to a small program run side by side with torch's
FSDP1 (the oracle), compared bit for bit:

- A state dict saved, or loaded, before the first forward: torch's FSDP1 lazily initialises there, which casts the
  buffers to MixedPrecision.buffer_dtype, so the saved buffers hold values rounded through that dtype (ours saved the
  untouched values: seed 8 of the first campaign).
- NO_SHARD with keep_low_precision_grads and a reduce_dtype other than the compute dtype: torch's gradient stays in
  the reduce dtype it was all-reduced in (as its docs say: "the dtype used for gradient reduction"); ours cast it to
  the compute dtype (seed 5)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from parameterized import parameterized
from torch import nn

from runtime_fuzz import Linear, first_difference
from torch_side_by_side import _FSDP, _run_both, _run_ours


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("shift", torch.randn(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.shift.to(x.dtype)


def _assert_same_as_torch(check: Any, *args: Any) -> list[Any]:
    results = _run_both(check, *args)
    for rank, result in enumerate(results):
        found = first_difference(result["ours"], result["torch"], f"rank {rank}")
        assert found is None, found
    return [result["torch"] for result in results]


def _saved_before_forward(kind: str) -> dict[str, Any]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    policy = fsdp.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = _FSDP(_WithBuffer(), mixed_precision=policy)
    seen: dict[str, Any] = {"buffer dtype": str(model.shift.dtype)}
    state_dict_type = getattr(fsdp.StateDictType, f"{kind}_STATE_DICT")
    with fsdp.FullyShardedDataParallel.state_dict_type(model, state_dict_type):
        saved = model.state_dict()
    seen["saved"] = {k: v for k, v in saved.items() if k == "shift"}
    seen["buffer dtype after saving"] = str(model.shift.dtype)
    fresh = _FSDP(_WithBuffer(), mixed_precision=policy)
    with fsdp.FullyShardedDataParallel.state_dict_type(fresh, state_dict_type):
        fresh.load_state_dict({**saved, "shift": torch.full((3,), 1 / 3, dtype=torch.float64)})
    seen["loaded buffer"] = fresh.shift.clone()
    return seen


@parameterized.expand([("FULL",), ("SHARDED",)])
def test_a_dict_saved_before_forward_holds_buffers_cast_as_torch(kind: str) -> None:
    for observed in _assert_same_as_torch(_saved_before_forward, kind):
        assert observed["buffer dtype after saving"] == "torch.bfloat16", observed
        saved = observed["saved"]["shift"]
        assert saved.dtype == torch.float64 and torch.equal(saved, saved.to(torch.bfloat16).double()), observed
        assert observed["loaded buffer"].dtype == torch.bfloat16, observed


def _no_shard_low_precision_grads(use_orig_params: bool, param_dtype: str | None, reduce_dtype: str) -> list[Any]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    policy = fsdp.MixedPrecision(
        param_dtype=getattr(torch, param_dtype) if param_dtype else None,
        reduce_dtype=getattr(torch, reduce_dtype),
        keep_low_precision_grads=True,
    )
    model = _FSDP(
        nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2)),
        sharding_strategy=fsdp.ShardingStrategy.NO_SHARD,
        mixed_precision=policy,
        use_orig_params=use_orig_params,
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for step in range(3):
        for _ in range(2):  # the second backward accumulates into the kept low-precision gradient
            x = torch.randn(4, 3) + torch.distributed.get_rank() + step
            model(x).float().pow(2).sum().backward()
            seen.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)  # kept zeroed gradients too
        seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return seen


@parameterized.expand(
    [(uop, param, reduce) for uop in (False, True) for param, reduce in ((None, "bfloat16"), ("bfloat16", "float32"))]
)
def test_no_shard_keeps_low_precision_grads_in_the_reduce_dtype_as_torch(
    use_orig_params: bool, param_dtype: str | None, reduce_dtype: str
) -> None:
    for observed in _assert_same_as_torch(_no_shard_low_precision_grads, use_orig_params, param_dtype, reduce_dtype):
        assert all(g.dtype == getattr(torch, reduce_dtype) for g in observed[0].values()), observed[0]


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(3) + 0.5)
        self.register_buffer("shift", torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to(x.dtype) + self.shift.to(x.dtype)


class _Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ignored, self.lin = _Scaled(), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.ignored(x))


def _ignored_buffers_in_a_nested_unit() -> dict[str, str]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    wrap = importlib.import_module("torch.distributed.fsdp.wrap")
    net = nn.Sequential(_Unit(), nn.Linear(3, 3))
    model = _FSDP(
        net,
        mixed_precision=fsdp.MixedPrecision(buffer_dtype=torch.float16),
        ignored_modules=[net[0].ignored],
        auto_wrap_policy=wrap.ModuleWrapPolicy({_Unit}),
    )
    model(torch.randn(2, 3))
    return {name.rsplit(".", 2)[-2]: str(buffer.dtype) for name, buffer in model.named_buffers()}


def test_buffers_of_modules_ignored_inside_nested_units_stay_as_they_are() -> None:
    """torch's FSDP1 is wrong here (seed 91): it skips ignored buffers by their names relative to the root, but looks
    them up in each unit's own names, so a module ignored inside a nested unit has its buffers cast to buffer_dtype.
    Ours leaves ignored modules alone wherever they are (docs/compatibility.md)."""
    for observed in _run_both(_ignored_buffers_in_a_nested_unit):
        assert observed["torch"] == {"ignored": "torch.float16"}, observed  # torch's bug, as measured
        assert observed["ours"] == {"ignored": "torch.float32"}, observed


class _WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.ones(5))
        self.empty = nn.Parameter(torch.zeros(0))  # inside rank 0's range of the flat parameter
        self.lin = nn.Linear(3, 3)
        self.unused_empty = nn.Parameter(torch.zeros(0, 3))  # never used: a gradient all the same

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.empty.sum() + self.first.sum()


def _grads_of_empty_parameters(strategy: str) -> dict[str, Any]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    model = _FSDP(_WithEmpty(), sharding_strategy=getattr(fsdp.ShardingStrategy, strategy), use_orig_params=True)
    model(torch.randn(2, 3)).sum().backward()
    return {name.rsplit(".", 1)[-1]: p.grad for name, p in model.named_parameters()}


@parameterized.expand([("NO_SHARD",), ("FULL_SHARD",), ("SHARD_GRAD_OP",)])
def test_grads_of_parameters_without_elements_as_torch(strategy: str) -> None:
    """Seeds 18 and 114: with use_orig_params=True a parameter without elements gets an empty gradient where torch's
    FSDP1 counts it in the rank's shard (its offset strictly inside the rank's range), None elsewhere; ours gave
    NO_SHARD's an empty gradient always and the sharded strategies' None always."""
    observed = _assert_same_as_torch(_grads_of_empty_parameters, strategy)
    assert observed[0]["empty"] is not None and observed[0]["empty"].shape == (0,), observed  # inside rank 0's
    assert (observed[1]["empty"] is None) == (strategy != "NO_SHARD"), observed


class _EmptyFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0))  # at offset 0: in no rank's range
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.empty.sum()


def _grads_of_an_empty_parameter_under_no_sync(strategy: str) -> dict[str, Any]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    model = _FSDP(_EmptyFirst(), sharding_strategy=getattr(fsdp.ShardingStrategy, strategy), use_orig_params=True)
    seen: dict[str, Any] = {}
    with model.no_sync():
        model(torch.randn(2, 3)).sum().backward()
    seen["no_sync"] = _cloned_grads(model)  # (the next backward accumulates into these)
    model(torch.randn(2, 3)).sum().backward()
    seen["synchronised"] = _cloned_grads(model)
    return seen


def _cloned_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n.rsplit(".", 1)[-1]: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@parameterized.expand([("NO_SHARD",), ("FULL_SHARD",)])
def test_an_empty_parameter_under_no_sync_shows_an_empty_gradient_as_torch(strategy: str) -> None:
    """Seed 377: under no_sync() torch's FSDP1 shows every parameter its view of the unsharded gradient, one without
    elements at offset 0 too; after a synchronised backward that one has None (in no rank's range). Ours gave it None
    under no_sync() too with NO_SHARD in full precision (the gradient accumulating in `.grad`)."""
    for observed in _assert_same_as_torch(_grads_of_an_empty_parameter_under_no_sync, strategy):
        assert observed["no_sync"]["empty"] is not None and observed["no_sync"]["empty"].shape == (0,), observed
        assert observed["synchronised"]["empty"] is None, observed


def _clip_with_empty_grads(norm_type: float) -> dict[str, Any]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    model = _FSDP(_WithEmpty(), sharding_strategy=fsdp.ShardingStrategy.FULL_SHARD, use_orig_params=True)
    model(torch.randn(2, 3) + torch.distributed.get_rank()).sum().backward()
    with fsdp.FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        full = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    total = model.clip_grad_norm_(0.5, norm_type=norm_type)
    return {"total": total, "expected": torch.linalg.vector_norm(torch.cat([g.flatten() for g in full]), norm_type)}


@parameterized.expand([(float("inf"),), (2.0,)])
def test_clip_grad_norm_with_empty_gradients(norm_type: float) -> None:
    """Seed 117: once parameters without elements get empty gradients (as torch's), clip_grad_norm_(norm_type=inf)
    raised (the inf norm of an empty tensor has no identity). Oracle: the norm of the full gradients."""
    for observed in _run_ours(_clip_with_empty_grads, norm_type):
        assert torch.allclose(observed["total"], observed["expected"]), observed


class _ToFloat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


def _cast_by_a_unit_without_parameters() -> dict[str, str]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    wrap = importlib.import_module("torch.distributed.fsdp.wrap")
    seen: dict[str, str] = {}
    net = nn.Sequential(_ToFloat(), nn.LayerNorm(3, elementwise_affine=False), Linear(3, 3))
    net[1].register_forward_pre_hook(lambda _, args: seen.__setitem__("norm input", str(args[0].dtype)))
    policy = fsdp.MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True, cast_root_forward_inputs=False)
    model = _FSDP(net, mixed_precision=policy, auto_wrap_policy=wrap.ModuleWrapPolicy({nn.LayerNorm}))
    with torch.no_grad():
        seen["output"] = str(model(torch.randn(2, 3)).dtype)
    return seen


def test_a_unit_without_parameters_does_not_cast_its_inputs_as_torch() -> None:
    """Seed 327: with cast_forward_inputs=True torch's FSDP1 casts a unit's inputs only when it has a flat parameter:
    a LayerNorm without affine parameters wrapped alone normalises its fp32 input in fp32 (ours cast it to bf16)."""
    for observed in _assert_same_as_torch(_cast_by_a_unit_without_parameters):
        assert observed == {"norm input": "torch.float32", "output": "torch.bfloat16"}, observed


def _local_round_trip_with_orig_params(nested: bool) -> dict[str, Any]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    wrap = importlib.import_module("torch.distributed.fsdp.wrap")
    FSDP = fsdp.FullyShardedDataParallel
    policy = wrap.ModuleWrapPolicy({Linear}) if nested else None

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return _FSDP(nn.Sequential(Linear(3, 5), Linear(5, 2)), use_orig_params=True, auto_wrap_policy=policy)

    source = build(0)
    with FSDP.state_dict_type(source, fsdp.StateDictType.LOCAL_STATE_DICT):
        saved = source.state_dict()
    seen: dict[str, Any] = {"keys": list(saved)}
    for strict in (True, False):
        destination = build(1)
        with FSDP.state_dict_type(destination, fsdp.StateDictType.LOCAL_STATE_DICT):
            try:
                result = destination.load_state_dict(saved, strict=strict)
                seen[f"strict={strict}"] = ("loaded", result.missing_keys, result.unexpected_keys)
            except RuntimeError as error:
                seen[f"strict={strict}"] = ("RuntimeError", str(error))
        with FSDP.summon_full_params(source), FSDP.summon_full_params(destination):
            loaded = all(torch.equal(a, b) for a, b in zip(source.parameters(), destination.parameters(), strict=True))
        seen[f"strict={strict}: values as saved"] = loaded
    return seen


@parameterized.expand([("one unit", False), ("nested units", True)])
def test_a_local_dict_with_orig_params_loads_strictly_where_torch_refuses_its_own(_: str, nested: bool) -> None:
    """The 4-rank campaign's LOCAL saves (any world size): with use_orig_params=True torch's FSDP1 saves each unit's
    `_flat_param` beside the parameters' names, then, loading that very dict strictly, raises `Unexpected key(s) in
    state_dict: "..._flat_param"` (after loading the values); strict=False reports the key as unexpected. Ours loads
    it strictly, consuming every key, to the same values (docs/compatibility.md, Differences on purpose). Oracle: the
    keys torch saves and the values its non-strict load gives."""
    for observed in _run_both(_local_round_trip_with_orig_params, nested):
        ours, theirs = observed["ours"], observed["torch"]
        assert ours["keys"] == theirs["keys"] and any(k.endswith("_flat_param") for k in ours["keys"]), observed
        refused, message = theirs["strict=True"]
        assert refused == "RuntimeError" and "Unexpected key(s)" in message and "_flat_param" in message, observed
        flat_keys = [k for k in theirs["keys"] if k.endswith("_flat_param")]
        assert theirs["strict=False"] == ("loaded", [], flat_keys), observed
        assert ours["strict=True"] == ours["strict=False"] == ("loaded", [], []), observed
        assert ours["strict=True: values as saved"] and ours["strict=False: values as saved"], observed
        assert theirs["strict=False: values as saved"], observed


def _clip_inf_then_two() -> dict[str, Any]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    FSDP = fsdp.FullyShardedDataParallel
    torch.manual_seed(0)
    model = _FSDP(nn.Linear(1, 1, bias=False), use_orig_params=True)  # one element: rank 1 holds only padding
    seen: dict[str, Any] = {}
    for step, norm_type in enumerate((float("inf"), 2.0, 2.0)):
        model(torch.full((2, 1), 1.0 + step + torch.distributed.get_rank())).sum().backward()
        with FSDP.summon_full_params(model, with_grads=True):
            full = torch.cat([p.grad.flatten() for p in model.parameters()])
        seen[f"step {step}: local gradient"] = next(model.parameters()).grad is not None
        seen[f"step {step}: norm"] = float(model.clip_grad_norm_(10.0, norm_type=norm_type))
        seen[f"step {step}: expected"] = float(torch.linalg.vector_norm(full, norm_type))
        model.zero_grad()
    return seen


def test_clip_grad_norm_after_an_inf_norm_on_a_rank_without_gradients() -> None:
    """Seed 235 on 4 ranks: on a rank whose shard holds no parameter's elements, torch's FSDP1 all-reduces the inf
    norm in place into the zero tensor it caches for ranks without gradients, so every later norm counts the old inf
    norm once more on that rank (here 5.83 = sqrt(5² + 3²) where the norm is 5, then 7.62 for 7), silently. Ours
    stays right. Oracle: the norm of the full gradients (summon_full_params(with_grads=True)). The fuzzer puts
    torch's zero back after each clip so that its later observations keep an oracle."""
    for rank, observed in enumerate(_run_ours(_clip_inf_then_two)):
        assert observed["step 0: local gradient"] == (rank == 0), observed
        for step in range(3):
            assert observed[f"step {step}: norm"] == pytest.approx(observed[f"step {step}: expected"]), observed
