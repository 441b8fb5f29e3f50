"""FullyShardedDataParallel: the nn.Module wrapper, its construction and its public methods.

Construction (as torch FSDP1): resolve ignored states, the process group and the compute device; auto-wrap the
children bottom-up with the same arguments; then flatten the parameters this unit still manages into one
FlatParameter and shard it. Runtime behaviour lives in runtime.py, the flat parameter's life cycle in handle.py.
"""

import contextlib
import functools
import sys
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.distributed_c10d import _get_default_group

from . import patch_watch
from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, full_precision_eval_requested
from .clip_grad import clip_grad_norm_
from .construction import (
    HYBRID_STRATEGIES,
    broadcast_from_rank0,
    fall_back_for_one_rank,
    materialize_and_move,
    resolve_setup,
)
from .conversion import converting
from .flat_param import FlatParameter, ParamRef, iter_unit_modules
from .handle import FLATTENED, FlatParamHandle
from .runtime import Runtime
from .same_model import check_same_model, describe_plan, describe_units
from .state import optim_state as _optim_state
from .state import optim_state_legacy as _optim_state_legacy
from .state import optim_state_loading as _optim_state_loading
from .state import state_dict as _state_dict
from .state import state_dict_loading as _state_dict_loading
from .summon import summon_full_params
from .unit import FLAT_PARAM, FSDP_PREFIX, FSDP_WRAPPED_MODULE, FSDPUnit, PrefetchLimits, TrainingState, fsdp_modules
from .unit_plan import plan_unit
from .unit_torch_names import TorchUnitNames

_SHARDED_STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, *HYBRID_STRATEGIES)
# What Dynamo says where it meets an FSDP unit (with fullgraph=True, an error).
_EAGER_RUNTIME = (
    "fsdp_legacy: an FSDP unit's forward runs its all-gathers, hooks and resharding eagerly, as torch's FSDP1 does; "
    "the wrapped module's own forward is compiled. Compile without fullgraph=True, or compile the wrapped blocks"
)
_RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


# What every unit under one root must agree on (torch's `_runtime_utils.HOMOGENEOUS_ATTR_NAMES`).
_HOMOGENEOUS_ATTRIBUTES = ("_use_orig_params", "limit_all_gathers", "_use_full_prec_in_eval")


class FullyShardedDataParallel(TorchUnitNames, FSDPUnit):
    """Shards a module's parameters, gradients and optimizer state across ranks (torch FSDP1's API).

    Each wrapped unit (this module, and every submodule the auto_wrap_policy selects) flattens the parameters it owns
    into one FlatParameter and keeps a 1/world_size shard of it; the full parameters exist only around the unit's
    forward and backward.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Any = None,
        device_mesh: Any = None,
    ):
        super().__init__()
        _hide_runtime_from_dynamo()
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            warnings.warn(
                f"FSDP will not all-gather parameters for containers that do not implement forward: {module}",
                stacklevel=2,
            )
        setup = resolve_setup(
            module,
            process_group=process_group,
            device_mesh=device_mesh,
            sharding_strategy=sharding_strategy,
            backward_prefetch=backward_prefetch,
            ignored_modules=ignored_modules,
            ignored_states=ignored_states,
            device_id=device_id,
            auto_wrapping=auto_wrap_policy is not None,
        )
        self._ignored_modules, self._ignored_params = setup.ignored_modules, setup.ignored_params
        self._device_mesh = device_mesh
        self.compute_device = setup.compute_device
        for sub in module.modules():  # the marks torch.compile (Dynamo) and transformers look for, as torch sets them
            if sub not in self._ignored_modules:
                sub.__dict__.update(_is_fsdp_managed_module=True, _fsdp_use_orig_params=use_orig_params)
        if auto_wrap_policy is not None:
            from .wrap import auto_wrap

            children_kwargs = dict(
                process_group=setup.children_process_group,
                sharding_strategy=setup.sharding_strategy,
                cpu_offload=cpu_offload,
                backward_prefetch=setup.backward_prefetch,
                mixed_precision=mixed_precision,
                ignored_modules=ignored_modules,
                param_init_fn=param_init_fn,
                device_id=device_id,
                sync_module_states=sync_module_states,
                forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers,
                use_orig_params=use_orig_params,
                ignored_states=ignored_states,
                device_mesh=device_mesh,
            )
            auto_wrap(
                module,
                auto_wrap_policy,
                FullyShardedDataParallel,
                self._ignored_modules,
                self._ignored_params,
                children_kwargs,
            )
        # After the nested units, which materialise their own modules as they are built (as in torch: the same
        # modules get param_init_fn, and random initialisation draws in the same order).
        is_boundary = self._is_boundary_for(module)
        materialize_and_move(module, self.compute_device, param_init_fn, is_boundary)

        setup = fall_back_for_one_rank(setup)
        self.process_group, self._inter_node_pg = setup.process_group, setup.replicate_group
        self.rank, self.world_size = self.process_group.rank(), self.process_group.size()
        self.sharding_strategy = setup.sharding_strategy
        self.cpu_offload = cpu_offload or CPUOffload()
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.backward_prefetch = setup.backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self._use_orig_params = use_orig_params
        self._sync_gradients = True
        self._comm_hook: Callable | None = None
        self._buffer_dtypes: dict[str, torch.dtype] = {}  # original dtypes of buffers cast to buffer_dtype, by path
        self._comm_hook_state: object = None
        self.training_state = TrainingState.IDLE
        self._is_root: bool | None = None
        self._runtime: Runtime | None = None  # shared by all units under one root, from the first forward on
        self._exec_order_data = PrefetchLimits()  # (the root's is shared at lazy init)

        plan = plan_unit(
            module, is_boundary, self._ignored_params, FLATTENED, device_mesh, self._inter_node_pg is not None
        )
        if sync_module_states:
            everyone = self.process_group if self._inter_node_pg is None else _get_default_group()
            check_same_model(describe_plan(plan, module), (everyone,), self.compute_device)
            broadcast_from_rank0(plan.module_states, everyone)
        # Where each parameter reference stands among its module's (a unit with several flat parameters puts them
        # back in this order when it shows them: summon_full_params, FULL and SHARDED state dicts).
        self._registration_order: dict[str, int] = plan.registration_order
        # One flat parameter per dtype among the managed parameters (one, as in torch, unless the unit mixes dtypes:
        # frozen integer weights beside trainable adapters, say), each sharded and gathered on its own.
        self._handles: list[FlatParamHandle] = [
            self._build_handle(module, references, index) for index, references in enumerate(plan.dtype_groups)
        ]
        self._fsdp_wrapped_module = module
        if use_orig_params:
            self._put_managed_params_last()
        if not use_orig_params:
            # On the module inside an activation-checkpoint wrapper the unit was built around, as torch does (its
            # `module`): the wrapper's load hook moves every key below it into that module.
            for handle in self._handles:
                self.module.register_parameter(handle.flat_name, handle.flat_param)
        _state_dict.init_unit(self)
        _state_dict_loading.register_load_hooks(self)

    # ----------------------------------------------------------------------------------------------------------------
    # Construction helpers

    def _is_boundary_for(self, root: nn.Module) -> Callable[[nn.Module], bool]:
        ignored = self._ignored_modules
        return lambda m: m is not root and (isinstance(m, FullyShardedDataParallel) or m in ignored)

    def _put_managed_params_last(self) -> None:
        """use_orig_params=True: each module lists the parameters the unit manages behind its others (ignored ones),
        in registration order, tied references last, as torch's construction leaves them (it deregisters them and
        registers them again). named_parameters(), and so an optimizer's parameter order and its state's indices,
        and the state dicts' key order then follow torch's."""
        rank = self._registration_order
        primaries = sorted(
            (info for handle in self._handles for info in handle.layout.params), key=lambda info: rank[info.fqn]
        )
        shared = [info for handle in self._handles for info in handle.layout.shared]
        for module, name in [(i.module, i.param_name) for i in primaries] + [(i.module, i.param_name) for i in shared]:
            module._parameters[name] = module._parameters.pop(name)

    def _build_handle(self, module: nn.Module, references: Sequence[ParamRef], index: int) -> FlatParamHandle:
        floating = references[0].param.is_floating_point()
        strategy = self.sharding_strategy
        handle = FlatParamHandle(
            module,
            references,
            self.process_group,
            sharded=strategy in _SHARDED_STRATEGIES,
            reshard_after_forward=strategy in _RESHARD_AFTER_FORWARD,
            use_orig_params=self._use_orig_params,
            device=self.compute_device,
            # MixedPrecision casts floating-point parameters only: integer ones are gathered as they are.
            param_dtype=self.mixed_precision.param_dtype if floating else None,
            reduce_dtype=self.mixed_precision.reduce_dtype if floating else None,
            replicate_group=self._inter_node_pg,
            offload_params=self.cpu_offload.offload_params,
            keep_low_precision_grads=self.mixed_precision.keep_low_precision_grads,
            flat_name=FLAT_PARAM if index == 0 else f"{FLAT_PARAM}_{index}",
        )
        handle._fully_sharded_module = module  # torch's name for the module the unit wraps
        self._hook_post_backward(handle)
        return handle

    def _hook_post_backward(self, handle: FlatParamHandle) -> None:
        """Reduce the flat parameter's gradient once it has accumulated. At construction and at each forward (where
        the runtime calls it again), since a flat parameter frozen when wrapped may be unfrozen later."""
        if handle.post_backward_hooked or not handle.flat_param.requires_grad:
            return
        # Through a weak reference: torch's garbage collector does not see into post-accumulate-grad hooks, so a
        # hook holding the unit would keep the whole model alive after `del model`.
        hook = functools.partial(_post_backward_hook, weakref.ref(self), weakref.ref(handle))
        handle.flat_param.register_post_accumulate_grad_hook(hook)
        handle.post_backward_hooked = True

    # ----------------------------------------------------------------------------------------------------------------
    # nn.Module surface

    # (hidden from torch.compile: _hide_runtime_from_dynamo)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _pre_forward(self, args, kwargs)
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return _post_forward(self, output)

    def _lazy_init(self) -> Runtime:
        """The first FSDP instance to run forward becomes the root of all FSDP instances below it."""
        if self._runtime is not None:
            return self._runtime
        units = FullyShardedDataParallel.fsdp_modules(self)
        patch_watch.warn_of_replaced()
        patch_watch.warn_of_extensions(units)
        for name in _HOMOGENEOUS_ATTRIBUTES:  # settings the runtime reads once for all units: torch's check
            values = {getattr(unit, name) for unit in units}
            if len(values) != 1:
                raise ValueError(f"Expects one homogeneous value for {name} but got {values}")
        check_same_model(describe_units(self, units), (self.process_group, self._inter_node_pg), self.compute_device)
        runtime = Runtime(self, units)
        stream = torch.get_device_module(self.compute_device.type).current_stream()
        for unit in units:
            unit._is_root = unit is self
            unit._runtime = runtime
            unit._show_streams(stream)
            unit._exec_order_data = self._exec_order_data
            unit._cast_buffers()
            for handle in unit._handles:
                if hasattr(handle.flat_param, "_in_backward_optimizers"):
                    raise RuntimeError("FSDP optimizer in backward only supported with use_orig_params=True!")
                handle.adopt_replaced_flat_param()
        return runtime

    def _cast_buffers(self, full_precision: bool = False) -> None:
        """MixedPrecision.buffer_dtype: this unit's floating-point buffers are kept in that dtype from the first
        forward on, as torch FSDP1 does; in their original dtypes while `full_precision` (eval mode with
        FSDP_USE_FULL_PREC_IN_EVAL=1, where torch's casts them back, and again to buffer_dtype in train mode)."""
        dtype = self.mixed_precision.buffer_dtype
        if dtype is None:
            return
        wrapped = self._fsdp_wrapped_module
        for path, sub in iter_unit_modules(wrapped, self._is_boundary_for(wrapped)):
            if sub in self._ignored_modules:  # (the wrapped module itself may be: a unit managing nothing)
                continue
            for name, buffer in sub._buffers.items():
                if buffer is None or not buffer.is_floating_point():
                    continue
                key = f"{path}.{name}" if path else name
                if key not in self._buffer_dtypes and buffer.dtype != dtype:
                    self._buffer_dtypes[key] = buffer.dtype  # first seen: its original dtype
                target = self._buffer_dtypes.get(key, dtype) if full_precision else dtype
                if buffer.dtype != target:
                    sub._buffers[name] = buffer.to(target)

    @property
    def params(self) -> list[FlatParameter]:
        return [handle.flat_param for handle in self._handles]

    # torch FSDP1's private attributes that frameworks read (docs/compatibility.md says which framework reads which).

    @property
    def _use_full_prec_in_eval(self) -> bool:
        """FSDP_USE_FULL_PREC_IN_EVAL, one of the attributes torch requires equal on every unit
        (`_runtime_utils.HOMOGENEOUS_ATTR_NAMES`)."""
        return full_precision_eval_requested()

    @property
    def _fqn_modifiers(self) -> Any:
        """torch's DSD helpers (torch.distributed.checkpoint.state_dict) probe every module for this name. They know
        only the FSDP class they imported: unless fsdp_legacy.install() has put ours there, they would take the model
        for a plain module and write a checkpoint that loads wrongly, so refuse with the fix instead."""
        helpers = sys.modules.get("torch.distributed.checkpoint.state_dict")
        known = getattr(helpers, "FSDP", None)
        if isinstance(known, type) and not isinstance(self, known):
            raise RuntimeError(
                "torch.distributed.checkpoint.state_dict's helpers (get_state_dict, set_state_dict, ...) do not "
                "recognise fsdp_legacy's FullyShardedDataParallel unless fsdp_legacy.install() (or FSDP_LEGACY=1 in "
                "the environment) puts it under torch's names: call fsdp_legacy.install() first, or use the same "
                "helpers from fsdp_legacy.checkpoint."
            )
        raise AttributeError("_fqn_modifiers")  # as torch's FSDP1 has none

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """`.half()`, `.to()`, `.cuda()` ... convert the flat parameters (conversion.py)."""
        with converting(self, fn):
            return super()._apply(fn, recurse)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self._modules.get(FSDP_WRAPPED_MODULE)
            if wrapped is None:
                raise
            return getattr(wrapped, name)

    def __getitem__(self, key: Any) -> Any:
        wrapped: Any = self._fsdp_wrapped_module  # a container module (nn.Sequential, ModuleList, ...)
        return wrapped[key]

    def check_is_root(self) -> bool:
        self._lazy_init()
        return bool(self._is_root)

    def _assert_state(self, state: TrainingState | list[TrainingState]) -> None:
        states = state if isinstance(state, list) else [state]
        if self.training_state not in states:
            message = f"expected to be in states {states} but current state is {self.training_state}"
            traceback.print_stack()
            raise ValueError(message)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """All FSDP instances in `module` (itself included) in pre-order, or only the outermost ones."""
        return fsdp_modules(module, root_only)  # type: ignore[return-value]

    # ----------------------------------------------------------------------------------------------------------------
    # State dicts (state_dict.py)

    set_state_dict_type = staticmethod(_state_dict.set_state_dict_type)
    get_state_dict_type = staticmethod(_state_dict.get_state_dict_type)
    state_dict_type = staticmethod(_state_dict.state_dict_type)

    # Optimizer state dicts (optim_state.py; the older API in optim_state_legacy.py)
    optim_state_dict = staticmethod(_optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(_optim_state_loading.optim_state_dict_to_load)
    full_optim_state_dict = staticmethod(_optim_state_legacy.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(_optim_state_legacy.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(_optim_state_legacy.shard_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(_optim_state_legacy.flatten_sharded_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(_optim_state_legacy.scatter_full_optim_state_dict)
    rekey_optim_state_dict = staticmethod(_optim_state_legacy.rekey_optim_state_dict)
    # torch's internal entry points and warnings, which checkpointers call directly (ByteCheckpoint, Cosmos)
    _optim_state_dict_impl = staticmethod(_optim_state_legacy.optim_state_dict_impl)
    _optim_state_dict_to_load_impl = staticmethod(_optim_state_legacy.optim_state_dict_to_load_impl)
    _warn_optim_input = staticmethod(_optim_state_legacy.warn_optim_input)
    _is_using_optim_input = staticmethod(_optim_state_legacy.is_using_optim_input)
    _warn_legacy_optim_state_dict = staticmethod(_optim_state_legacy.warn_legacy_optim_state_dict)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return _state_dict_loading.load_state_dict(self, state_dict, strict, assign)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communication (root only). The unsharded gradients of every unit are kept
        until the first backward outside the context reduces them: memory grows by the unsharded model size, like
        DDP's gradients."""
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError(
                "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` on root FSDP module."
            )
        self._assert_state(TrainingState.IDLE)
        units = FullyShardedDataParallel.fsdp_modules(self)
        previous = [unit._sync_gradients for unit in units]
        for unit in units:
            unit._sync_gradients = False
        try:
            yield
        finally:
            for unit, flag in zip(units, previous, strict=True):
                unit._sync_gradients = flag

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all units by their total norm (that of the full gradients); returns that norm."""
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError("`clip_grad_norm_()` should only be called on the root FSDP instance")
        self._assert_state(TrainingState.IDLE)
        handles = [handle for unit in FullyShardedDataParallel.fsdp_modules(self) for handle in unit._handles]
        return clip_grad_norm_(self, handles, self.process_group, max_norm, norm_type)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Replace the gradient reduction of every unit by `hook`: `hook(state, padded_unsharded_grad, shard_out)`
        for sharded strategies, `hook(state, grad)` (in place) for NO_SHARD; torch's default hooks work."""
        if not self.check_is_root():
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        for unit in FullyShardedDataParallel.fsdp_modules(self):
            if unit.sharding_strategy in HYBRID_STRATEGIES:
                raise AssertionError(
                    f"Communication hook is not supported for hybrid strategies: {unit.sharding_strategy}"
                )
            if unit._comm_hook is not None:
                raise AssertionError("A communication hook is already registered")
            if not callable(hook):
                raise ValueError(f"The communication hook must be callable but got {hook}")
            unit._comm_hook, unit._comm_hook_state = hook, state
            for handle in unit._handles:
                handle.comm_hook, handle.comm_hook_state = hook, state

    @staticmethod
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> contextlib.AbstractContextManager:
        """Gather the full parameters of the FSDP units in `module` (only the outermost ones if not `recurse`) for
        the duration of the context; edits persist with `writeback`. Works on CPU with offload_to_cpu, and with_grads
        works for use_orig_params=False too."""
        if recurse:
            units = FullyShardedDataParallel.fsdp_modules(module)
        else:  # torch's: only `module` itself, nothing when it is no FSDP instance
            units = [module] if isinstance(module, FullyShardedDataParallel) else []
        # As torch's, each unit is lazily initialised first, outermost first: a unit that never ran forward becomes a
        # root here (`_is_root` set), as code counting roots after summon_full_params expects.
        for unit in units:
            unit._lazy_init()
        return summon_full_params(units, writeback, rank0_only, offload_to_cpu, with_grads)

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """nn.Module.apply with this unit's full parameters in place (each nested unit gathers its own), edits kept."""
        self._assert_state(TrainingState.IDLE)
        with FullyShardedDataParallel.summon_full_params(self, recurse=False, writeback=True):
            return super().apply(fn)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """Inside summon_full_params on this unit the names are the original ones (no `_fsdp_wrapped_module.`)."""
        clean = self.training_state == TrainingState.SUMMON_FULL_PARAMS
        for name, param in super().named_parameters(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        clean = self.training_state == TrainingState.SUMMON_FULL_PARAMS
        for name, buffer in super().named_buffers(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), buffer


def _pre_forward(unit: FullyShardedDataParallel, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return unit._lazy_init().pre_forward(unit, args, kwargs)


def _post_forward(unit: FullyShardedDataParallel, output: Any) -> Any:
    assert unit._runtime is not None, "the pre-forward set it"
    return unit._runtime.post_forward(unit, output)


_runtime_hidden = False


def _hide_runtime_from_dynamo() -> None:
    """Under torch.compile, Dynamo never traces a unit's forward frame nor the runtime (collectives, storage resizes,
    hooks and bookkeeping run eagerly, as torch's FSDP1 runtime does inside torch), while the wrapped module's own
    forward, called from there, is compiled as a frame of its own with the unsharded views as graph inputs.

    Done at the first construction rather than at import: torch._dynamo's own import can be what imports fsdp_legacy
    (FSDP_LEGACY=1 installs it as soon as torch.distributed.fsdp is imported, which torch._dynamo does), and
    torch.compiler.disable needs torch._dynamo whole."""
    global _runtime_hidden, _pre_forward, _post_forward
    if _runtime_hidden:
        return
    cls = FullyShardedDataParallel
    cls.forward = torch.compiler.disable(cls.forward, recursive=False, reason=_EAGER_RUNTIME)  # type: ignore[method-assign]
    _pre_forward = torch.compiler.disable(_pre_forward, reason=_EAGER_RUNTIME)
    _post_forward = torch.compiler.disable(_post_forward, reason=_EAGER_RUNTIME)
    _runtime_hidden = True


def _post_backward_hook(
    unit_ref: "weakref.ref[FullyShardedDataParallel]",
    handle_ref: "weakref.ref[FlatParamHandle]",
    flat_param: torch.Tensor,
) -> None:
    unit, handle = unit_ref(), handle_ref()
    if unit is not None and handle is not None:
        assert unit._runtime is not None, "backward follows a forward, which sets the runtime"
        unit._runtime.post_backward(unit, handle)
