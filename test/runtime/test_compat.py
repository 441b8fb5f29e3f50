"""The compatibility switch (fsdp_legacy.install / FSDP_LEGACY=1) and the FSDP1 internals frameworks read.

Oracles: torch's own FSDP1 (the same attributes, values and training under a framework-style dtype change) and
torch's DSD helpers on torch's FSDP1 (the same state dicts from the same helpers on our model).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as torch_dsd
from test_optim_state import adam, train
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

import fsdp_legacy
from fsdp_legacy import wrap as our_wrap
from fsdp_utils import Config, assert_close, batch, build_ours, build_torch_fsdp, loss_of, switched_on
from harness import run_on_ranks

FSDP1_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp.api",
    "torch.distributed.fsdp.fully_sharded_data_parallel",
    "torch.distributed.fsdp.wrap",
    "torch.distributed.fsdp.sharded_grad_scaler",
)


def _namespaces() -> dict[str, dict[str, object]]:
    modules = [importlib.import_module(name) for name in FSDP1_MODULES]  # all imported before any snapshot
    return {module.__name__: dict(vars(module)) for module in modules}


def test_install_puts_our_names_under_torch_and_uninstall_restores_them() -> None:
    before = _namespaces()
    with switched_on():
        fsdp_legacy.install()  # idempotent
        assert fsdp_legacy.installed()
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy, StateDictType
        from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as Deep
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy, _or_policy, enable_wrap, transformer_auto_wrap_policy

        assert FullyShardedDataParallel is Deep is fsdp_legacy.FullyShardedDataParallel
        assert (MixedPrecision, ShardingStrategy, StateDictType) == (
            fsdp_legacy.MixedPrecision,
            fsdp_legacy.ShardingStrategy,
            fsdp_legacy.StateDictType,
        )
        assert ShardedGradScaler is fsdp_legacy.ShardedGradScaler
        assert (ModuleWrapPolicy, _or_policy, enable_wrap, transformer_auto_wrap_policy) == (
            our_wrap.ModuleWrapPolicy,
            our_wrap._or_policy,
            our_wrap.enable_wrap,
            our_wrap.transformer_auto_wrap_policy,
        )
        assert torch_dsd.FSDP is fsdp_legacy.FullyShardedDataParallel  # a module that imported it before
    fsdp_legacy.uninstall()  # idempotent
    assert not fsdp_legacy.installed()
    after = _namespaces()
    for name in FSDP1_MODULES:
        assert after[name].keys() == before[name].keys(), name
        assert all(after[name][k] is v for k, v in before[name].items()), name
    assert torch_dsd.FSDP is before["torch.distributed.fsdp"]["FullyShardedDataParallel"]


def test_uninstall_restores_torch_modules_first_imported_while_on() -> None:
    """A torch module first imported under the switch (torch's DSD helpers, imported by a library's first save) bound
    our names: uninstall gives it torch's back, as it does for the modules loaded at install. Another module keeps
    what it bound, since it may name fsdp_legacy's objects on purpose."""
    torch_fsdp = importlib.import_module("torch.distributed.fsdp")
    common_utils = importlib.import_module("torch.distributed.fsdp._common_utils")
    theirs, their_state = torch_fsdp.FullyShardedDataParallel, common_utils._FSDPState
    names = ("torch._fsdp_legacy_probe", "fsdp_legacy_user_probe")
    try:
        with switched_on():
            for name in names:
                module = types.ModuleType(name)
                module.FSDP = torch_fsdp.FullyShardedDataParallel
                module.FSDPState = common_utils._FSDPState
                sys.modules[name] = module
        assert sys.modules[names[0]].FSDP is theirs
        assert sys.modules[names[0]].FSDPState is their_state
        assert sys.modules[names[1]].FSDP is fsdp_legacy.FullyShardedDataParallel
    finally:
        for name in names:
            sys.modules.pop(name, None)


def test_modules_that_imported_torch_names_before_the_switch_get_ours() -> None:
    import torch.distributed.fsdp as torch_fsdp

    framework = types.ModuleType("a_framework")
    framework.FSDP = torch_fsdp.FullyShardedDataParallel
    framework.Policy = torch_fsdp.wrap.ModuleWrapPolicy
    framework.unrelated = torch.nn.Linear
    sys.modules["a_framework"] = framework
    try:
        with switched_on():
            assert framework.FSDP is fsdp_legacy.FullyShardedDataParallel
            assert framework.Policy is our_wrap.ModuleWrapPolicy
            assert framework.unrelated is torch.nn.Linear
        assert framework.FSDP is torch_fsdp.FullyShardedDataParallel
        assert framework.Policy is torch_fsdp.wrap.ModuleWrapPolicy
    finally:
        del sys.modules["a_framework"]


class _Removed(importlib.abc.MetaPathFinder):
    """Pretends torch no longer ships a module, as when FSDP1 is removed upstream."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name == self.name:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


def test_a_module_torch_lacks_is_stood_in_for() -> None:
    name = "torch.distributed.fsdp.sharded_grad_scaler"
    parent = importlib.import_module("torch.distributed.fsdp")
    original = sys.modules.pop(name)
    had_attribute = "sharded_grad_scaler" in vars(parent)
    removed = vars(parent).pop("sharded_grad_scaler", None)
    finder = _Removed(name)
    sys.meta_path.insert(0, finder)
    try:
        with pytest.raises(ImportError):
            importlib.import_module(name)
        with switched_on():
            stand_in = importlib.import_module(name)
            assert stand_in.ShardedGradScaler is fsdp_legacy.ShardedGradScaler
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            assert ShardedGradScaler is fsdp_legacy.ShardedGradScaler
        assert name not in sys.modules
    finally:
        sys.meta_path.remove(finder)
        sys.modules[name] = original
        if had_attribute:
            parent.sharded_grad_scaler = removed


def _run(code: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "FSDP_LEGACY"} | env
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, cwd="/", timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.heavy  # fresh interpreters, about 12 s: CI runs it after the README's tests (pytest -m heavy)
def test_environment_variable_switches_at_interpreter_start_without_code_change() -> None:
    probe = (
        "import sys; early = 'torch' in sys.modules; "
        "from torch.distributed.fsdp import FullyShardedDataParallel as F; "
        "print(early, F.__module__, 'fsdp_legacy' in sys.modules)"
    )
    # Nothing is imported at start (a process that never uses FSDP pays nothing); torch's name is ours once used.
    assert _run(probe, FSDP_LEGACY="1") == "False fsdp_legacy.fully_sharded_data_parallel True"
    assert _run(probe) == "False torch.distributed.fsdp.fully_sharded_data_parallel False"
    assert _run(probe, FSDP_LEGACY="0") == "False torch.distributed.fsdp.fully_sharded_data_parallel False"


def test_torch_enum_members_equal_ours() -> None:
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState

    from fsdp_legacy.handle import HandleTrainingState as OurHandleState
    from fsdp_legacy.unit import TrainingState as OurState

    for theirs, ours in [
        (torch_fsdp.ShardingStrategy, fsdp_legacy.ShardingStrategy),
        (torch_fsdp.BackwardPrefetch, fsdp_legacy.BackwardPrefetch),
        (torch_fsdp.StateDictType, fsdp_legacy.StateDictType),
        (TrainingState, OurState),
        (HandleTrainingState, OurHandleState),
    ]:
        for member in theirs:
            assert member == ours[member.name] and ours[member.name] == member
            assert member in {ours[member.name]} and ours[member.name] in {member}
            assert all(member != other for other in ours if other.name != member.name)
    assert fsdp_legacy.ShardingStrategy.FULL_SHARD != torch_fsdp.StateDictType.FULL_STATE_DICT


# ----------------------------------------------------------------------------------------------------------------------
# FSDP1 internals frameworks read, against torch's FSDP1


def _internals(model: torch.nn.Module) -> list[tuple]:
    from torch.distributed.fsdp._common_utils import _is_fsdp_flattened

    rows = []
    for unit in type(model).fsdp_modules(model):
        flat = unit._flat_param
        row: tuple = (unit._has_params, unit._is_root)
        if unit._has_params:
            handle = unit._handle
            row += (
                tuple(flat._fqns),
                _is_fsdp_flattened(flat),
                handle.flat_param is flat,
                handle._orig_param_dtype,
                handle._offload_params,
                flat._local_shard.clone(),
            )
        rows.append(row)
    marks = sorted(
        {
            (type(m).__name__, getattr(m, "_is_fsdp_managed_module", None), getattr(m, "_fsdp_use_orig_params", None))
            for m in model.module.modules()
        }
    )
    return [rows, len(model._all_handles), marks]


def _internals_match_torch(use_orig_params: bool) -> None:
    config = Config("net", use_orig_params=use_orig_params)
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    for model in (ours, theirs):
        loss_of(model(batch(config, 0))).backward()
    ours_rows, ours_handles, ours_marks = _internals(ours)
    their_rows, their_handles, their_marks = _internals(theirs)
    assert (ours_handles, ours_marks) == (their_handles, their_marks)
    assert len(ours_rows) == len(their_rows)
    for a, b in zip(ours_rows, their_rows, strict=True):
        assert a[:-1] == b[:-1]
        if len(a) > 2:
            assert_close(a[-1], b[-1], "_local_shard")
    assert ours_rows[0][1] is True  # the root
    # CPU offload (torch's FSDP1 cannot offload on a machine without an accelerator, so analytically here)
    offloaded = build_ours(Config("net", extra={"cpu_offload": fsdp_legacy.CPUOffload(offload_params=True)}))[1]
    assert all(handle._offload_params for handle in offloaded._all_handles)
    assert not any(handle._offload_params for handle in ours._all_handles)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_private_attributes_frameworks_read_match_torch(use_orig_params: bool) -> None:
    run_on_ranks(_internals_match_torch, 2, use_orig_params)


def _upcast_like_accelerate(model: torch.nn.Module) -> None:
    """What Accelerate's prepare_model does to bf16 weights under mixed precision, right after wrapping."""
    for unit in type(model).fsdp_modules(model):
        if not unit._has_params:
            continue
        param = unit._flat_param
        if param.dtype != torch.float32 and param.requires_grad:
            param.data = param.data.to(torch.float32)
            unit._handle._orig_param_dtype = torch.float32


def _framework_upcast_matches_torch(use_orig_params: bool, strategy: str) -> None:
    import torch.distributed.fsdp as torch_fsdp

    def build(fsdp_module, wrap_module, **kwargs):  # type: ignore[no-untyped-def]
        import models

        torch.manual_seed(0)
        net = models.Net().to(torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fsdp_module.FullyShardedDataParallel(
                net,
                auto_wrap_policy=wrap_module.ModuleWrapPolicy({models.Block}),
                mixed_precision=fsdp_module.MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16),
                sharding_strategy=fsdp_module.ShardingStrategy[strategy],
                use_orig_params=use_orig_params,
                **kwargs,
            )

    ours = build(fsdp_legacy, our_wrap)
    theirs = build(torch_fsdp, torch_fsdp.wrap, device_id=torch.device("cpu"))
    results = []
    for model in (ours, theirs):
        _upcast_like_accelerate(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            loss = loss_of(model(batch(Config("net"), step).to(torch.bfloat16)).float())
            loss.backward()
            grad_dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        results.append((losses, grad_dtypes, [p.detach().clone() for p in model.parameters()]))
    (our_losses, our_grads, our_params), (their_losses, their_grads, their_params) = results
    assert our_grads == their_grads == {torch.float32}, "master weights and gradients in float32, as in torch"
    assert our_losses == their_losses
    for a, b in zip(our_params, their_params, strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert_close(a, b, "parameters after training")


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_upcast_of_flat_params_before_first_forward_changes_the_master_dtype_as_in_torch(
    use_orig_params: bool, strategy: str
) -> None:
    run_on_ranks(_framework_upcast_matches_torch, 2, use_orig_params, strategy)


def _lazy_init_and_state_lookup() -> None:
    _, ours = build_ours(Config("net"))
    with switched_on():
        from torch.distributed.fsdp._common_utils import _get_module_fsdp_state_if_fully_sharded_module
        from torch.distributed.fsdp._runtime_utils import _lazy_init

        assert _lazy_init(ours, ours) is ours
        assert ours._is_root and all(u._is_root is False for u in ours.fsdp_modules(ours)[1:])
        assert _get_module_fsdp_state_if_fully_sharded_module(ours) is ours
        assert _get_module_fsdp_state_if_fully_sharded_module(torch.nn.Linear(2, 2)) is None
        ours._assert_state(torch_fsdp_training_state().IDLE)


def torch_fsdp_training_state():  # type: ignore[no-untyped-def]
    from torch.distributed.fsdp._common_utils import TrainingState

    return TrainingState


def test_torch_private_functions_frameworks_call_work_on_our_units() -> None:
    run_on_ranks(_lazy_init_and_state_lookup, 2)


# ----------------------------------------------------------------------------------------------------------------------
# torch's DSD helpers on our models


def _local(value: object) -> object:
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        return shards[0].tensor if shards else None
    if isinstance(value, DTensor):
        return value.to_local()
    return value


def _flatten(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = _local(value)
    return out


def _torch_helpers_match_torch_fsdp1(use_orig_params: bool, full: bool) -> None:
    config = Config("net", use_orig_params=use_orig_params)
    options = StateDictOptions(full_state_dict=full)  # (torch FSDP1 crashes offloading to CPU on a CPU machine)
    theirs = build_torch_fsdp(config)
    their_opt = adam(theirs)
    train(theirs, their_opt, config, range(2))
    their_model, their_optim = torch_dsd.get_state_dict(theirs, their_opt, options=options)
    with switched_on():
        _, ours = build_ours(config)
        our_opt = adam(ours)
        train(ours, our_opt, config, range(2))
        our_model, our_optim = torch_dsd.get_state_dict(ours, our_opt, options=options)
        assert list(our_model) == list(their_model)
        assert list(our_optim["state"]) == list(their_optim["state"])
        ours_flat, theirs_flat = (
            _flatten({"m": our_model, "o": our_optim}),
            _flatten({"m": their_model, "o": their_optim}),
        )
        assert ours_flat.keys() == theirs_flat.keys()
        for key, value in ours_flat.items():
            if isinstance(value, torch.Tensor):
                assert_close(value, theirs_flat[key], key)
            else:
                assert value == theirs_flat[key], key
        # torch's set_state_dict restores what torch's FSDP1 saved into our model.
        fresh = build_ours(config, seed=1)[1]
        fresh_opt = adam(fresh)
        train(fresh, fresh_opt, config, range(1))
        torch_dsd.set_state_dict(
            fresh, fresh_opt, model_state_dict=their_model, optim_state_dict=their_optim, options=options
        )
        loaded_model, loaded_optim = torch_dsd.get_state_dict(fresh, fresh_opt, options=options)
        for key, value in _flatten({"m": loaded_model, "o": loaded_optim}).items():
            if isinstance(value, torch.Tensor):
                assert_close(value, theirs_flat[key], f"after set_state_dict: {key}")


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_torch_dsd_helpers_on_our_model_match_them_on_torch_fsdp1(use_orig_params: bool, full: bool) -> None:
    run_on_ranks(_torch_helpers_match_torch_fsdp1, 2, use_orig_params, full)


def _torch_helpers_refuse_without_switch() -> None:
    _, ours = build_ours(Config("net"))
    opt = adam(ours)
    for call in (
        lambda: torch_dsd.get_model_state_dict(ours),
        lambda: torch_dsd.get_state_dict(ours, opt),
        lambda: torch_dsd.get_optimizer_state_dict(ours, opt),
    ):
        with pytest.raises(RuntimeError, match=r"fsdp_legacy\.install\(\)"):
            call()
    dist.barrier()


def test_torch_dsd_helpers_without_the_switch_raise_naming_it() -> None:
    run_on_ranks(_torch_helpers_refuse_without_switch, 2)


# ----------------------------------------------------------------------------------------------------------------------
# Loading accepts what torch's FSDP1 accepts


class LoadsOnUse:
    """A tensor-like that materialises on first use, as Lightning's lazy checkpoint loader gives them: shape and
    dtype without loading, torch functions through __torch_function__, no tensor methods."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor, self.loads = tensor, 0
        self.shape, self.dtype = tensor.shape, tensor.dtype

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        def load(value):  # type: ignore[no-untyped-def]
            if isinstance(value, LoadsOnUse):
                value.loads += 1
                return value._tensor
            return value

        return func(*[load(a) for a in args], **{k: load(v) for k, v in (kwargs or {}).items()})


def _lazy(state: dict) -> dict:
    return {k: (LoadsOnUse(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in state.items()}


def _loads_tensor_likes_as_torch_does(use_orig_params: bool) -> None:
    import torch.distributed.fsdp as torch_fsdp
    from test_optim_state import osd, to_load

    config = Config("transformer", use_orig_params=use_orig_params)
    source, source_opt = build_ours(config)[1], None
    source_opt = adam(source)
    train(source, source_opt, config, range(2))
    full = fsdp_legacy.StateDictType.FULL_STATE_DICT.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp_legacy.FullyShardedDataParallel.state_dict_type(source, fsdp_legacy.StateDictType.FULL_STATE_DICT):
            model_state = source.state_dict()
    optim_state = osd(source, source_opt, fsdp_legacy, full)
    loaded = []
    for model, lib in ((build_ours(config, seed=1)[1], fsdp_legacy), (build_torch_fsdp(config, seed=1), torch_fsdp)):
        opt = adam(model)
        train(model, opt, config, range(1))
        lazy_model = _lazy(model_state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType.FULL_STATE_DICT):
                result = model.load_state_dict(lazy_model)
        assert not result.missing_keys and not result.unexpected_keys
        assert all(v.loads for v in lazy_model.values() if isinstance(v, LoadsOnUse)), "every value was used"
        lazy_optim = {
            "state": {k: _lazy(v) for k, v in optim_state["state"].items()},
            "param_groups": optim_state["param_groups"],
        }
        # torch's optim_state_dict_to_load takes real tensors only (ValueError: Unexpected value type); ours both
        opt.load_state_dict(to_load(model, opt, lib, full, lazy_optim if lib is fsdp_legacy else optim_state))
        with type(model).summon_full_params(model):
            params = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
        loaded.append((params, train(model, opt, config, range(2, 4))))
    (our_params, our_losses), (their_params, their_losses) = loaded
    for name, value in our_params.items():
        assert_close(value, their_params[name], f"loaded {name}")
    for a, b in zip(our_losses, their_losses, strict=True):
        assert_close(a, b, "training after loading lazily")


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_loading_accepts_tensor_likes_that_load_on_use(use_orig_params: bool) -> None:
    run_on_ranks(_loads_tensor_likes_as_torch_does, 2, use_orig_params)
