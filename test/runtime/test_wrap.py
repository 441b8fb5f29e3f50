"""fsdp_legacy.wrap against torch's own FSDP1 auto wrapping as the oracle.

torch's ``_auto_wrap`` (the function its FSDP constructor calls) accepts any wrapper class, so both
implementations wrap identical fresh models with the same dummy ``Wrapper``; we compare the resulting
trees, the per-unit kwargs, the legacy-policy calls, the warnings, and the mixed-precision marks.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.fsdp.wrap as torch_wrap
import torch.nn as nn
from parameterized import parameterized
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp._wrap_utils import _auto_wrap as torch_auto_wrap

import fsdp_legacy.wrap as our_wrap


class Wrapper(nn.Module):
    def __init__(self, module: nn.Module, **kwargs: Any):
        super().__init__()
        self.module = module
        self.kwargs = kwargs


# ---------------------------------------------------------------------------------------------
# Models


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 5)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(5, 3, bias=False)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 5)
        self.block = Block()
        self.l2 = nn.Linear(3, 2)
        self.register_buffer("buf", torch.zeros(2))


class TBlock(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 16, d: int = 8, n_layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(TBlock(d) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied


class AttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.mha = nn.MultiheadAttention(8, 2)  # own params 216, out_proj 72
        self.out = nn.Linear(8, 2)


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.bn = nn.BatchNorm1d(8)
        self.block = Block()
        self.head = nn.Linear(8, 5)


class SharedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(4, 4)
        self.a = nn.Sequential(shared, nn.ReLU())
        self.b = nn.Sequential(nn.Linear(4, 4), shared)


# model name -> (constructor, submodules to ignore)
MODELS: dict[str, tuple[Callable[[], nn.Module], list[str]]] = {
    "net": (Net, ["block"]),
    "transformer": (Transformer, ["layers.1"]),
    "attn": (AttnNet, ["mha"]),
    "bn": (BNNet, ["features"]),
    "shared": (SharedNet, ["b"]),
}


# ---------------------------------------------------------------------------------------------
# Policies, built from either implementation's module `w`


def _custom_fn(m: nn.Module) -> bool | dict[str, Any]:
    if isinstance(m, (Block, TBlock)):
        return {"sharding_strategy": "SHARD_GRAD_OP", "extra": 1}
    if isinstance(m, nn.Linear) and m.out_features in (2, 5):
        return True
    if isinstance(m, nn.LayerNorm):
        return {"mixed_precision": None}
    return {} if isinstance(m, nn.ReLU) else False


POLICIES: dict[str, Callable[[ModuleType], Any]] = {
    "always": lambda w: w.always_wrap_policy,
    "lambda": lambda w: functools.partial(w.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)),
    "transformer": lambda w: functools.partial(
        w.transformer_auto_wrap_policy, transformer_layer_cls={Block, TBlock, nn.MultiheadAttention}
    ),
    "size_default": lambda w: w.size_based_auto_wrap_policy,
    "size_1": lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=1),
    "size_20": lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=20),
    "size_60": lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=60),
    "size_300": lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=300),
    "size_custom_sets": lambda w: functools.partial(
        w.size_based_auto_wrap_policy,
        min_num_params=10,
        force_leaf_modules={Block},
        exclude_wrap_modules={nn.Sequential},
    ),
    "module_wrap": lambda w: w.ModuleWrapPolicy({Block, TBlock, nn.MultiheadAttention, nn.Sequential}),
    "module_wrap_bn": lambda w: w.ModuleWrapPolicy({nn.BatchNorm1d, nn.Embedding, nn.Linear}),
    "custom": lambda w: w.CustomPolicy(_custom_fn),
    "or": lambda w: functools.partial(
        w._or_policy,
        policies=[
            functools.partial(w.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.ReLU)),
            functools.partial(w.size_based_auto_wrap_policy, min_num_params=25),
        ],
    ),
}


@dataclass
class Outcome:
    tree: str  # repr of the wrapped model
    units: list[tuple[str, dict[str, Any]]]  # (FQN in the unwrapped model, kwargs) per wrapper
    calls: list[tuple[str, bool, int]]  # legacy policy calls: (FQN, recurse, nonwrapped_numel)
    warnings: list[str]
    fp32_marks: list[tuple[str, Any, int, int]]  # (FQN, _wrap_overrides, #pre hooks, #post hooks)


def _unit_name(wrapper_fqn: str) -> str:
    return ".".join(part for part in wrapper_fqn.split(".") if part != "module")


def run_auto_wrap(
    impl: str,
    model_name: str,
    make_policy: Callable[[ModuleType], Any],
    ignore: bool = False,
    mixed_precision: bool = False,
    **extra_kwargs: Any,
) -> Outcome:
    make_model, ignore_names = MODELS[model_name]
    model = make_model()
    names = {m: n for n, m in model.named_modules()}
    # As FSDP's constructor does: the ignored subtrees and all their parameters.
    ignored = {m for n in (ignore_names if ignore else []) for m in model.get_submodule(n).modules()}
    ignored_params = {p for m in ignored for p in m.parameters()}
    root_kwargs = {
        "sharding_strategy": "FULL_SHARD",
        "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16) if mixed_precision else None,
        "use_orig_params": False,
        **extra_kwargs,
    }
    policy = make_policy(our_wrap if impl == "ours" else torch_wrap)
    calls: list[tuple[str, bool, int]] = []
    if not hasattr(policy, "_run_policy"):
        inner = policy

        def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            calls.append((names[module], recurse, nonwrapped_numel))
            return inner(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if impl == "ours":
            our_wrap.auto_wrap(model, policy, Wrapper, ignored, ignored_params, root_kwargs)
        else:
            torch_auto_wrap(model, policy, ignored, ignored_params, root_kwargs, Wrapper)
    units = [
        # torch's legacy path leaves `auto_wrap_policy` out (defaulting to None); ours passes None.
        (_unit_name(n), {"auto_wrap_policy": None, **m.kwargs})
        for n, m in model.named_modules()
        if isinstance(m, Wrapper)
    ]
    marks = [
        (n, getattr(m, "_wrap_overrides", None), len(m._forward_pre_hooks), len(m._forward_hooks))
        for m, n in names.items()
    ]
    return Outcome(repr(model), units, calls, [str(w.message) for w in caught], marks)


CASES = list(itertools.product(MODELS, POLICIES, [False, True], [False, True]))


def _case_name(func: Callable, _: int, param: Any) -> str:
    model, policy, ignore, mp = param.args
    return f"{func.__name__}_{model}_{policy}{'_ignored' if ignore else ''}{'_mp' if mp else ''}"


@parameterized.expand(CASES, name_func=_case_name)
def test_matches_torch(model: str, policy: str, ignore: bool, mp: bool) -> None:
    ours = run_auto_wrap("ours", model, POLICIES[policy], ignore, mp)
    theirs = run_auto_wrap("torch", model, POLICIES[policy], ignore, mp)
    assert ours.units == theirs.units
    assert ours.tree == theirs.tree
    assert ours.calls == theirs.calls
    assert ours.warnings == theirs.warnings
    assert ours.fp32_marks == theirs.fp32_marks


def test_facts_on_net() -> None:
    def units(policy: Callable[[ModuleType], Any]) -> list[str]:
        return [name for name, _ in run_auto_wrap("ours", "net", policy).units]

    assert units(POLICIES["always"]) == ["l1", "block", "block.fc1", "block.act", "block.fc2", "l2"]
    assert units(POLICIES["size_20"]) == ["l1", "block.fc1"]
    assert units(POLICIES["size_default"]) == []
    assert units(POLICIES["module_wrap"]) == ["block"]


def test_mixed_precision_forces_descent_with_legacy_policies() -> None:
    # torch ORs the policy with an always-recursing class policy, so MHA stops being a forced leaf.
    plain = run_auto_wrap("ours", "attn", POLICIES["size_60"])
    with_mp = run_auto_wrap("ours", "attn", POLICIES["size_60"], mixed_precision=True)
    assert [n for n, _ in plain.units] == []  # MHA (296 params) is neither descended into nor wrapped
    assert [n for n, _ in with_mp.units] == ["mha", "mha.out_proj"]


def test_mixed_precision_override_and_fp32_hooks() -> None:
    out = run_auto_wrap("ours", "bn", POLICIES["module_wrap"], mixed_precision=True)
    units = dict(out.units)
    assert units["features.1"]["mixed_precision"] is None and units["bn"]["mixed_precision"] is None
    assert units["block"]["mixed_precision"] == MixedPrecision(param_dtype=torch.bfloat16)
    assert out.warnings == [
        (
            "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped module has "
            "submodules of type:\n{<class 'torch.nn.modules.batchnorm.BatchNorm1d'>}\n"
            f"These modules will be wrapped as separate FSDP {our_wrap._INSTANCES} with mixed precision disabled."
        )
    ]
    model = BNNet()
    with pytest.warns(UserWarning, match=our_wrap._INSTANCES):
        our_wrap.auto_wrap(
            model, our_wrap.always_wrap_policy, Wrapper, set(), set(), {"mixed_precision": MixedPrecision()}
        )
    bn = model.bn.module
    x = torch.randn(4, 8).bfloat16()
    with torch.no_grad():
        out = bn(x)  # runs in fp32, returns the input's dtype
        expected = nn.functional.batch_norm(x.float(), None, None, bn.weight, bn.bias, training=True)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected.bfloat16())
        assert bn(x.float()).dtype == torch.float32  # no cast back when the input was fp32


@parameterized.expand([("always",), ("module_wrap_bn",)])
def test_ignored_roots_are_expanded(policy: str) -> None:
    expanded = run_auto_wrap("torch", "net", POLICIES[policy], ignore=True)
    model = Net()
    our_wrap.auto_wrap(model, POLICIES[policy](our_wrap), Wrapper, {model.block}, set(), {"mixed_precision": None})
    assert repr(model) == expanded.tree


@parameterized.expand([("module_wrap",), ("custom",)])
def test_accepts_torch_policy_objects(policy: str) -> None:
    ours = run_auto_wrap("ours", "transformer", POLICIES[policy])
    model = Transformer()
    our_wrap.auto_wrap(
        model,
        POLICIES[policy](torch_wrap),
        Wrapper,
        set(),
        set(),
        {"sharding_strategy": "FULL_SHARD", "mixed_precision": None, "use_orig_params": False},
    )
    assert repr(model) == ours.tree


def test_root_is_never_wrapped() -> None:
    model = Net()
    our_wrap.auto_wrap(model, our_wrap.CustomPolicy(lambda m: True), Wrapper, set(), set(), {})
    assert type(model) is Net and isinstance(model.block, Wrapper)


# ---------------------------------------------------------------------------------------------
# Errors and warnings


@parameterized.expand([("module_wrap",), ("always",)])
def test_already_wrapped(policy: str) -> None:
    model = Net()
    model.block = Wrapper(model.block)
    expected = f"FSDP auto wrapping requires modules to not already have FSDP applied but found block in\n{model}"
    with pytest.raises(ValueError, match=re.escape(expected) + "$"):
        our_wrap.auto_wrap(model, POLICIES[policy](our_wrap), Wrapper, set(), set(), {})


def _error(fn: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_custom_policy_bad_return() -> None:
    def run(w: ModuleType) -> Any:
        return w.CustomPolicy(lambda m: 1 if isinstance(m, Block) else False)._run_policy(Net(), set(), {})

    ours, theirs = _error(lambda: run(our_wrap)), _error(lambda: run(torch_wrap))
    assert type(ours) is type(theirs) is ValueError and str(ours) == str(theirs)
    assert str(ours).endswith("but it returned 1")


def test_enable_wrap_and_wrap() -> None:
    for w in (our_wrap, torch_wrap):
        lin = nn.Linear(2, 2)
        assert w.wrap(lin, a=1) is lin  # outside the context
        with w.enable_wrap(wrapper_cls=Wrapper, a=1, b=2):
            wrapped = w.wrap(lin, b=3, c=4)
            bn = nn.BatchNorm1d(2)
            bn._wrap_overrides = {"c": 5}
            wrapped_bn = w.wrap(bn, c=4)
        assert isinstance(wrapped, Wrapper) and wrapped.module is lin
        assert wrapped.kwargs == {"a": 1, "b": 3, "c": 4}
        assert wrapped_bn.kwargs == {"a": 1, "b": 2, "c": 5}
        assert w.wrap(lin) is lin  # context cleared

    def nested(w: ModuleType) -> None:
        with w.enable_wrap(wrapper_cls=Wrapper), w.enable_wrap(wrapper_cls=Wrapper):
            pass

    ours, theirs = _error(lambda: nested(our_wrap)), _error(lambda: nested(torch_wrap))
    assert type(ours) is type(theirs) is NotImplementedError and str(ours) == str(theirs)
    assert our_wrap.wrap(lin) is lin  # the outer context was cleared on the way out


def _freeze(model: nn.Module, names: list[str]) -> nn.Module:
    for name in names:
        model.get_parameter(name).requires_grad_(False)
    return model


FROZEN_CASES = [
    # (params to freeze, policy), the frozen check applying to each unit's own params only
    (["block.fc1.weight"], "module_wrap"),  # block mixed
    (["block.fc1.weight", "block.fc1.bias"], "module_wrap"),  # block mixed, names in BFS order
    (["block.fc1.weight", "block.fc1.bias"], "module_wrap_bn"),  # fc1 its own unit: fine
    (["block.fc1.weight"], "module_wrap_bn"),  # block.fc1 mixed
    (["l1.weight"], "module_wrap"),  # only the root mixed; the root is not a policy target: fine
    (["l1.weight"], "custom_root"),  # ... unless the policy selects it
    (["block.fc1.weight"], "always"),  # legacy callables are not checked
]
POLICIES["custom_root"] = lambda w: w.CustomPolicy(lambda m: isinstance(m, (Net, Block)))


@parameterized.expand(
    [(f, p, uop) for (f, p), uop in itertools.product(FROZEN_CASES, [False, True])],
    name_func=lambda fn, i, param: f"{fn.__name__}_{i}_{param.args[1]}_uop{param.args[2]}",
)
def test_frozen_params(frozen: list[str], policy: str, use_orig_params: bool) -> None:
    def run(impl: str) -> tuple[str | None, list[str]]:
        make_model = MODELS["net"][0]
        MODELS["net"] = (lambda: _freeze(make_model(), frozen), MODELS["net"][1])
        try:
            return None, run_auto_wrap(impl, "net", POLICIES[policy], use_orig_params=use_orig_params).warnings
        except ValueError as e:
            return str(e), []
        finally:
            MODELS["net"] = (make_model, MODELS["net"][1])

    ours, theirs = run("ours"), run("torch")
    assert ours == theirs
    if use_orig_params:
        assert ours[0] is None
    if ours[0] is not None:
        assert "has both parameters with requires_grad=True and False. FSDP does not support" in ours[0]


def test_frozen_params_message() -> None:
    model = _freeze(Net(), ["block.fc1.weight"])
    with pytest.raises(ValueError) as info:
        our_wrap.auto_wrap(model, our_wrap.ModuleWrapPolicy({Block}), Wrapper, set(), set(), {})
    assert str(info.value) == (
        "block has both parameters with requires_grad=True and False. FSDP does not support wrapping such "
        "modules when use_orig_params=False. If possible, wrap the frozen parameters with FSDP separately.\n"
        "The following parameters have requires_grad=True:\n['block.fc1.bias', 'block.fc2.weight']\n"
        "The following parameters have requires_grad=False:\n['block.fc1.weight']"
    )
    assert not isinstance(model.block, Wrapper)  # checked before anything is wrapped


# ---------------------------------------------------------------------------------------------
# Surface


def test_public_surface_matches_torch() -> None:
    assert our_wrap.__all__ == torch_wrap.__all__
    names = [*torch_wrap.__all__, "_or_policy"]
    for name in names:
        ours, theirs = getattr(our_wrap, name), getattr(torch_wrap, name)
        if inspect.isclass(ours):
            ours, theirs = ours.__init__, theirs.__init__
        ours_sig, theirs_sig = inspect.signature(ours), inspect.signature(theirs)
        assert [(p.name, p.kind, p.default) for p in ours_sig.parameters.values()] == [
            (p.name, p.kind, p.default) for p in theirs_sig.parameters.values()
        ], name
    for attr in ("EXCLUDE_WRAP_MODULES", "FORCE_LEAF_MODULES"):
        assert getattr(our_wrap.size_based_auto_wrap_policy, attr) == getattr(
            torch_wrap.size_based_auto_wrap_policy, attr
        )
    assert inspect.isabstract(our_wrap._Policy)
    assert issubclass(our_wrap.ModuleWrapPolicy, our_wrap._Policy)
    assert issubclass(our_wrap.CustomPolicy, our_wrap._Policy)


def test_module_wrap_policy_repr_and_call() -> None:
    policy = our_wrap.ModuleWrapPolicy([Block])
    assert re.fullmatch(
        r"<fsdp_legacy\.wrap\.ModuleWrapPolicy object at 0x[0-9a-f]+>\(\{<class '.*Block'>\}\)", repr(policy)
    )
    assert policy(Net(), True) and not policy(Net(), False) and policy(Block(), False)
