"""What torch's own FSDP1 tests check through FSDP1's internals, checked on ours next to torch's.

torch's tests in test/distributed/fsdp (test_fsdp_ignored_modules, test_fsdp_use_orig_params, test_fsdp_misc,
test_fsdp_mixed_precision, test_fsdp_fine_tune, test_wrap, test_fsdp_core, test_fsdp_state_dict) reach into FSDP1's
internals: `_traversal_utils._get_fsdp_handles`, a unit's `_handle` / `_handles` / `params` / `_flat_param`, the
FlatParameter's `_numels_with_padding`, `_is_padding_mask`, `_params`, `_fqns`, `_shard_param_infos`,
`_local_shard`, `_mp_shard`, `_full_param_padded`, a handle's `uses_sharded_strategy` and `sharded_grad`,
`_runtime_utils.HOMOGENEOUS_ATTR_NAMES`, the `_state_dict_type` attribute, `_unshard_param_utils.FLAT_PARAM` and
`_common_utils.FSDP_PREFIX`. Each test here builds one scenario of such a test twice on the same ranks: once with
torch's FSDP1, once with ours through the switch (`fsdp_legacy.install()`), so that the very same code, which names
only torch's modules, builds the model and reads the internals. The oracle is torch's FSDP1: both runs must give the
same observations, and the observations must show what torch's test asserts.

Not mirrored here: device_id / CUDA placement (CUDA), the `_register_pre_backward_hooks` /
`_register_post_backward_hook` / `_post_backward_reshard` call counts (test_torch_internal_runtime_names.py: the
runtime calls those steps through torch's names), `FlatParamHandle._use_unsharded_views` patching (the core mirror
observes the tensor views themselves instead).
test_fsdp_misc's test_unsafe_setattr (`_flat_param._FSDP_USE_UNSAFE_SETATTR`) is mirrored in
test_torch_internal_setattr.py.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from parameterized import parameterized
from torch import nn

from torch_side_by_side import (
    _FSDP,
    WORLD_SIZE,
    _each,
    _flat,
    _freed,
    _fsdp,
    _full_params,
    _run,
    _traversal,
    _units,
    _wrap_api,
)

# ----------------------------------------------------------------------------------------------------------------------
# test_fsdp_ignored_modules


class _Model(nn.Module):
    """The layer layout torch's ignored-modules tests use."""

    def __init__(self) -> None:
        super().__init__()
        self.layer0 = nn.Linear(3, 5)
        self.layer1 = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        self.layer2 = nn.Linear(4, 2)
        self.layer3 = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.layer0, self.layer1, self.layer2):
            x = torch.relu(layer(x))
        return self.layer3(x)


class _SharedTransformer(nn.Module):
    """An embedding tied to the output projection around a block to ignore (torch's TransformerWithSharedParams in
    small)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.transformer = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.norm = nn.LayerNorm(8)
        self.output_proj = nn.Linear(8, 10)
        self.output_proj.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_proj(self.norm(self.transformer(self.embed(x))))


def _managed_numel(model: nn.Module, use_orig_params: bool) -> tuple[int, list[list[int]]]:
    """torch's count of the numel FSDP manages, over `_get_fsdp_handles` inside summon_full_params: each flat
    parameter's numel there (the unpadded unsharded flat parameter's), less the alignment padding
    `_numels_with_padding` / `_is_padding_mask` show with use_orig_params=True."""
    total, per_handle = 0, []
    with _fsdp().FullyShardedDataParallel.summon_full_params(model):
        for handle in _traversal()._get_fsdp_handles(model):
            flat = handle.flat_param
            padding = sum(n for n, pad in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True) if pad)
            unsharded = flat.numel()
            per_handle.append([unsharded, padding, sum(flat._numels_with_padding)])
            total += unsharded - (padding if use_orig_params else 0)
    return total, per_handle


def _ignored_transformer(use_orig_params: bool, ignore_modules: bool, use_auto_wrap: bool) -> dict[str, Any]:
    model = _SharedTransformer()
    kwargs: dict[str, Any] = {"use_orig_params": use_orig_params}
    if use_auto_wrap:  # (untied, so that every Linear can be its own unit)
        model.output_proj.weight = nn.Parameter(model.output_proj.weight.detach().clone())
        kwargs["auto_wrap_policy"] = _wrap_api().ModuleWrapPolicy({nn.Linear})
    if ignore_modules:
        kwargs["ignored_modules"] = [model.transformer]
    else:
        kwargs["ignored_states"] = list(model.transformer.parameters())
    non_ignored = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.transformer.parameters())
    wrapped = _FSDP(model, **kwargs)
    managed, per_handle = _managed_numel(wrapped, use_orig_params)
    optim = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    losses = []
    for step in range(2):
        loss = wrapped(torch.arange(6).view(2, 3) + step + dist.get_rank()).sum()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return {"managed": managed, "expected": non_ignored, "per handle": per_handle, "losses": losses}


@parameterized.expand([(False,), (True,)])
def test_ignored_modules_transformer_managed_numel(use_orig_params: bool) -> None:
    """Mirrors test_fsdp_ignored_modules.py::test_ignored_modules_transformer: the unpadded numel of the handles'
    flat parameters (`_get_fsdp_handles`, less `_numels_with_padding` where `_is_padding_mask`) summed inside
    summon_full_params is the model's numel less the ignored module's, for ignored_modules and ignored_states, with
    and without auto wrapping; and the model trains."""
    cases = [(use_orig_params, ignore_modules, auto) for ignore_modules in (True, False) for auto in (False, True)]
    for per_case in _run(_each, _ignored_transformer, cases):
        for case, seen in zip(cases, per_case, strict=True):
            assert seen["managed"] == seen["expected"], (case, seen)


def _ignored_nested(use_orig_params: bool, ignore_modules: bool) -> dict[str, Any]:
    model = _Model()
    wrap = functools.partial(_FSDP, use_orig_params=use_orig_params)
    model.layer1[1] = wrap(model.layer1[1])
    non_ignored = sum(p.numel() for p in _Model().parameters()) - sum(p.numel() for p in _Model().layer1.parameters())
    if ignore_modules:
        wrapped = wrap(model, ignored_modules=[model.layer1])
    else:
        wrapped = wrap(model, ignored_states=list(model.layer1.parameters()))
    with _fsdp().FullyShardedDataParallel.summon_full_params(wrapped):
        flat = wrapped.params[0]
        padding = sum(n for n, pad in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True) if pad)
        numel = flat.numel() - (padding if use_orig_params else 0)
    optim = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    losses = []
    for step in range(2):
        loss = wrapped(torch.full((4, 3), 0.5 + step + dist.get_rank())).sum()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return {"numel": numel, "expected": non_ignored, "params": len(wrapped.params), "losses": losses}


@parameterized.expand([(False,), (True,)])
def test_ignored_modules_nested_flat_param_numel(use_orig_params: bool) -> None:
    """Mirrors test_fsdp_ignored_modules.py::test_ignored_modules_nested: ignoring a module that holds a nested unit,
    the root's `params[0]` inside summon_full_params holds the non-ignored numel (less `_is_padding_mask` padding with
    use_orig_params=True), and the model trains."""
    cases = [(use_orig_params, True), (use_orig_params, False)]
    for per_case in _run(_each, _ignored_nested, cases):
        for case, seen in zip(cases, per_case, strict=True):
            assert seen["numel"] == seen["expected"], (case, seen)


def _ignored_states_auto_wrap(policy_name: str, ignore_bias: bool) -> dict[str, Any]:
    wrap_api = _wrap_api()
    if policy_name == "transformer":
        policy = functools.partial(wrap_api.transformer_auto_wrap_policy, transformer_layer_cls={nn.Sequential})
    else:
        policy = wrap_api.ModuleWrapPolicy((nn.Sequential,))
    model = _Model()
    ignored = [model.layer1[1].weight] + ([model.layer1[1].bias] if ignore_bias else [])
    reference = _Model()
    layer1 = sum(p.numel() for p in reference.layer1.parameters()) - sum(p.numel() for p in ignored)
    rest = sum(p.numel() for p in reference.parameters()) - sum(p.numel() for p in reference.layer1.parameters())
    wrapped = _FSDP(model, use_orig_params=False, auto_wrap_policy=policy, ignored_states=ignored)
    return {
        "layer1 shard": wrapped.layer1.module._flat_param.numel(),
        "root shard": wrapped.module._flat_param.numel(),
        "layer1 bound": math.ceil(layer1 / WORLD_SIZE),
        "root bound": math.ceil(rest / WORLD_SIZE),
    }


def test_ignored_states_with_auto_wrap_shard_sizes() -> None:
    """Mirrors test_fsdp_ignored_modules.py::test_ignored_states_auto_wrap: ignoring single parameters of a
    module an auto-wrap policy wraps, each unit's `module._flat_param` shard is at most its share of the numel left."""
    cases = [(policy, ignore_bias) for policy in ("transformer", "module") for ignore_bias in (True, False)]
    for per_case in _run(_each, _ignored_states_auto_wrap, cases):
        for seen in per_case:
            assert seen["layer1 shard"] <= seen["layer1 bound"] and seen["root shard"] <= seen["root bound"], seen


# ----------------------------------------------------------------------------------------------------------------------
# test_fsdp_use_orig_params


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(6, 6)
        self.lin2 = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


def _params_and_fqns() -> dict[str, Any]:
    model = nn.Sequential(_Block(), _Block(), nn.Linear(6, 2))
    wrapped = _FSDP(model, use_orig_params=True, auto_wrap_policy=_wrap_api().ModuleWrapPolicy({_Block}))
    units, has_both = [], False
    for unit in _units(wrapped):
        for handle in [unit._handle] if unit._handle is not None else []:
            flat = handle.flat_param
            has_weight = any("weight" in fqn and p.numel() > 0 for p, fqn in zip(flat._params, flat._fqns, strict=True))
            has_bias = any("bias" in fqn and p.numel() > 0 for p, fqn in zip(flat._params, flat._fqns, strict=True))
            has_both |= has_weight and has_bias
            registered = [
                info.module._parameters[info.param_name] is param
                for info, param in zip(flat._param_infos, flat._params, strict=True)
            ]
            shards = [
                [info.in_shard, info.numel_in_shard, list(param.shape)]
                for info, param in zip(flat._shard_param_infos, flat._params, strict=True)
            ]
            units.append({"fqns": list(flat._fqns), "registered": registered, "shards": shards})
    return {"has both": has_both, "units": units}


def test_flat_param_params_are_the_registered_sharded_views() -> None:
    """Mirrors test_fsdp_use_orig_params.py::test_multiple_optimizers: walking `FSDP.fsdp_modules` and each unit's
    `_handles`, `flat_param._params` zipped with `_fqns` finds a flat parameter with both a weight and a bias in this
    rank's shard; the `_params` are the parameters the modules hold, shaped as `_shard_param_infos` says."""
    for seen in _run(_params_and_fqns):
        assert seen["has both"]
        for unit in seen["units"]:
            assert all(unit["registered"]), unit
            for in_shard, numel, shape in unit["shards"]:
                assert shape == ([numel] if in_shard else [0]), unit


class _AccessModel(nn.Module):
    """25 numel (13 per rank), then 35 + 1 alignment padding + 7 = 44 (22 per rank) with use_orig_params=True."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(5, 5, bias=False)
        self.lin2 = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


def _access_after_forward(strategy: str) -> dict[str, Any]:
    model = _FSDP(
        _AccessModel(),
        sharding_strategy=_fsdp().ShardingStrategy[strategy],
        auto_wrap_policy=_wrap_api().always_wrap_policy,
        use_orig_params=True,
    )
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    def exposed() -> dict[str, list[float]]:
        return {clean_tensor_name(n): _flat(p) for n, p in model.named_parameters()}

    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.arange(10.0).view(2, 5) / 10 + dist.get_rank()
    seen: dict[str, Any] = {"full before": _full_params(model)}
    out = model(x)
    seen["between forward and backward"] = exposed()
    out.sum().backward()
    optim.step()
    seen["after step"] = exposed()
    seen["full after"] = _full_params(model)
    return seen


@parameterized.expand([("FULL_SHARD",), ("SHARD_GRAD_OP",), ("NO_SHARD",)])
def test_original_params_after_forward_are_the_sharded_views(strategy: str) -> None:
    """Mirrors test_fsdp_use_orig_params.py::test_access_params_after_forward: with use_orig_params=True the
    original parameters read after forward and after the step are this rank's pieces of the full parameters (13 of
    lin1.weight's 25; 22 of lin2.weight's 35, then the rest, one alignment padding and the bias), unflattened with
    NO_SHARD, and after SHARD_GRAD_OP's forward still unsharded."""
    pieces = {0: {"lin1.weight": (0, 13), "lin2.weight": (0, 22), "lin2.bias": (0, 0)}}
    pieces[1] = {"lin1.weight": (13, 25), "lin2.weight": (22, 35), "lin2.bias": (0, 7)}
    for rank, seen in enumerate(_run(_access_after_forward, strategy)):
        for stage, full in (("between forward and backward", "full before"), ("after step", "full after")):
            assert seen[stage].keys() == seen[full].keys()
            for name, values in seen[stage].items():
                whole = strategy == "NO_SHARD" or (strategy == "SHARD_GRAD_OP" and stage != "after step")
                start, end = (0, len(seen[full][name])) if whole else pieces[rank][name]
                assert values == pytest.approx(seen[full][name][start:end]), (rank, stage, name)


def _flat_params_kept_for_backward(strategy: str, use_orig_params: bool, mixed: bool) -> dict[str, Any]:
    fsdp = _fsdp()
    policy = fsdp.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16) if mixed else None
    options = dict(sharding_strategy=fsdp.ShardingStrategy[strategy], use_orig_params=use_orig_params)
    inner = _AccessModel()
    inner.lin1 = _FSDP(inner.lin1, mixed_precision=policy, **options)  # a nested unit, and the root with lin2
    model = _FSDP(inner, mixed_precision=policy, **options)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(10.0).view(2, 5) / 10 + dist.get_rank()

    def flat_params() -> list[dict[str, Any]]:
        rows = []
        for unit in _units(model):
            handle = unit._handle
            rows.append(
                {
                    "shape, dtype": (tuple(handle.flat_param.shape), handle.flat_param.dtype),
                    "is the local shard": handle.flat_param.data_ptr() == handle.flat_param._local_shard.data_ptr(),
                    "gathered storage kept": handle._get_padded_unsharded_flat_param().untyped_storage().size() > 0,
                    "_skipped_use_sharded_views": handle._skipped_use_sharded_views,
                }
            )
        return rows

    seen: dict[str, Any] = {}
    for step in range(2):
        out = model(x)
        seen[f"between forward and backward, step {step}"] = flat_params()
        out.sum().backward()
        seen[f"after backward, step {step}"] = flat_params()
        optim.step()
        optim.zero_grad()
    seen["full after"] = _full_params(model)
    return seen


@parameterized.expand([(s, uop) for s in ("FULL_SHARD", "SHARD_GRAD_OP") for uop in (False, True)])
def test_flat_param_shows_its_shard_while_kept_for_backward(strategy: str, use_orig_params: bool) -> None:
    """Mirrors test_fsdp_mixed_precision.py's nested SHARD_GRAD_OP case: after the forward of a unit that keeps its
    parameters gathered for backward (the root; SHARD_GRAD_OP units), the flat parameter is its full-precision local
    shard again while the gathered storage waits for backward (with use_orig_params and SHARD_GRAD_OP the original
    parameters keep the unsharded views: `_skipped_use_sharded_views`); training goes on as torch's."""
    for mixed in (False, True):
        _run(_flat_params_kept_for_backward, strategy, use_orig_params, mixed)


def _writeback(change_first_weight: bool, change_data: bool) -> dict[str, Any]:
    model = _FSDP(_AccessModel(), use_orig_params=True)
    inner = model.module
    target = inner.lin1 if change_first_weight else inner.lin2
    twos = nn.Parameter(torch.ones_like(target.weight) * 2)
    if change_data:
        target.weight.data = twos
    else:
        target.weight = twos
    full = _full_params(model)  # summon_full_params writes back first
    flat = model._handle.flat_param
    index = 0 if change_first_weight else 1
    info = flat._shard_param_infos[index]
    shard = flat._local_shard
    piece = shard[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard] if info.in_shard else shard[:0]
    return {"full": full, "local shard piece": _flat(piece), "local shard": _flat(shard)}


def test_writeback_of_changed_original_params_reaches_the_local_shard() -> None:
    """Mirrors test_fsdp_use_orig_params.py::test_param_writeback: replacing an original parameter, or its `.data`,
    by a tensor of its (sharded) shape is written back: summon_full_params shows it and the flat parameter's
    `_local_shard` holds it at the place `_shard_param_infos` gives."""
    cases = [(first, change_data) for first in (True, False) for change_data in (True, False)]
    for per_case in _run(_each, _writeback, cases):
        for (change_first_weight, _), seen in zip(cases, per_case, strict=True):
            name = "lin1.weight" if change_first_weight else "lin2.weight"
            assert seen["full"][name] == [2.0] * len(seen["full"][name])
            assert seen["local shard piece"] == [2.0] * len(seen["local shard piece"])


def _writeback_shape_mismatch() -> str:
    model = _FSDP(_AccessModel(), use_orig_params=True)
    inner = model.module
    layer = inner.lin1 if dist.get_rank() == 0 else inner.lin2  # one whose shard holds a piece of its weight
    shape = [n + 1 for n in layer.weight.shape]
    layer.weight = nn.Parameter(torch.randn(shape))
    layer.weight.grad = torch.randn(shape)
    try:
        with _fsdp().FullyShardedDataParallel.summon_full_params(model):
            pass
    except RuntimeError as error:
        return f"RuntimeError: {str(error).splitlines()[0][:40]}"
    return "no error"


def test_writeback_with_a_mismatched_shape_raises() -> None:
    """Mirrors test_fsdp_use_orig_params.py::test_writeback_shape_mismatch: an original parameter replaced by one
    of another shape cannot be written back into the flat parameter: RuntimeError("Cannot writeback ...")."""
    for seen in _run(_writeback_shape_mismatch):
        assert seen.startswith("RuntimeError: Cannot writeback"), seen


def _non_uniform_requires_grad() -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[0].bias.requires_grad = False
    model[1].bias.requires_grad = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = _FSDP(model, use_orig_params=True)
    flat = wrapped._handle.flat_param
    return {
        "requires_grad": [
            p.requires_grad for p in (wrapped[0].weight, wrapped[0].bias, wrapped[1].weight, wrapped[1].bias)
        ],
        "flat_param.requires_grad": flat.requires_grad,
        "warned": sorted(str(w.message).split(".")[0] for w in caught if "requires_grad" in str(w.message)),
    }


def test_non_uniform_requires_grad_is_kept_per_original_param() -> None:
    """Mirrors test_fsdp_use_orig_params.py::test_non_uniform_requires_grad: frozen biases and trainable weights
    flattened into one FlatParameter (use_orig_params=True) keep their own `requires_grad`."""
    for seen in _run(_non_uniform_requires_grad):
        assert seen["requires_grad"] == [True, False, True, False]


def _no_sync_flat_and_orig(strategy: str) -> list[dict[str, Any]]:
    model = nn.Linear(7, 1, bias=False)
    kwargs = {"sharding_strategy": _fsdp().ShardingStrategy[strategy]}
    reference = nn.Linear(7, 1, bias=False)
    reference.load_state_dict(model.state_dict())
    flat_model = _FSDP(reference, use_orig_params=False, **kwargs)
    orig_model = _FSDP(model, use_orig_params=True, **kwargs)
    x, grad = torch.randn(2, 7), torch.randn(2, 1)

    def pair() -> dict[str, Any]:
        (flat,), (orig,) = list(flat_model.parameters()), list(orig_model.parameters())
        numel = orig.numel()
        return {
            "numels": [flat.numel(), numel, flat.grad.numel(), list(orig.grad.shape)],
            "param": torch.equal(flat[:numel], orig.flatten()),
            "grad": torch.allclose(flat.grad[: orig.grad.numel()].reshape(orig.grad.shape), orig.grad),
            "grads": [_flat(flat.grad), _flat(orig.grad)],
        }

    seen = []
    for model_ in (flat_model, orig_model):
        model_(x).backward(grad)
    seen.append(pair())
    for model_ in (flat_model, orig_model):
        for p in model_.parameters():
            p.grad = None
        with model_.no_sync():
            model_(x).backward(grad)
    seen.append(pair())
    for model_ in (flat_model, orig_model):
        model_(x).backward(grad)
    seen.append(pair())
    return seen


@parameterized.expand([("FULL_SHARD",), ("SHARD_GRAD_OP",), ("NO_SHARD",)])
def test_no_sync_flat_param_against_original_params(strategy: str) -> None:
    """Mirrors test_fsdp_use_orig_params.py::test_no_sync_correctness: for nn.Linear(7, 1) the use_orig_params=False
    flat parameter starts with the use_orig_params=True parameter's values (sharded 4 + 3 and one padding), after a
    backward, inside no_sync() (where the flat gradient is the unsharded one) and after the synced backward that
    doubles the gradient, and their gradients agree."""
    for seen in _run(_no_sync_flat_and_orig, strategy):
        assert all(stage["param"] and stage["grad"] for stage in seen), seen
        first, last = seen[0]["grads"], seen[2]["grads"]
        for before, after in zip(first, last, strict=True):  # (flat, then original) gradients
            assert after == pytest.approx([2 * g for g in before]), seen


# ----------------------------------------------------------------------------------------------------------------------
# test_fsdp_misc


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 4)
        self.lin2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin1(x), self.lin2(x)


def _resharded_after_backward(strategy: str) -> dict[str, Any]:
    local = _TwoOutputs()
    model = _TwoOutputs()
    model.load_state_dict(local.state_dict())
    kwargs = {"sharding_strategy": _fsdp().ShardingStrategy[strategy]}
    model.lin1 = _FSDP(model.lin1, **kwargs)
    model = _FSDP(model, **kwargs)
    opt, opt_local = torch.optim.SGD(model.parameters(), lr=1e-3), torch.optim.SGD(local.parameters(), lr=1e-3)
    seen: dict[str, Any] = {"resharded": [], "losses": []}
    for step in range(4):
        t = torch.ones(4)
        (a, b), (la, lb) = model(t), local(t)
        loss, loss_local = ((a @ b).sum(), (la @ lb).sum()) if step < 2 else (a.sum(), la.sum())
        loss.backward()
        loss_local.backward()
        for handle in _traversal()._get_fsdp_handles(model):
            flat = handle.flat_param
            freed = _freed(flat._full_param_padded) if handle.uses_sharded_strategy else None
            seen["resharded"].append([freed, flat.data_ptr() == flat._local_shard.data_ptr()])
        opt.step()
        opt_local.step()
        full = _full_params(model)
        seen["losses"].append(loss.item())
        seen.setdefault("matches local", []).append(
            {name: full[name] == pytest.approx(_flat(p)) for name, p in local.named_parameters()}
        )
        opt.zero_grad()
        opt_local.zero_grad()
    return seen


@parameterized.expand([("FULL_SHARD",), ("SHARD_GRAD_OP",), ("NO_SHARD",)])
def test_units_resharded_after_backward_with_unused_outputs(strategy: str) -> None:
    """Mirrors test_fsdp_misc.py::test_fsdp_not_all_outputs_used_in_loss: after each backward, also when an output
    goes unused, every handle's `_full_param_padded` storage is freed (sharded strategies) and its flat parameter
    points at `_local_shard` again; the parameters follow local training."""
    for seen in _run(_resharded_after_backward, strategy):
        for freed, at_local_shard in seen["resharded"]:
            assert freed in (True, None) and at_local_shard, seen["resharded"]
        assert all(all(step.values()) for step in seen["matches local"]), seen["matches local"]


class _AB(nn.Module):
    def __init__(self, use_second_layer: bool) -> None:
        super().__init__()
        self.use_second_layer = use_second_layer
        self.a = nn.Linear(10, 10)
        self.b = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return (self.a(x), self.b(y)) if self.use_second_layer else self.a(x)


def _no_compute_grad(use_second_layer: bool, strategy: str | None) -> list[list[bool]]:
    strategy_kwargs = {"sharding_strategy": _fsdp().ShardingStrategy[strategy]} if strategy else {}
    model = _FSDP(_AB(use_second_layer), auto_wrap_policy=_wrap_api().always_wrap_policy, **strategy_kwargs)
    x, y = torch.randn(10, 10), torch.randn(10, 10)
    seen = []
    for _ in range(3):
        out = model(x, y)
        (out[0] if use_second_layer else out).sum().backward()
        a_grad = model.module.a._handle.flat_param.grad
        b_grad = model.module.b._handle.flat_param.grad
        seen.append([a_grad is not None, b_grad is None])
    return seen


def test_unit_whose_output_gets_no_gradient_has_no_flat_grad() -> None:
    """Mirrors test_fsdp_misc.py::test_fsdp_module_no_compute_grad: a unit used in forward (or not) whose output
    gets no gradient has `_handles[0].flat_param.grad` None, its sibling a gradient."""
    cases = [(use_second_layer, strategy) for use_second_layer in (True, False) for strategy in ("NO_SHARD", None)]
    for per_case in _run(_each, _no_compute_grad, cases):
        for case, seen in zip(cases, per_case, strict=True):
            assert all(a and b for a, b in seen), (case, seen)


def _homogeneous(attr: str | None) -> dict[str, Any]:
    from torch.distributed.fsdp._runtime_utils import HOMOGENEOUS_ATTR_NAMES

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    inner, outer = ({attr.lstrip("_"): False}, {attr.lstrip("_"): True}) if attr else ({}, {})
    model[1] = _FSDP(model[1], **inner)
    wrapped = _FSDP(model, **outer)
    seen: dict[str, Any] = {"names": list(HOMOGENEOUS_ATTR_NAMES)}
    seen["values"] = {name: [getattr(unit, name) for unit in _units(wrapped)] for name in HOMOGENEOUS_ATTR_NAMES}
    try:
        wrapped(torch.randn(2, 4))
    except ValueError as error:
        seen["error"] = str(error)
    seen["after forward"] = {n: [getattr(unit, n) for unit in _units(wrapped)] for n in HOMOGENEOUS_ATTR_NAMES}
    return seen


def test_homogeneous_attributes() -> None:
    """Mirrors test_fsdp_misc.py::test_homogeneous_attributes: `_runtime_utils.HOMOGENEOUS_ATTR_NAMES` names
    attributes every unit has, one value across the units of a model, taken from each unit's constructor arguments
    (`use_orig_params`, `limit_all_gathers`); when they differ the first forward raises
    ValueError("Expects one homogeneous value for ...")."""
    for seen in _run(_homogeneous, None):
        assert seen["names"][:2] == ["_use_orig_params", "limit_all_gathers"], seen
        assert "error" not in seen, seen
        for values in (*seen["values"].values(), *seen["after forward"].values()):
            assert len(values) == 2 and len(set(values)) == 1, seen
    for attr in ("_use_orig_params", "limit_all_gathers"):
        for seen in _run(_homogeneous, attr):
            assert seen["values"][attr] == [True, False], seen  # root, then the inner unit
            assert seen["error"] == f"Expects one homogeneous value for {attr} but got {{False, True}}", seen


def _optimizer_in_backward(use_orig_params: bool) -> dict[str, Any]:
    from torch.distributed.optim import _apply_optimizer_in_backward

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x + y))

    policy = _wrap_api().always_wrap_policy
    plain = _FSDP(Model(), auto_wrap_policy=policy, use_orig_params=use_orig_params)
    torch.manual_seed(0)
    overlap = _FSDP(Model(), auto_wrap_policy=policy, use_orig_params=use_orig_params)
    _apply_optimizer_in_backward(torch.optim.SGD, overlap.parameters(), {"lr": 0.03}, register_hook=False)
    optim = torch.optim.SGD(plain.parameters(), lr=0.03)
    seen: dict[str, Any] = {"grads": []}
    x = torch.randn(2, 2)
    try:
        for _ in range(2):
            plain(x, x).sum().backward()
            overlap(x, x).sum().backward()
            optim.step()
            optim.zero_grad()
            seen["grads"].append([p.grad is None for p in overlap.parameters()])
            seen.setdefault("sharded grads", []).append(
                [handle.sharded_grad is None for handle in _traversal()._get_fsdp_handles(overlap)]
            )
    except RuntimeError as error:
        return {"error": str(error)}
    seen["same params"] = _full_params(plain) == _full_params(overlap)
    return seen


def test_optimizer_in_backward_steps_during_backward() -> None:
    """Mirrors test_fsdp_misc.py::test_fsdp_optimizer_overlap and test_fsdp_optim_overlap_no_use_orig_params_error:
    with `_apply_optimizer_in_backward` and use_orig_params=True the parameters equal those of a separate optimizer
    step, with no gradient left on them (each handle's `sharded_grad` None); use_orig_params=False refuses it at
    the forward."""
    for seen in _run(_optimizer_in_backward, True):
        assert all(all(row) for row in seen["grads"]) and seen["same params"], seen
        assert all(all(row) for row in seen["sharded grads"]), seen
    for seen in _run(_optimizer_in_backward, False):
        assert "only supported with use_orig_params=True" in seen["error"], seen
