"""What torch's own FSDP1 tests check through FSDP1's internals, checked on ours next to torch's: mixed precision,
fine-tuning, wrapping, core and state-dict tests (the others, and what is not mirrored: test_torch_internal_checks.py).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from parameterized import parameterized
from torch import nn

import fsdp_legacy
import fsdp_legacy.collectives
from torch_side_by_side import (
    _FSDP,
    _each,
    _flat,
    _freed,
    _fsdp,
    _run,
    _run_both,
    _same,
    _traversal,
    _units,
    _without,
    _wrap_api,
)

# ----------------------------------------------------------------------------------------------------------------------
# test_fsdp_mixed_precision

_BUFFER_DTYPE = torch.float64
_MP_CONFIGS = {
    "fp16": dict(param_dtype=torch.float16, buffer_dtype=torch.float16, reduce_dtype=torch.float16),
    "only_reduce": dict(reduce_dtype=torch.float16),
    "only_param_and_buf": dict(param_dtype=torch.float16, buffer_dtype=torch.float16),
    "none": {},
    "diff_buffer_and_reduce": dict(param_dtype=torch.float16, buffer_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


class _LinearMP(nn.Module):
    """A linear that records, in its forward, what torch's mixed-precision test asserts there: the input and buffer
    dtypes, and per unit whether it is gathered (its flat parameter no longer at `_local_shard`), its dtype and its
    `_mp_shard` (freed once gathered, absent without param_dtype)."""

    def __init__(self, dtype: torch.dtype, buffer_name: str, log: list) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10, bias=False).to(dtype)
        self.buffer_name = buffer_name
        self.register_buffer(buffer_name, torch.randn((1, 2), dtype=_BUFFER_DTYPE))
        self.log = log
        self.root: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        units = []
        for unit in _units(self.root):
            params = unit.params
            flat = params[0]
            sharded = unit.sharding_strategy != _fsdp().ShardingStrategy.NO_SHARD and unit.world_size > 1
            active = sharded and flat.data.data_ptr() != flat._local_shard.data_ptr()
            mp_shard = ("freed" if _freed(flat._mp_shard) else "allocated") if hasattr(flat, "_mp_shard") else "absent"
            units.append([len(params), active, str(flat.dtype), mp_shard if active else None])
        self.log.append({"input": str(x.dtype), "buffer": str(getattr(self, self.buffer_name).dtype), "units": units})
        return self.lin(x)


@contextlib.contextmanager
def _reduce_dtypes(record: list) -> Iterator[None]:
    """Record the dtype of every floating-point tensor the gradient reductions communicate: what torch's FSDP1 hands
    c10d (reduce_scatter_single, or all_reduce with NO_SHARD), what ours hands its collectives (which on gloo run a
    reduce-scatter as an exchange of halves between two ranks, or as an all-reduce, and gather through the same
    exchange, so c10d's names alone would not tell a reduction from a gather)."""
    if _fsdp().FullyShardedDataParallel is fsdp_legacy.FullyShardedDataParallel:
        owner: Any = fsdp_legacy.collectives
        names = ["reduce_scatter", "reduce_scatter_pieces", "all_reduce"]
    else:
        owner = dist
        names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce") if hasattr(dist, n)]
    originals = {name: getattr(owner, name) for name in names}

    def recording(name: str) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            for t in (*args, *kwargs.values()):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    record.append(str(t.dtype))
            return originals[name](*args, **kwargs)

        return collective

    for name in names:
        setattr(owner, name, recording(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(owner, name, original)


def _mixed_precision_e2e(config: str, full_dtype_name: str, strategy: str, nested: bool) -> dict[str, Any]:
    fsdp = _fsdp()
    full_dtype = getattr(torch, full_dtype_name)
    mp = fsdp.MixedPrecision(**_MP_CONFIGS[config])
    kwargs = {"mixed_precision": mp, "sharding_strategy": fsdp.ShardingStrategy[strategy]}
    log: list = []
    if nested:
        first, second = _LinearMP(full_dtype, "buffer0", log), _LinearMP(full_dtype, "buffer1", log)
        model = _FSDP(nn.Sequential(_FSDP(first, **kwargs), second), **kwargs)
        layers = [first, second]
    else:
        layers = [_LinearMP(full_dtype, "buffer", log)]
        model = _FSDP(layers[0], **kwargs)
    for layer in layers:
        layer.__dict__["root"] = model  # (not as a submodule)
    optim = torch.optim.Adam(model.parameters())
    seen: dict[str, Any] = {"steps": []}

    def mp_shards() -> list[str]:
        return [
            ("freed" if _freed(p._mp_shard) else "allocated") if hasattr(p, "_mp_shard") else "absent"
            for unit in _units(model)
            for p in unit.params
        ]

    for _ in range(2):
        step_seen: dict[str, Any] = {}
        log.clear()
        out = model(torch.randn(3, 10, dtype=full_dtype) + dist.get_rank())
        step_seen["in forward"] = list(log)
        step_seen["buffers after forward"] = [str(b.dtype) for b in model.buffers()]
        step_seen["mp shards after forward"] = mp_shards()
        step_seen["full_param_padded"] = [
            str(p._full_param_padded.dtype)
            for unit in _units(model)
            for p in unit.params
            if hasattr(p, "_full_param_padded")
        ]
        loss = out.sum()
        step_seen["loss"] = str(loss.dtype)
        reduced: list = []
        with _reduce_dtypes(reduced):
            loss.backward()
        step_seen["reduce dtypes"] = sorted(set(reduced))
        step_seen["mp shards after backward"] = mp_shards()
        step_seen["params and grads"] = sorted(
            {str(p.dtype) for p in model.parameters()}
            | {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        )
        optim.step()
        optim.zero_grad()
        with fsdp.FullyShardedDataParallel.summon_full_params(model):
            step_seen["summoned"] = [mp_shards(), sorted({str(p.dtype) for p in model.parameters()})]
        step_seen["state dict"] = {k: str(v.dtype) for k, v in model.state_dict().items()}
        step_seen["buffers after state dict"] = [str(b.dtype) for b in model.buffers()]
        seen["steps"].append(step_seen)
    return seen


_MP_CASES = [
    ("fp16", "float32", "FULL_SHARD", False),
    ("fp16", "float32", "FULL_SHARD", True),
    ("only_reduce", "float32", "FULL_SHARD", True),
    ("only_param_and_buf", "float64", "FULL_SHARD", True),
    ("none", "float32", "FULL_SHARD", True),
    ("diff_buffer_and_reduce", "float64", "SHARD_GRAD_OP", False),  # (nested: see the module docstring)
    ("fp16", "float32", "NO_SHARD", True),
]


@parameterized.expand(_MP_CASES)
def test_mixed_precision_shards_and_dtypes(config: str, full_dtype: str, strategy: str, nested: bool) -> None:
    """Mirrors test_fsdp_mixed_precision.py::_run_test_mixed_precision_e2e (test_mixed_precision_e2e_full_shard,
    test_mixed_precision_no_reshard_after_forward): inside forward, each gathered unit's flat parameter (`params`,
    off its `_local_shard`) is in param_dtype with its `_mp_shard` freed (absent without param_dtype), units not
    gathered in full precision; inputs and buffers cast; gradients reduced in reduce_dtype (else param_dtype, else
    full precision); after backward and inside summon_full_params parameters and gradients in full precision with
    `_mp_shard` freed; the state dict in the original dtypes."""
    mp = _MP_CONFIGS[config]
    full = f"torch.{full_dtype}"
    param = str(mp.get("param_dtype") or full)
    reduce = str(mp.get("reduce_dtype") or mp.get("param_dtype") or full)
    buffer = str(mp.get("buffer_dtype") or _BUFFER_DTYPE)
    shard = "freed" if "param_dtype" in mp else "absent"
    for seen in _run(_mixed_precision_e2e, config, full_dtype, strategy, nested):
        for step in seen["steps"]:
            for record in step["in forward"]:
                assert record["input"] == param and record["buffer"] == buffer, record
                for n_params, active, dtype, mp_shard in record["units"]:
                    assert n_params == 1
                    assert dtype == (param if active else full) or strategy == "NO_SHARD", record
                    assert mp_shard in (shard, None), record
            if strategy != "NO_SHARD":
                assert any(unit[1] for record in step["in forward"] for unit in record["units"]), step
            assert (
                step["mp shards after forward"]
                == step["mp shards after backward"]
                == [shard] * len(step["mp shards after backward"])
                or strategy == "NO_SHARD"
            ), step
            assert step["reduce dtypes"] == [reduce] and step["params and grads"] == [full], step
            assert step["summoned"][1] == [full] and step["loss"] == param, step
            assert set(step["buffers after forward"]) == set(step["buffers after state dict"]) == {buffer}, step
            assert all(v == (str(_BUFFER_DTYPE) if "buffer" in k else full) for k, v in step["state dict"].items())


# ----------------------------------------------------------------------------------------------------------------------
# test_fsdp_fine_tune

_NUM_LINEARS = 4


def _seq_with_frozen() -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(_NUM_LINEARS):
        layers += [nn.Linear(5, 5), nn.ReLU()]
    seq = nn.Sequential(*layers)
    _set_requires_grad(seq, False)
    return seq


def _set_requires_grad(seq: nn.Module, requires_grad: bool) -> None:
    for i in range(0, _NUM_LINEARS, 2):  # every other linear
        for param in seq[i * 2].parameters():
            param.requires_grad = requires_grad


def _backward_reshard(strategy: str, use_orig_params: bool) -> list[Any]:
    seen = []
    for inp_requires_grad in (False, True):
        for unfreeze in (False, True):
            seq = _FSDP(
                _seq_with_frozen(),
                auto_wrap_policy=_wrap_api().ModuleWrapPolicy({nn.Linear}),
                sharding_strategy=_fsdp().ShardingStrategy[strategy],
                use_orig_params=use_orig_params,
            )
            for step in range(3):
                if unfreeze and step == 2:
                    _set_requires_grad(seq, True)
                x = torch.randn(8, 5, requires_grad=inp_requires_grad)
                if step == 1:
                    with torch.no_grad():
                        seq(x)
                    continue
                seq(x).sum().backward()
                handles = _traversal()._get_fsdp_handles(seq)
                seen.append(
                    {
                        "at local shard": [
                            h.flat_param.data_ptr() == h.flat_param._local_shard.data_ptr() for h in handles
                        ],
                        "freed": [
                            not h.uses_sharded_strategy or _freed(h.flat_param._full_param_padded) for h in handles
                        ],
                        "idle": [h._training_state.name for h in handles],
                        "all require grad": all(p.requires_grad for p in seq.parameters()),
                        "expect all": unfreeze and step == 2,
                    }
                )
    return seen


@parameterized.expand([("FULL_SHARD",), ("SHARD_GRAD_OP",), ("NO_SHARD",)])
def test_frozen_units_reshard_after_backward(strategy: str) -> None:
    """Mirrors test_fsdp_fine_tune.py::test_backward_reshard_hooks: with every other Linear frozen (its own unit),
    after each backward, also after a no_grad step and whether or not the input requires grad, every handle from
    `_get_fsdp_handles` is resharded (the flat parameter at `_local_shard`, `_full_param_padded` freed) and IDLE;
    unfreezing on the last step makes every parameter require grad. (torch's test counts calls of its private
    `_post_backward_reshard`, which ours never calls: this observes the resharding itself.)

    One difference, in ours' favour: with SHARD_GRAD_OP and use_orig_params=False, torch leaves the first, frozen
    unit's gathered `_full_param_padded` allocated after a backward whose input needs no grad (no pre-backward hook
    runs there, and its catch-all reshard takes the unit for resharded, since the flat parameter already points at
    the shard after forward); ours frees it. Everything else, this included on every other unit, is torch's."""
    for use_orig_params in (False, True):
        for rank, both in enumerate(_run_both(_backward_reshard, strategy, use_orig_params)):
            for mine, theirs in zip(both["ours"], both["torch"], strict=True):
                assert all(mine["at local shard"]) and all(mine["freed"]) and set(mine["idle"]) == {"IDLE"}, mine
                assert mine["all require grad"] or not mine["expect all"], mine
                _same(_without(mine, "freed"), _without(theirs, "freed"), f"rank {rank}")
                kept_by_torch = [i for i, freed in enumerate(theirs["freed"]) if not freed]
                assert kept_by_torch in ([], [0]), (rank, theirs)
                if kept_by_torch:
                    assert (strategy, use_orig_params) == ("SHARD_GRAD_OP", False), (rank, theirs)


# ----------------------------------------------------------------------------------------------------------------------
# test_wrap


class _LoraAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)
        self.lora_A = nn.Linear(8, 2, bias=False)
        self.lora_B = nn.Linear(2, 8, bias=False)
        self.k_proj = nn.Linear(8, 8, bias=False)
        self.v_proj = nn.Linear(8, 8, bias=False)
        self.o_proj = nn.Linear(8, 8, bias=False)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            proj.weight.requires_grad_(False)


class _LoraDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _LoraAttention()
        self.mlp = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False))
        self.inp_layernorm = nn.LayerNorm(8)
        self.mlp.requires_grad_(False)
        self.inp_layernorm.requires_grad_(False)


class _LoraModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(20, 8)
        self.layers = nn.ModuleList([_LoraDecoder() for _ in range(2)])
        self.norm = nn.LayerNorm(8)
        self.embed_tokens.requires_grad_(False)
        self.norm.requires_grad_(False)


def _frozen_params_check(use_orig_params: bool) -> list[str]:
    """Wraps the LoRA model with policies choosing ever more modules, as torch's test hands `_validate_frozen_params`
    ever larger sets; reports what each construction warned or raised about mixed requires_grad."""
    steps = [
        ("lora only", lambda name, module: "lora_" in name, False),
        ("and attention", lambda name, module: "lora_" in name or isinstance(module, _LoraAttention), False),
        (
            "and decoders",
            lambda name, module: "lora_" in name or isinstance(module, (_LoraAttention, _LoraDecoder)),
            False,
        ),
        (
            "not lora_A",
            lambda name, module: "lora_B" in name or isinstance(module, (_LoraAttention, _LoraDecoder)),
            False,
        ),
        (
            "lora_A ignored",
            lambda name, module: "lora_B" in name or isinstance(module, (_LoraAttention, _LoraDecoder)),
            True,
        ),
    ]
    seen = []
    for label, choose, ignore_lora_a in steps:
        torch.manual_seed(0)
        model = _LoraModel()
        targets = {module for name, module in model.named_modules() if choose(name, module)}
        policy = _wrap_api().CustomPolicy(lambda module, targets=targets: module in targets)
        ignored = [p for n, p in model.named_parameters() if "lora_A" in n] if ignore_lora_a else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _FSDP(model, auto_wrap_policy=policy, use_orig_params=use_orig_params, ignored_states=ignored)
                outcome = "built"
            except ValueError as error:
                outcome = f"ValueError: {error}"
        warned = [str(w.message) for w in caught if "requires_grad=True and False" in str(w.message)]
        seen.append(f"{label}: {outcome}; warned: {warned}")
    return seen


@parameterized.expand([(True,), (False,)])
def test_validate_frozen_params_messages(use_orig_params: bool) -> None:
    """Mirrors test_wrap.py::test_validate_frozen_params (torch's wrap-time `_wrap_utils._validate_frozen_params`):
    wrapping a LoRA model's adapters, attention and decoders separately passes; a unit left with trainable and frozen
    parameters (lora_A not wrapped) warns with use_orig_params=True and raises ValueError with False, in the same
    words, naming `layers.0.attn` and its parameters; ignoring those adapters' parameters passes again."""
    for seen in _run(_frozen_params_check, use_orig_params):
        assert all(line.endswith("built; warned: []") for i, line in enumerate(seen) if i != 3), seen
        mixed = seen[3]
        assert "layers.0.attn has both parameters with requires_grad=True and False." in mixed, mixed
        if use_orig_params:
            assert mixed.startswith("not lora_A: built;") and "layers.1.attn has both" in mixed, mixed
        else:
            assert mixed.startswith("not lora_A: ValueError: layers.0.attn") and mixed.endswith("warned: []"), mixed


# ----------------------------------------------------------------------------------------------------------------------
# test_fsdp_core


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


def _pre_backward_hooks(after_state_dict: bool) -> list[int]:
    model = _FSDP(_Nested(), auto_wrap_policy=_wrap_api().ModuleWrapPolicy({nn.Sequential}))
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if after_state_dict:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            optim.step()
        model.load_state_dict(model.state_dict())
    optim.zero_grad()
    output = model(torch.randn(2, 4))
    counts = [len(output._backward_hooks)]
    output.sum().backward()
    counts.append(len(output._backward_hooks))
    optim.step()
    counts.append(len(output._backward_hooks))
    return counts


@parameterized.expand([(False,), (True,)])
def test_pre_backward_hook_on_forward_output(after_state_dict: bool) -> None:
    """Mirrors test_fsdp_core.py::test_pre_backward_hook_registration(_after_state_dict): the root's forward output
    carries one backward hook (`output._backward_hooks`), still there after backward and the optimizer step, also
    after a state_dict save and load."""
    for seen in _run(_pre_backward_hooks, after_state_dict):
        assert seen == [1, 1, 1], seen


def _views_are_tensors(strategy: str, use_orig_params: bool) -> list[Any]:
    seen: list[Any] = []
    linears = [nn.Linear(3, 3) for _ in range(4)]
    for index, linear in enumerate(linears):
        linear.register_forward_pre_hook(
            lambda m, args, i=index: seen.append(["forward", i, type(m.weight).__name__, list(m.weight.shape)])
        )
        linear.register_full_backward_pre_hook(
            lambda m, grad, i=index: seen.append(["backward", i, type(m.weight).__name__, list(m.weight.shape)])
        )
    model = _FSDP(
        nn.Sequential(*linears),
        sharding_strategy=_fsdp().ShardingStrategy[strategy],
        use_orig_params=use_orig_params,
        auto_wrap_policy=_wrap_api().ModuleWrapPolicy({nn.Linear}),
        forward_prefetch=True,
    )
    for _ in range(2):
        model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    return seen


@parameterized.expand([(False,), (True,)])
def test_unsharded_params_are_tensor_views_in_forward_and_backward(use_orig_params: bool) -> None:
    """Mirrors test_fsdp_core.py::test_unshard_params_as_tensors: during forward and backward the modules hold
    their unsharded parameters as plain Tensor views, not nn.Parameters (torch's test patches its private
    `FlatParamHandle._use_unsharded_views`; this reads the module attributes those views land in)."""
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for seen in _run(_views_are_tensors, strategy, use_orig_params):
            assert {(row[2], tuple(row[3])) for row in seen} == {("Tensor", (3, 3))}, seen


def _param_change_after_init(use_orig_params: bool) -> dict[str, Any]:
    x = torch.randn(2, 4)
    outputs = []
    for change in (False, True):
        torch.manual_seed(0)
        model = _FSDP(
            _Nested(), auto_wrap_policy=_wrap_api().ModuleWrapPolicy({nn.Sequential}), use_orig_params=use_orig_params
        )
        first = next(model.parameters())
        shape = list(first.shape)
        if change:
            torch.manual_seed(1)
            nn.init.normal_(first.data)
        outputs.append(_flat(model(x)))
    flat = model._handle.flat_param
    return {
        "outputs": outputs,
        "first param": [isinstance(first, _fsdp().FlatParameter), shape],
        "shard": [list(flat._sharded_size), flat._shard_numel_padded, list(flat._padded_unsharded_size)],
    }


@parameterized.expand([(False,), (True,)])
def test_param_change_after_init_persists(use_orig_params: bool) -> None:
    """Mirrors test_fsdp_core.py::test_param_change_after_init: changing the first parameter (the root's flat
    parameter shard, or its first original parameter's view) in place after construction changes the output; the
    root's `_handle.flat_param` has torch's shard size and padding."""
    for seen in _run(_param_change_after_init, use_orig_params):
        assert seen["outputs"][0] != seen["outputs"][1], seen
        assert seen["first param"][0] == (not use_orig_params), seen


# ----------------------------------------------------------------------------------------------------------------------
# test_fsdp_state_dict


class _SDModel(nn.Module):
    """torch's state-dict test Model: an inner Linear (a unit of its own, or ignored) used twice, an outer one."""

    def __init__(self, wrap_inner: bool, buffers: bool = False, ignore_inner: bool = False, mixed: bool = False):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        if buffers:
            self.inner.register_buffer("buffer", torch.randn(5, 5))
            self.inner.register_buffer("non_persistent_buffer", torch.randn(5, 5), persistent=False)
        if wrap_inner:
            mp = _fsdp().MixedPrecision(torch.float16, torch.float16, torch.float16) if mixed else None
            self.inner = _FSDP(self.inner, ignored_modules=[self.inner] if ignore_inner else [], mixed_precision=mp)
        self.outer = nn.Linear(4, 5)
        if buffers:
            self.outer.register_buffer("buffer", torch.randn(5, 5))
            self.outer.register_buffer("non_persistent_buffer", torch.randn(5, 5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))


def _state_dict_keys() -> dict[str, Any]:
    from torch.distributed.fsdp._common_utils import FSDP_PREFIX
    from torch.distributed.fsdp._unshard_param_utils import FLAT_PARAM

    fsdp = _fsdp()
    model = _FSDP(_SDModel(wrap_inner=True))
    seen = {}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        with fsdp.FullyShardedDataParallel.state_dict_type(model, fsdp.StateDictType[kind]):
            seen[kind] = sorted(model.state_dict().keys())
    seen["local model"] = sorted(_SDModel(wrap_inner=False).state_dict().keys())
    seen["expected local"] = sorted([FLAT_PARAM, f"inner.{FLAT_PARAM}"])
    seen["named parameters"] = [name for name, _ in model.named_parameters()]
    seen["expected names"] = [f"{FSDP_PREFIX}inner.{FSDP_PREFIX}{FLAT_PARAM}", f"{FSDP_PREFIX}{FLAT_PARAM}"]
    return seen


def test_state_dict_keys_and_flat_param_names() -> None:
    """Mirrors test_fsdp_state_dict.py::test_fsdp_state_dict_keys: a LOCAL_STATE_DICT holds the keys
    `_unshard_param_utils.FLAT_PARAM` and `inner.<FLAT_PARAM>`; FULL and SHARDED state dicts the local model's keys;
    the flat parameters are named with `_common_utils.FSDP_PREFIX`."""
    for seen in _run(_state_dict_keys):
        assert seen["LOCAL_STATE_DICT"] == seen["expected local"], seen
        assert seen["FULL_STATE_DICT"] == seen["SHARDED_STATE_DICT"] == seen["local model"], seen
        assert sorted(seen["named parameters"]) == sorted(seen["expected names"]), seen


class _SkipModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 10, bias=False)
        self.linear_skip = nn.Linear(10, 10, bias=False)
        self.nested_linear = nn.Sequential(nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nested_linear(self.linear_skip(self.linear(x)))


def _state_dict_type_attribute() -> dict[str, Any]:
    fsdp, wrap_api = _fsdp(), _wrap_api()
    FSDP = fsdp.FullyShardedDataParallel
    with wrap_api.enable_wrap(wrapper_cls=FSDP, device_id=torch.device("cpu")):
        module = _SkipModel()
        module.nested_linear = wrap_api.wrap(module.nested_linear)
        model = wrap_api.wrap(module)

    def types() -> list[str]:
        return [unit._state_dict_type.name for unit in FSDP.fsdp_modules(model)]

    seen = {"units": len(FSDP.fsdp_modules(model)), "built": types()}
    with FSDP.state_dict_type(model, fsdp.StateDictType.LOCAL_STATE_DICT):
        seen["inside LOCAL context"] = types()
    seen["after the context"] = types()
    FSDP.set_state_dict_type(model, fsdp.StateDictType.SHARDED_STATE_DICT)
    seen["after set_state_dict_type"] = types()
    try:
        with FSDP.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT, fsdp.LocalStateDictConfig()):
            pass
        seen["wrong config"] = "accepted"
    except RuntimeError as error:
        seen["wrong config"] = str(error).split(",")[0][:40]
    seen["after the wrong config"] = types()
    return seen


def test_state_dict_type_attribute_on_every_unit() -> None:
    """Mirrors test_fsdp_state_dict.py::test_state_dict_type and test_wrong_state_dict_config: every unit's
    `_state_dict_type` is FULL_STATE_DICT after a `state_dict_type(LOCAL_STATE_DICT)` context exits (LOCAL inside
    it), set_state_dict_type sets it on every unit, and a config of the wrong type raises RuntimeError("Expected
    state_dict_config of type ...")."""
    for seen in _run(_state_dict_type_attribute):
        n = seen["units"]
        assert n == 2 and seen["built"] == seen["after the context"] == ["FULL_STATE_DICT"] * n, seen
        assert seen["inside LOCAL context"] == ["LOCAL_STATE_DICT"] * n, seen
        assert seen["after set_state_dict_type"] == ["SHARDED_STATE_DICT"] * n, seen
        assert seen["wrong config"].startswith("Expected state_dict_config of type"), seen


def _ignored_state_dict(state_dict_type: str, prefix: bool, ignore_inner: bool, mixed: bool) -> dict[str, Any]:
    fsdp = _fsdp()
    model = _SDModel(wrap_inner=True, buffers=True, ignore_inner=ignore_inner, mixed=mixed)
    kept = {"outer.bias": model.outer.bias, "outer.weight": model.outer.weight, "outer.buffer": model.outer.buffer}
    if ignore_inner:
        kept.update({"inner.bias": model.inner.module.bias, "inner.weight": model.inner.module.weight})
    if ignore_inner or not mixed:
        kept["inner.buffer"] = model.inner.module.buffer
    mp = fsdp.MixedPrecision(torch.float16, torch.float16, torch.float16) if mixed else None
    wrapped = _FSDP(model, ignored_modules=[model.outer], mixed_precision=mp)
    pre = "foo." if prefix else ""
    seen: dict[str, Any] = {}
    with fsdp.FullyShardedDataParallel.state_dict_type(wrapped, fsdp.StateDictType[state_dict_type]):
        first = wrapped.state_dict(prefix=pre)
        second = wrapped.state_dict(prefix=pre)
    seen["keys"] = sorted(first)
    seen["not cloned"] = {
        name: [first[pre + name].data_ptr() == t.data_ptr(), second[pre + name].data_ptr() == t.data_ptr()]
        for name, t in kept.items()
    }
    seen["buffer dtypes"] = {k: str(v.dtype) for k, v in first.items() if "buffer" in k}
    return seen


def test_state_dict_with_ignored_modules_keeps_their_tensors() -> None:
    """Mirrors test_fsdp_state_dict.py::test_state_dict_with_ignored_modules: the state dict (FULL and SHARDED,
    with and without a prefix) holds an ignored module's parameters and the buffers as the very tensors
    (`data_ptr`), at every save, buffers in full precision."""
    cases = list(itertools.product(("FULL_STATE_DICT", "SHARDED_STATE_DICT"), *[(True, False)] * 3))
    for per_case in _run(_each, _ignored_state_dict, cases):
        for case, seen in zip(cases, per_case, strict=True):
            assert all(all(v) for v in seen["not cloned"].values()), (case, seen)
            assert set(seen["buffer dtypes"].values()) == {"torch.float32"}, (case, seen)


def _local_state_dict_empty_rank() -> list[float]:
    fsdp = _fsdp()

    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.my_parameter = nn.Parameter(torch.full((1,), 3.1415926))

        def forward(self, x: Any) -> torch.Tensor:
            return self.my_parameter

    model = _FSDP(One())
    FSDP = fsdp.FullyShardedDataParallel
    seen = []
    with FSDP.state_dict_type(model, fsdp.StateDictType.LOCAL_STATE_DICT):
        model(None).sum().backward()
        saved = copy.deepcopy(model.state_dict())  # (a LOCAL state dict shares the shard's storage)
        with torch.no_grad(), FSDP.summon_full_params(model):
            seen.append(model.my_parameter.item())
            model.my_parameter.copy_(torch.full((1,), 1.75))
            seen.append(model.my_parameter.item())
        model.load_state_dict(saved)
        with FSDP.summon_full_params(model):
            seen.append(model.my_parameter.item())
    return seen


def test_local_state_dict_with_an_empty_rank() -> None:
    """Mirrors test_fsdp_state_dict.py::test_local_state_dict_with_empty_ranks: a one-element parameter on two ranks
    (one rank's shard is padding only) saves a LOCAL_STATE_DICT that loads back the value changed meanwhile."""
    for seen in _run(_local_state_dict_empty_rank):
        assert seen == pytest.approx([3.1415926, 1.75, 3.1415926]), seen
