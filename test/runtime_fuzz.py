"""The runtime fuzzer: a seeded case (runtime_fuzz_cases.py) run on 2 (or 4) gloo ranks with torch's FSDP1 and with
ours under the switch, the same code for both (torch_side_by_side._side_by_side), every observation compared bit for
bit.

On each rank the program records, in order: the losses, the local gradients after each backward, what
clip_grad_norm_ returned, eval outputs, what summon_full_params shows, FULL/SHARDED/LOCAL model and optimizer state
dicts (their local pieces and placements), and at the end the local parameters, the full parameters and the FULL state
dict. Where torch raises, the program stops there and records the exception's type: ours must raise the same."""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fsdp_legacy
from harness import RankError, run_on_ranks
from runtime_fuzz_cases import Case, draw
from torch_side_by_side import _side_by_side

BATCH = 4
CASE_TIMEOUT = 30.0  # a case runs in well under a second; a hang is one rank that raised alone
# What torch 2.13's FSDP1 raises where it is wrong and ours runs the case: (type, a piece of the message).
TORCH_BUGS = (
    ("ZeroDivisionError", ""),  # a SHARDED load of a unit holding parameters without elements
    ("KeyError", "step"),  # a FULL optimizer state dict where a rank holds no piece of some parameter
    ("StopIteration", ""),  # the same
    ("RuntimeError", "is not in the optimizer state"),  # a parameter without elements, which never gets state
    ("RuntimeError", "cannot compute the inf norm on an empty tensor"),  # clip_grad_norm_(inf), empty gradients
    ("RuntimeError", "to a tensor with grad_dtype"),  # keep_low_precision_grads with use_orig_params=True: torch
    # 2.13's autograd refuses the low-precision gradient torch's FSDP1 assigns
)


# ----------------------------------------------------------------------------------------------------------------------
# The model's modules


def _in_own_dtype(module: nn.Module, x: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """The input in the dtype of the module's parameter `name` (an attribute: with use_orig_params=False FSDP's views
    are not registered), so that units computing in different dtypes (mixed precision next to ignored modules, inner
    units that do not cast their inputs) compose."""
    weight = getattr(module, name, None)
    return x.to(weight.dtype) if isinstance(weight, torch.Tensor) and weight.dtype != x.dtype else x


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_in_own_dtype(self, x))


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_in_own_dtype(self, x))


class Conv1d(nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_in_own_dtype(self, x))


class ConvLeaf(nn.Module):
    def __init__(self, kernel: int) -> None:
        super().__init__()
        self.conv = Conv1d(1, 1, kernel, padding=kernel // 2, bias=kernel != 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.unsqueeze(1)).squeeze(1)


class ScaleLeaf(nn.Module):
    """An odd-numel parameter, a float buffer it reads, an integer buffer counting training calls."""

    def __init__(self, hidden: int, wide_buffer: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(hidden) + 0.5)
        self.register_buffer("shift", torch.randn(hidden, dtype=torch.float64 if wide_buffer else torch.float32))
        self.register_buffer("calls", torch.zeros(1, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        x = _in_own_dtype(self, x, "scale")
        return x * self.scale + self.shift.to(x.dtype)


class EmptyLeaf(nn.Module):
    """Parameters without elements, and one of a single element."""

    def __init__(self, two_d: bool) -> None:
        super().__init__()
        self.nothing = nn.Parameter(torch.zeros(0))
        self.one = nn.Parameter(torch.ones(1))
        if two_d:
            self.nothing2 = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _in_own_dtype(self, x, "one")
        return x * self.one + self.nothing.sum().to(x.dtype)


class Block(nn.Module):
    def __init__(self, residual: bool, layers: list[nn.Module]) -> None:
        super().__init__()
        self.residual = residual
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for layer in self.layers:
            y = layer(y)
        return x + y if self.residual else y


class Pair(nn.Module):
    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).float() + self.b(x).float()


class TiedHead(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class FuzzNet(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.emb = nn.Embedding(case.vocab, case.hidden) if case.vocab else None
        self.body = _build(case.tree, case.hidden)
        self.head: nn.Module | None = None
        if case.vocab:
            self.head = TiedHead(self.emb) if case.tied else Linear(case.hidden, case.vocab)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        h = self.body(h)
        return self.head(h) if self.head is not None else h


def _build(tree: tuple, hidden: int) -> nn.Module:
    kind = tree[0]
    if kind == "block":
        return Block(tree[1], [_build(child, hidden) for child in tree[2]])
    if kind == "pair":
        return Pair(_build(tree[1], hidden), _build(tree[2], hidden))
    _, frozen, option = tree
    module: nn.Module = {
        "linear": lambda: Linear(hidden, hidden, bias=option),
        "norm": lambda: LayerNorm(hidden, elementwise_affine=option),
        "conv": lambda: ConvLeaf(option),
        "scale": lambda: ScaleLeaf(hidden, option),
        "empty": lambda: EmptyLeaf(option),
    }[kind]()
    if frozen:
        module.requires_grad_(False)
    return module


WRAP_CLASSES = {
    "Block": Block,
    "Pair": Pair,
    "Linear": Linear,
    "LayerNorm": LayerNorm,
    "ConvLeaf": ConvLeaf,
    "Conv1d": Conv1d,
    "ScaleLeaf": ScaleLeaf,
    "EmptyLeaf": EmptyLeaf,
}


# ----------------------------------------------------------------------------------------------------------------------
# One case on one rank (the same code for torch's FSDP1 and, under the switch, ours)


def _fsdp() -> Any:
    return importlib.import_module("torch.distributed.fsdp")


def _is_ours() -> bool:
    return _fsdp().FullyShardedDataParallel is fsdp_legacy.FullyShardedDataParallel


def _policy(case: Case) -> Any:
    wrap = importlib.import_module("torch.distributed.fsdp.wrap")
    if case.policy[0] == "classes":
        return wrap.ModuleWrapPolicy({WRAP_CLASSES[name] for name in case.policy[1]})
    if case.policy[0] == "size":
        exclude = {nn.ModuleList, nn.ModuleDict, nn.Embedding, TiedHead}  # a tied pair stays in one unit
        return functools.partial(
            wrap.size_based_auto_wrap_policy, min_num_params=case.policy[1], exclude_wrap_modules=exclude
        )
    return None


def _mesh(case: Case) -> Any:
    """HYBRID's mesh, one per case: (1, 2) on two ranks (torch's shard groups of one rank on CPU are wrong), (1, 4) or
    (2, 2) on four."""
    if "HYBRID" not in case.strategy:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", case.mesh_shape)


def _wrap(case: Case, init_seed: int, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    fsdp = _fsdp()
    torch.manual_seed(init_seed)
    model = FuzzNet(case)
    kwargs: dict[str, Any] = {}
    if case.mixed_precision is not None:
        param, reduce, buffer, keep_low, cast = case.mixed_precision
        dtype = {None: None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
        kwargs["mixed_precision"] = fsdp.MixedPrecision(
            param_dtype=dtype[param],
            reduce_dtype=dtype[reduce],
            buffer_dtype=dtype[buffer],
            keep_low_precision_grads=keep_low,
            cast_forward_inputs=cast,
        )
    if mesh is not None:
        kwargs["device_mesh"] = mesh
    wrapped = fsdp.FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        sharding_strategy=getattr(fsdp.ShardingStrategy, case.strategy),
        use_orig_params=case.use_orig_params,
        cpu_offload=fsdp.CPUOffload(offload_params=case.offload and _is_ours()),
        backward_prefetch=getattr(fsdp.BackwardPrefetch, case.backward_prefetch) if case.backward_prefetch else None,
        forward_prefetch=case.forward_prefetch,
        limit_all_gathers=case.limit_all_gathers,
        ignored_modules=[model.get_submodule(path) for path in case.ignored] or None,
        auto_wrap_policy=_policy(case),
        **kwargs,
    )
    if case.optimizer == "sgd":
        optim: torch.optim.Optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    else:
        optim = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    return wrapped, optim


def _batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Different data on each rank and step, from the case's seed."""
    gen = torch.Generator().manual_seed(case.seed * 1000 + step * 10 + torch.distributed.get_rank())
    if case.vocab:
        x = torch.randint(0, case.vocab, (BATCH,), generator=gen)
        return x, torch.randint(0, case.vocab, (BATCH,), generator=gen)
    return torch.randn(BATCH, case.hidden, generator=gen), None


def _loss(case: Case, model: nn.Module, step: int) -> torch.Tensor:
    x, target = _batch(case, step)
    out = model(x)
    if target is not None:
        return F.cross_entropy(out.float(), target)
    return out.float().pow(2).mean()


def observe(value: Any) -> Any:
    """A picklable, comparable picture of `value`: tensors as themselves, ShardedTensor/DTensor as local pieces."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        shards = [(tuple(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
        return ("ShardedTensor", tuple(value.size()), shards)
    if isinstance(value, DTensor):
        return ("DTensor", tuple(value.shape), str(value.placements), value.to_local().detach().clone())
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: observe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(observe(v) for v in value)
    return value


def _grads(model: nn.Module, trainable_only: bool = False) -> dict[str, Any]:
    """Local gradients by name. Under no_sync with use_orig_params=True torch's FSDP1 also shows frozen parameters
    a zero gradient (a view of the unsharded flat gradient); ours leaves them None (docs/compatibility.md)."""
    return {n: observe(p.grad) for n, p in model.named_parameters() if p.requires_grad or not trainable_only}


def _step(case: Case, model: nn.Module, optim: Any, clip: tuple | None, seen: list, index: int) -> None:
    loss = _loss(case, model, index)
    loss.backward()
    seen.append(("loss", observe(loss)))
    seen.append(("grads", _grads(model)))
    if clip is not None:
        seen.append(("clip", observe(model.clip_grad_norm_(clip[0], norm_type=clip[1]))))
        _restore_torch_zero(model)
        seen.append(("clipped grads", _grads(model)))
    optim.step()
    optim.zero_grad()


def _restore_torch_zero(model: nn.Module) -> None:
    """torch's FSDP1 bug (docs/compatibility.md): on a rank without gradients, clip_grad_norm_(norm_type=inf)
    all-reduces the norm in place into the zero it caches (`_zero_scalar`), which every later norm on that rank then
    counts (seed 235 on 4 ranks). The zero is put back, so that the oracle stays right for the calls after."""
    zero = getattr(model, "_zero_scalar", None) if not _is_ours() else None
    if isinstance(zero, torch.Tensor):
        zero.zero_()


def _state_dict_configs(kind: str) -> tuple[Any, Any, Any]:
    fsdp = _fsdp()
    if kind == "FULL":  # offload_to_cpu=False: torch's offload is wrong on CPU (FSDP1_FACTS.md, bugs 1 and 2)
        return (
            fsdp.StateDictType.FULL_STATE_DICT,
            fsdp.FullStateDictConfig(offload_to_cpu=False),
            fsdp.FullOptimStateDictConfig(offload_to_cpu=False),
        )
    if kind == "LOCAL":
        return (fsdp.StateDictType.LOCAL_STATE_DICT, fsdp.LocalStateDictConfig(), fsdp.LocalOptimStateDictConfig())
    return (
        fsdp.StateDictType.SHARDED_STATE_DICT,
        fsdp.ShardedStateDictConfig(offload_to_cpu=False),
        fsdp.ShardedOptimStateDictConfig(offload_to_cpu=False),
    )


def _save_load(case: Case, model: nn.Module, optim: Any, kind: str, seen: list, mesh: Any) -> tuple[nn.Module, Any]:
    FSDP = _fsdp().FullyShardedDataParallel
    configs = _state_dict_configs(kind)
    with FSDP.state_dict_type(model, *configs):
        sd = model.state_dict()
        osd = FSDP.optim_state_dict(model, optim)
    seen.append((f"{kind} state dict", observe(sd)))
    seen.append((f"{kind} optim state dict", observe(osd)))
    fresh, fresh_optim = _wrap(case, case.seed + 1, mesh)
    with FSDP.state_dict_type(fresh, *configs):
        if kind == "LOCAL" and case.use_orig_params:
            # torch's FSDP1 refuses its own LOCAL dict's `_flat_param` keys as unexpected (strict) with uop=True; ours
            # loads them (docs/compatibility.md): the rest of the load is compared
            seen.append(("load, missing keys", fresh.load_state_dict(sd, strict=False).missing_keys))
        else:
            seen.append(("load", str(fresh.load_state_dict(sd))))
        fresh_optim.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_optim, osd))
    loaded = fresh_optim.state_dict()  # each parameter's state in name order: torch's order varies by path
    loaded["state"] = {key: dict(sorted(state.items())) for key, state in loaded["state"].items()}
    seen.append(("loaded optimizer", observe(loaded)))
    return fresh, fresh_optim


def _summon(model: nn.Module, writeback: bool, with_grads: bool, seen: list) -> None:
    FSDP = _fsdp().FullyShardedDataParallel
    with FSDP.summon_full_params(model, writeback=writeback, with_grads=with_grads):
        seen.append(("summoned", {n: observe(p) for n, p in model.named_parameters()}))
        if with_grads:
            seen.append(("summoned grads", {n: observe(p.grad) for n, p in model.named_parameters()}))
        if writeback:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.75)


def _run_op(
    case: Case, model: nn.Module, optim: Any, op: tuple, index: int, seen: list, mesh: Any
) -> tuple[nn.Module, Any]:
    kind = op[0]
    if kind == "step":
        _step(case, model, optim, op[1], seen, index)
    elif kind == "no_sync":
        with model.no_sync():
            for micro in range(op[1]):
                loss = _loss(case, model, index * 10 + micro + 100)
                loss.backward()
                seen.append(("no_sync loss", observe(loss)))
                seen.append(("no_sync grads", _grads(model, trainable_only=True)))
        _step(case, model, optim, op[2], seen, index)
    elif kind == "eval":
        model.eval()
        with torch.no_grad():
            x, _ = _batch(case, index + 500)
            seen.append(("eval out", observe(model(x))))
        model.train()
    elif kind == "summon":
        _summon(model, op[1], op[2], seen)
    elif kind == "save_load":
        return _save_load(case, model, optim, op[1], seen, mesh)
    return model, optim


def _final(model: nn.Module, seen: list) -> None:
    FSDP = _fsdp().FullyShardedDataParallel
    seen.append(("local params", {n: observe(p) for n, p in model.named_parameters()}))
    seen.append(("buffers", {n: observe(b) for n, b in model.named_buffers()}))
    with FSDP.summon_full_params(model, writeback=False):
        seen.append(("full params", {n: observe(p) for n, p in model.named_parameters()}))
    with FSDP.state_dict_type(model, *_state_dict_configs("FULL")):
        seen.append(("final state dict", observe(model.state_dict())))


def run_case(case: Case) -> list[tuple[str, Any]]:
    """The case's program on this rank: what it saw, in order; ("raised", type name, message) where it stopped."""
    seen: list[tuple[str, Any]] = []
    where = "construction"
    try:
        mesh = _mesh(case)
        model, optim = _wrap(case, case.seed, mesh)
        for index, op in enumerate(case.program):
            where = f"op {index} {op}"
            model, optim = _run_op(case, model, optim, op, index, seen, mesh)
        where = "final observation"
        _final(model, seen)
    except Exception as error:
        seen.append(("raised", type(error).__name__, f"{where}: {str(error)[:300]}"))
        # On stderr too: where one rank raises alone the other hangs, and only this line tells why.
        side = "ours" if _is_ours() else "torch"
        print(f"runtime_fuzz seed {case.seed} rank {torch.distributed.get_rank()} {side}: {seen[-1]}", file=sys.stderr)
    return seen


# ----------------------------------------------------------------------------------------------------------------------
# Comparison, and the campaign driver (in the pytest process)


def first_difference(ours: Any, theirs: Any, where: str = "") -> str | None:
    """Where `ours` differs from `theirs`, bit for bit; None when equal."""
    if isinstance(theirs, torch.Tensor):
        if not isinstance(ours, torch.Tensor):
            return f"{where}: {type(ours).__name__} vs a tensor"
        if (ours.dtype, ours.shape) != (theirs.dtype, theirs.shape):
            return f"{where}: {ours.dtype}{tuple(ours.shape)} vs {theirs.dtype}{tuple(theirs.shape)}"
        if torch.equal(ours, theirs):
            return None
        if ours.is_floating_point():  # NaNs in the same places count as equal
            nan = theirs.isnan()
            if torch.equal(ours.isnan(), nan) and torch.equal(ours[~nan], theirs[~nan]):
                return None
        return f"{where}: values differ: ours {ours.flatten()[:6].tolist()} torch {theirs.flatten()[:6].tolist()}"
        return None
    if type(ours) is not type(theirs):
        return f"{where}: {type(ours).__name__} {str(ours)[:200]} vs {type(theirs).__name__} {str(theirs)[:200]}"
    if isinstance(theirs, dict):
        if list(ours) != list(theirs):
            return f"{where}: keys {list(ours)} vs {list(theirs)}"
        for key in theirs:
            found = first_difference(ours[key], theirs[key], f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(theirs, (list, tuple)):
        if len(ours) != len(theirs):
            return f"{where}: length {len(ours)} vs {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            found = first_difference(a, b, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(theirs, float) and theirs != theirs:
        return None if ours != ours else f"{where}: {ours} vs nan"
    return None if ours == theirs else f"{where}: ours {ours!r}, torch {theirs!r}"


def _compare(seen: list, theirs: list) -> str | None:
    """Ours against torch's, event by event; where torch raised, only the exception's type must agree."""
    for index, (a, b) in enumerate(zip(seen, theirs, strict=False)):
        if a[0] != b[0]:
            raised = a if a[0] == "raised" else b if b[0] == "raised" else None
            detail = f" ({'ours' if raised is a else 'torch'} raised {raised[1]}: {raised[2]})" if raised else ""
            return f"event {index}: ours {a[0]!r}, torch {b[0]!r}{detail}"
        if a[0] == "raised":
            return None if a[1] == b[1] else f"ours raised {a[1]} ({a[2]}), torch {b[1]} ({b[2]})"
        found = first_difference(a[1], b[1], f"event {index} {a[0]}")
        if found:
            return found
    if len(seen) != len(theirs):
        return f"ours saw {len(seen)} events, torch {len(theirs)}"
    return None


@dataclass
class Outcome:
    case: Case
    difference: str | None  # None: ours matched torch on every rank (or torch has no answer: `torch_failed`)
    raised: str | None  # the exception type both raised, if any
    torch_failed: str | None = None  # torch's FSDP1 hung or hit one of TORCH_BUGS: no oracle for this case

    def line(self) -> str:
        if self.torch_failed:
            return f"seed {self.case.seed}: no oracle: {self.torch_failed}"
        verdict = "same" if self.difference is None else f"DIFFERENT: {self.difference}"
        return f"seed {self.case.seed}: {verdict}" + (f" (both raised {self.raised})" if self.raised else "")


def _torch_bug(theirs: list) -> str | None:
    last = theirs[-1] if theirs else ("",)
    if last[0] == "raised" and any(last[1] == kind and piece in last[2] for kind, piece in TORCH_BUGS):
        return f"torch raised {last[1]}: {last[2]}"
    return None


_warm_pools: set[int] = set()


def _warm_up(case: Case) -> None:
    """The imports and first calls of a case (seconds on a loaded machine), so that a case's timeout measures the
    case: one plain FULL_SHARD step of its model."""
    run_case(replace(case, strategy="FULL_SHARD", ignored=(), offload=False, program=(("step", None),)))


def run_seed(seed: int, case: Case | None = None, world_size: int = 2) -> Outcome:
    """Draw seed's case on `world_size` ranks (or take `case`), run it side by side on the ranks, compare."""
    case = case or draw(seed, world_size)
    if case.world_size not in _warm_pools:
        run_on_ranks(_side_by_side, case.world_size, _warm_up, case, timeout=300)
        _warm_pools.add(case.world_size)
    try:
        results = run_on_ranks(_side_by_side, case.world_size, run_case, case, timeout=CASE_TIMEOUT)
    except RankError as error:
        text = str(error)
        if error.silent and "fsdp_legacy/" not in text and "/torch/distributed/fsdp/" in text:
            # torch's ranks parted: one raised alone (the reason is on stderr), the other waits in a collective
            return Outcome(case, None, None, "torch's FSDP1 hung (one rank raised alone)")
        return Outcome(case, f"ranks failed or hung: {text[:2000]}", None)
    for rank, result in enumerate(results):
        bug = _torch_bug(result["torch"])
        if bug and not (result["ours"] and result["ours"][-1][0] == "raised"):
            return Outcome(case, None, None, bug)
        found = _compare(result["ours"], result["torch"])
        if found:
            return Outcome(case, f"rank {rank}: {found}", None)
    last = results[0]["torch"][-1] if results[0]["torch"] else ("",)
    return Outcome(case, None, last[1] if last[0] == "raised" else None)
