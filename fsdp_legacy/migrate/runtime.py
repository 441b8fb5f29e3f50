"""The helpers migrated programs import where plain `fully_shard` code would not do what FSDP1 did.

`apply_fully_shard` shards the units an FSDP1 auto-wrap policy picks (size-based, lambda and custom policies cannot
be read from the source): the policy is evaluated by the traversal FSDP1's wrapper uses (fsdp_legacy.wrap.auto_wrap),
each unit sharded with `fully_shard`, children before parents, then the root; a unit still on the meta device is
materialized first, as FSDP1 materializes it (param_init_fn, or to_empty + reset_parameters), so the initial values
are FSDP1's. `full_params` is FSDP1's `summon_full_params` for code that reads: the full parameters, in their own
dtype (not the mixed-precision one `FSDPModule.unshard()` gives), are put on the modules for the block.
`apply_full` is FSDP1's `apply`: `fn` runs on the full parameters and what it changes in place reaches the shards.
`fsdp1_options` turns FSDP(...)'s keyword values known only at run time (a computed strategy, precision or offload)
into apply_fully_shard's, `fully_shard_fsdp1` is `FSDP(module, **kwargs)` all mapped at run time (for
`partial(FSDP, ...)`), and `hybrid_mesh` FSDP1's HYBRID_SHARD pair of process groups into FSDP2's 2-D mesh
(keywords_runtime.py); `unshared_optim_state`, `rekey_optim_state_dict` and `loaded_optim_state_dict` carry FSDP1's
optimizer state dicts over (optim_runtime.py); `full_state_dict_options` and `sharded_state_dict_options` build
FSDP1's state-dict configs as StateDictOptions at run time (options_runtime.py); `state_dict_beside` and
`load_state_dict_beside` another object's state-dict calls inside a block on one model (beside_runtime.py).
`without_gradient_sync(model)` is FSDP1's `model.no_sync()` where the context is a value, entered later."""

from __future__ import annotations

import collections
import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from ..wrap import LegacyPolicy, _Policy, auto_wrap
from .beside_runtime import load_state_dict_beside, state_dict_beside
from .keywords_runtime import fsdp1_options, hybrid_mesh
from .names import FSDP1_DROPPED_KWARGS
from .optim_runtime import loaded_optim_state_dict, rekey_optim_state_dict, unshared_optim_state
from .options_runtime import full_state_dict_options, sharded_state_dict_options, state_dict_type_options

__all__ = [
    "apply_full",
    "apply_fully_shard",
    "fsdp1_options",
    "full_params",
    "fully_shard_fsdp1",
    "full_state_dict_options",
    "hybrid_mesh",
    "load_state_dict_beside",
    "loaded_optim_state_dict",
    "rekey_optim_state_dict",
    "sharded_state_dict_options",
    "state_dict_beside",
    "state_dict_type_options",
    "unshared_optim_state",
    "without_gradient_sync",
]

# What auto_wrap adds to every unit's kwargs for FSDP1's wrapper; fully_shard takes neither.
_FSDP1_ONLY_KWARGS = ("auto_wrap_policy", "use_orig_params")


def _device() -> torch.device:
    """Where FSDP1 materializes and broadcasts (its device_id on a GPU machine, else the CPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _unit_modules(unit: nn.Module, ignored: set[nn.Module]) -> list[nn.Module]:
    """The modules a unit manages itself, breadth first from the unit (FSDP1's materialization order), stopping at
    units already sharded and at ignored modules."""
    found, queue, seen = [], collections.deque([unit]), {unit}
    while queue:
        module = queue.popleft()
        found.append(module)
        for child in module.children():
            if child not in seen and not isinstance(child, FSDPModule) and child not in ignored:
                seen.add(child)
                queue.append(child)
    return found


def _own_states(modules: list[nn.Module]) -> list[torch.Tensor]:
    return [t for m in modules for t in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False))]


def _materialize(modules: list[nn.Module], param_init_fn: Callable[[nn.Module], Any] | None) -> None:
    """What FSDP1 does to a unit with meta tensors before sharding it."""
    if not any(t.is_meta for t in _own_states(modules)):
        return  # FSDP1 calls param_init_fn only for a unit that needs it
    if param_init_fn is not None:
        for module in modules:
            param_init_fn(module)
    else:
        with torch.no_grad():
            for module in modules:
                if _own_states([module]):
                    module.to_empty(device=_device(), recurse=False)
                    module.reset_parameters()  # type: ignore[operator]
    if any(t.is_meta for t in _own_states(modules)):
        raise ValueError("param_init_fn left tensors on the meta device; FSDP1 would not have sharded them either")


def _broadcast(modules: list[nn.Module]) -> None:
    """FSDP1's sync_module_states for one unit: rank 0's values of what the unit manages, before it is sharded."""
    with torch.no_grad():
        for tensor in _own_states(modules):
            if isinstance(tensor, DTensor):
                continue
            staged = tensor.detach().to(_device())
            dist.broadcast(staged, src=0)
            tensor.detach().copy_(staged)


def _shard_in_place(
    param_init_fn: Callable[[nn.Module], Any] | None, sync_module_states: bool, ignored: set[nn.Module]
) -> type:
    """The wrapper class handed to auto_wrap: FSDP2 shards a module in place, so "wrapping" returns the same module,
    now an FSDPModule, after FSDP1's per-unit initialization."""

    class _ShardInPlace:
        def __new__(cls, module: nn.Module, **kwargs: Any) -> nn.Module:  # type: ignore[misc]
            modules = _unit_modules(module, ignored)
            _materialize(modules, param_init_fn)
            if sync_module_states:
                _broadcast(modules)
            fully_shard(module, **{k: v for k, v in kwargs.items() if k not in _FSDP1_ONLY_KWARGS})
            return module

    return _ShardInPlace


def apply_fully_shard(
    model: nn.Module,
    auto_wrap_policy: _Policy | LegacyPolicy | None,
    ignored_modules: Iterable[nn.Module] = (),
    param_init_fn: Callable[[nn.Module], Any] | None = None,
    sync_module_states: bool = False,
    buffer_dtype: torch.dtype | None = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Shard the units `auto_wrap_policy` picks in `model` (as FSDP1 picks them), then `model` itself, each with
    `fully_shard(unit, **fully_shard_kwargs)`; a CustomPolicy's per-unit dict updates the kwargs of its unit and must
    use fully_shard's names. Each unit is first materialized from the meta device and synced from rank 0 as FSDP1
    does with `param_init_fn` and `sync_module_states`; with `buffer_dtype` (FSDP1's MixedPrecision.buffer_dtype, which
    FSDP2's policy lacks) the floating-point buffers are cast to it once sharded. Returns `model`."""
    ignored = {m for top in ignored_modules for m in top.modules()}
    kwargs = dict(fully_shard_kwargs)
    # The ignored modules' parameters and any given (FSDP1's ignored_states of parameters): left out of every unit,
    # and out of the sizes a policy weighs, as FSDP1 leaves them.
    ignored_params = {p for m in ignored for p in m.parameters()} | set(kwargs.get("ignored_params") or ())
    if ignored_params:
        kwargs["ignored_params"] = ignored_params
    shard = _shard_in_place(param_init_fn, sync_module_states, ignored)
    if auto_wrap_policy is not None:
        with warnings.catch_warnings():
            # FSDP1's warning about a unit mixing frozen and trainable parameters in one flat parameter: FSDP2 keeps
            # each parameter apart, so it does not apply.
            warnings.filterwarnings("ignore", message=".*has both parameters with requires_grad")
            # use_orig_params=True: the flat-parameter uniformity check FSDP2 does not need is then only a warning.
            auto_wrap(model, auto_wrap_policy, shard, ignored, ignored_params, {"use_orig_params": True, **kwargs})
    shard(model, **kwargs)
    if buffer_dtype is not None:
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.data = buffer.data.to(buffer_dtype)
    return model


def fully_shard_fsdp1(
    module: nn.Module,
    *,
    sharding_strategy: Any = None,
    mixed_precision: Any = None,
    cpu_offload: Any = None,
    process_group: Any = None,
    device_mesh: Any = None,
    auto_wrap_policy: _Policy | LegacyPolicy | None = None,
    ignored_modules: Iterable[nn.Module] | None = None,
    param_init_fn: Callable[[nn.Module], Any] | None = None,
    sync_module_states: bool = False,
    **dropped: Any,
) -> nn.Module:
    """`FSDP(module, **kwargs)` with FSDP1's keywords, for where the class itself is handed on
    (`functools.partial(FSDP, sharding_strategy=..., ...)`, a factory's wrapper): every value is mapped at run time
    as FSDP1 applies it (fsdp1_options: the strategy, precision, offload, group or mesh; apply_fully_shard: the
    policy's units, ignored modules, initialization, sync_module_states, buffer_dtype's cast), and the module,
    sharded in place, is returned. The keywords FSDP2 does without (use_orig_params, limit_all_gathers, device_id,
    the prefetch settings) are taken and dropped; any other raises TypeError, as FSDP1 would for a wrong one."""
    unknown = sorted(set(dropped) - FSDP1_DROPPED_KWARGS)
    if unknown:
        raise TypeError(f"fully_shard_fsdp1: FSDP(...) keyword(s) {unknown} are not mapped onto FSDP2")
    options = fsdp1_options(sharding_strategy, mixed_precision, cpu_offload, process_group, device_mesh)
    return apply_fully_shard(
        module, auto_wrap_policy, ignored_modules or (), param_init_fn, bool(sync_module_states), **options
    )


# -- summon_full_params, for reading --------------------------------------------------------------------------------


def _sharded_slots(module: nn.Module, recurse: bool) -> list[tuple[nn.Module, str, DTensor]]:
    """(owner, name, parameter) for every sharded parameter FSDP1's summon would unshard: the whole tree, or with
    recurse=False the module's own unit (not the units below it)."""
    modules = module.modules() if recurse else _unit_modules(module, set())
    return [
        (owner, name, param)
        for owner in modules
        for name, param in owner.named_parameters(recurse=False)
        if isinstance(param, DTensor)
    ]


def _gather(param: DTensor) -> torch.Tensor:
    """The full value of a sharded parameter; one CPU-offloaded is gathered on its mesh's device."""
    if param.device.type != param.device_mesh.device_type:
        param = param.to(param.device_mesh.device_type)  # type: ignore[assignment]
    full = param.full_tensor()
    # The gather may still be in flight (an AsyncCollectiveTensor): wait here, so that a rank that drops the result
    # (rank0_only) does not leave collectives pending.
    wait = getattr(full, "wait", None)
    return wait() if callable(wait) else full


def _local_piece(full: torch.Tensor, sharded: DTensor) -> torch.Tensor:
    """This rank's part of `full`, cut as `sharded` is cut, by DTensor's own rules for its placements (torch.chunk
    pieces for Shard, uneven and empty ones included, as fully_shard cuts; the whole along Replicate). No
    communication: every rank holds `full`."""
    local = sharded.to_local()
    mesh = sharded.device_mesh
    whole = DTensor.from_local(full.detach().to(local.device), mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, sharded.placements).to_local().to(local.device)


def _unchanged(full: torch.Tensor, sharded: DTensor) -> bool:
    """Whether this rank's part of `full` still equals its shard."""
    return full.shape == sharded.shape and torch.equal(_local_piece(full, sharded), sharded.to_local())


@contextlib.contextmanager
def full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
) -> Iterator[None]:
    """FSDP1's `summon_full_params` on an FSDP2 model, for blocks that read: inside it the modules hold their full
    parameters (plain tensors, their original dtype, on the CPU with offload_to_cpu; on rank 0 only with
    rank0_only), and on leaving the sharded ones come back. FSDP2 cannot write the full values back, so with
    writeback (FSDP1's default) a parameter changed inside the block is an error on leaving, not a lost update;
    writeback=False discards changes, as FSDP1 does."""
    if writeback and rank0_only:
        raise NotImplementedError("writeback=True and rank0_only=True is not supported (nor by FSDP1)")
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()  # a unit left unsharded after forward holds plain, possibly low-precision, tensors
    slots = _sharded_slots(module, recurse)
    gathered: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for _, _, param in slots:  # every rank gathers, in the same order
            if id(param) not in gathered:
                full = _gather(param)
                gathered[id(param)] = nn.Parameter(full.cpu() if offload_to_cpu else full, param.requires_grad)
    if rank0_only and dist.get_rank() != 0:
        gathered.clear()
    swapped = [(owner, name, param, gathered[id(param)]) for owner, name, param in slots if gathered]
    for owner, name, _, full in swapped:
        owner.register_parameter(name, full)
    try:
        yield
    finally:
        left = [owner._parameters[name] for owner, name, _, _ in swapped]
        for owner, name, param, _ in swapped:
            owner.register_parameter(name, param)  # type: ignore[arg-type]  # FSDP2's sharded parameter
    if writeback:  # reached only when the block ended normally
        changed = [
            f"{type(owner).__name__}.{name}"
            for (owner, name, param, full), now in zip(swapped, left, strict=True)
            if now is not full or not _unchanged(full, param)
        ]
        anywhere = torch.tensor([len(changed)], device=_device())
        dist.all_reduce(anywhere)  # a write seen on one rank's part fails every rank alike
        if anywhere.item():
            raise RuntimeError(
                f"full_params(): parameters were changed inside the block ({', '.join(changed) or 'on another rank'}); "
                "FSDP2 cannot write full parameters back, as FSDP1's summon_full_params did: write through the local "
                "shards (`p.to_local()`) or load a full state dict with set_model_state_dict"
            )


# -- FSDP1's apply ---------------------------------------------------------------------------------------------------


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a `.data = ...` assignment (or `_apply`) changes about a tensor even when the values could match."""
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype


def _replaced(shown: nn.Parameter, before: tuple[Any, ...], now: Any) -> str | None:
    """How `fn` replaced a full parameter rather than change it in place, if it did."""
    if now is None:
        return "removed"
    if now is not shown:
        return "replaced by another object"
    if shown.shape != before[2]:
        return f"shape changed from {tuple(before[2])} to {tuple(shown.shape)}"
    return "`.data` assigned" if _layout(shown) != before else None


def _apply_unit(module: nn.Module, fn: Callable[[nn.Module], Any], names: dict[nn.Module, str]) -> None:
    """nn.Module.apply's order (children, then the module), with the unit `module` roots gathered while its subtree
    runs: FSDP1's apply, which gathers each unit's own parameters as the recursion enters it."""
    slots = _sharded_slots(module, recurse=False) if isinstance(module, FSDPModule) else []
    shown: dict[int, tuple[DTensor, nn.Parameter, tuple[Any, ...]]] = {}
    with torch.no_grad():
        for _, _, param in slots:  # every rank gathers, in the same order
            if id(param) not in shown:
                full = nn.Parameter(_gather(param), param.requires_grad)
                shown[id(param)] = (param, full, _layout(full))
    for owner, name, param in slots:
        owner.register_parameter(name, shown[id(param)][1])
    try:
        for child in module.children():
            _apply_unit(child, fn, names)
        fn(module)
        now = [owner._parameters.get(name) for owner, name, _ in slots]
    finally:  # FSDP2's sharded parameters back on their modules, whatever happened (an error in fn included)
        for owner, name, param in slots:
            owner.register_parameter(name, param)  # type: ignore[arg-type]
    if not slots:
        return
    problems = []
    for (owner, name, param), after in zip(slots, now, strict=True):
        problem = _replaced(shown[id(param)][1], shown[id(param)][2], after)
        if problem:
            problems.append(f"{'.'.join(filter(None, (names.get(owner, '?'), name)))} ({problem})")
    mesh = slots[0][2].device_mesh
    anywhere = torch.tensor([len(problems)], device=mesh.device_type)
    for dim in range(mesh.ndim):  # every rank holding a piece of this unit learns of a problem seen on any of them
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    if anywhere.item():
        raise RuntimeError(
            f"apply_full(): fn replaced parameters instead of changing them in place: "
            f"{', '.join(problems) or 'on another rank'}. torch's FSDP1 apply kept none of such changes (the module "
            "went on with its old values, silently; a changed shape cannot be written back at all), where "
            "nn.Module.apply keeps them, so no FSDP2 code can do what both did. Fix: change the parameter in place "
            "in fn (`with torch.no_grad(): m.weight.copy_(new)`, or `m.weight.data.copy_(new)`), which is written "
            "back; or drop the assignment to keep what the FSDP1 program trained with. Nothing of this unit was "
            "written back"
        )
    with torch.no_grad():
        for param, full, _ in shown.values():
            param.to_local().copy_(_local_piece(full, param))


def apply_full(model: nn.Module, fn: Callable[[nn.Module], Any]) -> nn.Module:
    """FSDP1's `model.apply(fn)` on an FSDP2 model: `fn` runs on every module, children first (nn.Module.apply's
    order), while the sharded parameters it sees are full, plain parameters (gathered with `full_tensor()`, in
    their own dtype), so a seeded random init draws what it draws on the plain model; what `fn` changes in place
    (`normal_`, `fill_`, `.data.copy_`, `nn.init.*`) is written back into each rank's shard. Memory as FSDP1's: a
    unit's parameters are gathered when the traversal enters it and written back when it leaves, so at most the
    units on one path from the root are full at once. A parameter `fn` replaces (`.data = ...`, a new Parameter, a
    new shape) fails on every rank of its unit: FSDP1 dropped it silently. Buffers and unsharded parameters are
    `fn`'s to change, as they are; on a model without FSDP2 units this is nn.Module.apply. Call it where FSDP1
    called apply: outside forward/backward. Returns `model`."""
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()  # a unit left unsharded after forward holds plain, possibly low-precision, tensors
    _apply_unit(model, fn, {module: name for name, module in model.named_modules()})
    return model


@contextlib.contextmanager
def without_gradient_sync(model: nn.Module) -> Iterator[None]:
    """FSDP1's `model.no_sync()` (fsdp_qlora's `sync_context = model.no_sync()`, entered later): no gradient
    reduction inside, FSDP2's flag set back on leaving. Like FSDP1's, it does nothing until entered. A model that is
    not FSDP2's but has its own no_sync (DDP's) uses that one."""
    own = getattr(model, "no_sync", None)
    if not isinstance(model, FSDPModule) and callable(own):
        with own():
            yield
        return
    synced = cast(FSDPModule, model)  # (or a wrapper forwarding to one: fsdp_qlora's offload_wrapper)
    synced.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        synced.set_requires_gradient_sync(True)
