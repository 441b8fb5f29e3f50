"""torch FSDP1's names on FlatParamHandle, for code that reaches a handle through `FSDP._handle`, `FSDP._all_handles`
or torch's `_traversal_utils._get_fsdp_handles` and reads or drives it as torch's (trainers' gradient-norm and EMA
helpers, verl's offload, audiocraft's purge of gathered parameters, torch's own tests).

The attributes map onto the handle's own state, read on each access, so they never disagree with the runtime.
`pre_unshard()` / `post_unshard()` / `post_reshard()` complete the handle's `unshard()` / `reshard(free)` into torch's
sequence (`_runtime_utils._unshard` / `_reshard`, torch_helpers.py): after it the unit's parameters are shown gathered
(module attributes, and with use_orig_params=True `named_parameters()`), and `reshard()` undoes that.

FlatParamHandle mixes this in, last: it only reads what the handle and its other parts define.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum, auto

import torch
import torch.distributed as dist
from torch import nn

from .api import FSDPEnum, full_precision_eval_requested
from .flat_param import FlatParameter, FlatParamLayout, ParamInfo
from .handle_state import HandleTrainingState
from .orig_param_grads import assign_grad


class HandleShardingStrategy(FSDPEnum):
    """torch's per-handle sharding strategy (`_flat_param.HandleShardingStrategy`): the unit's ShardingStrategy by
    name. Members equal torch's of the same name, both ways."""

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class TorchHandleNames:
    # The handle's state these names read (set by FlatParamHandle.__init__, `_fully_sharded_module` by the wrapper).
    flat_param: FlatParameter
    layout: FlatParamLayout
    group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    compute_device: torch.device
    sharded: bool
    use_orig_params: bool
    offload: bool
    mixed: bool
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    training_state: HandleTrainingState
    full_padded: torch.Tensor
    _strategy_reshards_after_forward: bool
    _fully_sharded_module: nn.Module  # the module the handle's FSDP unit wraps (torch's "fully sharded module")
    kept_for_backward: bool
    is_unsharded: bool
    orig_params: dict[ParamInfo, nn.Parameter]
    keep_low_precision_grads: bool
    _grad_before_unshard_grad: tuple[torch.Tensor | None] | None = None  # (unshard_grad: the sharded gradient aside)
    _orig_param_dtype: torch.dtype
    _strategy_given: HandleShardingStrategy | None = None  # a handle built by hand: the strategy it was given

    @property
    def skipped_sharded_views_after_forward(self) -> bool:
        raise NotImplementedError  # (FlatParamHandle)

    @property
    def must_gather(self) -> bool:
        raise NotImplementedError  # (FlatParamHandle)

    def start_unshard(self) -> None:
        raise NotImplementedError  # (FlatParamHandle)

    def wait_unshard(self) -> None:
        raise NotImplementedError  # (FlatParamHandle)

    def local_sharded_grad(self) -> torch.Tensor | None:
        raise NotImplementedError  # (OrigParamGrads)

    def gather_full_grad(self) -> torch.Tensor | None:
        raise NotImplementedError  # (FlatParamGrads)

    def _use_orig_grad_views(self) -> None:
        raise NotImplementedError  # (OrigParamGrads)

    def use_unsharded_views(self) -> None:
        raise NotImplementedError  # (FlatParamHandle)

    def writeback_orig_params(self) -> None:
        raise NotImplementedError  # (FlatParamHandle)

    def _attributes(self):
        raise NotImplementedError  # (FlatParamHandle)

    def _register_views(self, views: dict[ParamInfo, torch.Tensor]) -> None:
        raise NotImplementedError  # (OrigParamViews)

    # ----------------------------------------------------------------------------------------------------------------
    # Attributes

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group the flat parameter is sharded over (under hybrid sharding, the shard group, as torch's)."""
        return self.group

    @property
    def device(self) -> torch.device:
        """The compute device (the CPU-offloaded shard lives elsewhere, as torch's)."""
        return self.compute_device

    @property
    def _sharding_strategy(self) -> HandleShardingStrategy:
        if self._strategy_given is not None:
            return self._strategy_given
        if not self.sharded:
            return HandleShardingStrategy.NO_SHARD
        if self.replicate_group is not None:
            hybrid = self._strategy_reshards_after_forward
            return HandleShardingStrategy.HYBRID_SHARD if hybrid else HandleShardingStrategy._HYBRID_SHARD_ZERO2
        full = self._strategy_reshards_after_forward
        return HandleShardingStrategy.FULL_SHARD if full else HandleShardingStrategy.SHARD_GRAD_OP

    @property
    def uses_sharded_strategy(self) -> bool:
        return self.sharded

    @property
    def _use_orig_params(self) -> bool:
        return self.use_orig_params

    @property
    def _training_state(self) -> HandleTrainingState:
        return self.training_state

    @_training_state.setter
    def _training_state(self, state: Enum) -> None:
        # Code resets it with torch's enum (HandleTrainingState.IDLE after an interrupted step): keep our member.
        self.training_state = type(self.training_state)[state.name]

    @property
    def _fwd_bwd_param_dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def _reduce_dtype(self) -> torch.dtype:
        return self.reduce_dtype

    # (`_orig_param_dtype` and `_offload_params` are the handle's own.)

    @property
    def _keep_low_precision_grads(self) -> bool:
        return self.keep_low_precision_grads

    @property
    def _force_full_precision(self) -> bool:
        """Whether a mixed-precision handle is in full precision now: inside summon_full_params, or in eval mode
        under FSDP_USE_FULL_PREC_IN_EVAL=1 (copies of torch's post-backward hook then reduce without a cast)."""
        mixed = self.compute_dtype != self._orig_param_dtype or self.reduce_dtype != self._orig_param_dtype
        summoned = self.training_state.name == "SUMMON_FULL_PARAMS"
        in_eval = not self._fully_sharded_module.training and full_precision_eval_requested()
        return mixed and (summoned or in_eval)

    @property
    def _device_handle(self) -> object:
        """torch's device handle: the compute device's torch module (`torch.cuda`, `torch.cpu`), whose
        `device_count()`, `current_stream()` and `stream()` code calls."""
        return torch.get_device_module(self.compute_device.type)

    def param_module_names(self) -> Iterator[tuple[str, str]]:
        """(parameter name, module name) of each original parameter the flat parameter holds, in its order, then of
        each reference to one of them under another name (tied weights), as torch's."""
        for param_name, _, module_name in self.flat_param._param_infos:
            yield param_name, module_name
        yield from self.shared_param_module_names()

    def shared_param_module_names(self) -> Iterator[tuple[str, str]]:
        """(parameter name, module name) of each reference to a parameter that is held once under another name."""
        for shared in self.flat_param._shared_param_infos:
            yield shared.param_name, shared.module_name

    @property
    def sharded_grad(self) -> torch.Tensor | None:
        """This rank's sharded gradient in the flat layout, None if there is none (with use_orig_params=True ours keeps
        the gradients on the original parameters: assembled, a copy)."""
        return self.local_sharded_grad()

    def is_sharded(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` has the size of this rank's shard of the flat parameter; always False for NO_SHARD."""
        return self.sharded and tensor.size() == torch.Size([self.layout.shard_numel])

    @property
    def _skipped_use_sharded_views(self) -> bool:
        """Between forward and backward of a use_orig_params unit that keeps its gather (SHARD_GRAD_OP): the original
        parameters still show the unsharded views while the flat parameter shows its shard."""
        return self.kept_for_backward and self.skipped_sharded_views_after_forward

    @property
    def _unsharded_flat_param_for_skipped_views(self) -> torch.Tensor | None:
        return self.full_padded[: self.layout.numel] if self._skipped_use_sharded_views else None

    def _get_padded_unsharded_flat_param(self) -> torch.Tensor:
        """The buffer the flat parameter is gathered into, padded, its storage freed (size 0) while resharded: code
        tells from it whether a unit is still gathered. Sharded strategies only, as torch's."""
        if not self.sharded:
            raise AssertionError("Expects sharded strategy")
        return self.full_padded

    # ----------------------------------------------------------------------------------------------------------------
    # torch's unshard / reshard sequence: pre_unshard(); unshard(); post_unshard() ... reshard(free); post_reshard()

    def needs_unshard(self) -> bool:
        """Whether `unshard()` would gather: the flat parameter is neither unsharded nor being gathered."""
        return self.must_gather

    def unshard(self) -> None:
        """Gather the flat parameter: afterwards it holds the unsharded data (padded, in the compute dtype), as
        torch's `unshard()` leaves it; `post_unshard()` shows the original parameters."""
        self.start_unshard()
        self.wait_unshard()

    def pre_unshard(self) -> bool:
        """Take in edits of the original parameters (use_orig_params=True) before the gather. Returns whether the
        gather then needs a cast or a copy of the shard to the compute device (torch's stream-ordering answer)."""
        self.writeback_orig_params()
        return self.must_gather and (self.mixed or self.offload)

    def post_unshard(self) -> None:
        """Complete the gather (if `unshard()` did not) and show the gathered parameters: in forward or backward as the
        runtime shows them; otherwise (code driving the handle between steps) as module attributes and, with
        use_orig_params=True, also registered in their modules, so `named_parameters()` lists them full, as torch's
        does. Without autograd history, and for reading: as in torch, edits reach the shard only where the gathered
        tensor is the shard itself (NO_SHARD in full precision). `reshard()` undoes all of it."""
        self.wait_unshard()
        self._use_unsharded_views(as_params=self.training_state.name not in ("FORWARD", "BACKWARD_PRE"))

    def _use_unsharded_views(self, as_params: bool) -> None:
        """torch's name for showing the gathered parameters, which the runtime calls through the class attribute, so
        code that replaces `FlatParamHandle._use_unsharded_views` (torch's test_fsdp_core wraps it to check that
        forward and backward use tensor views) sees every call. `as_params=False`: the views forward and backward use
        (`use_unsharded_views()`); True: views for reading between steps, without autograd history and, with
        use_orig_params=True, registered in their modules as well."""
        if not as_params:
            self.use_unsharded_views()
            return
        with torch.no_grad():
            self.use_unsharded_views()
        if self.use_orig_params:
            self._register_views({info: module.__dict__[name] for module, name, info in self._attributes()})

    def post_reshard(self) -> None:
        """Nothing: `reshard()` already freed what torch frees here (the low-precision copy of the shard)."""

    # ----------------------------------------------------------------------------------------------------------------
    # torch's gradient pair for a gathered handle: unshard_grad() ... reshard_grad()

    def unshard_grad(self) -> None:
        """Show the whole gradient while the flat parameter is unsharded (after `_unshard`, as torch's
        summon_full_params(with_grads=True) does): `flat_param.grad` unsharded and unpadded, with use_orig_params=True
        also each original parameter's gradient, as a view of it. None everywhere if no rank has a gradient; a rank
        without one contributes zeros. An all-reduce and an all-gather (NO_SHARD's gradient is whole already).
        `reshard_grad()` puts the sharded gradient back, dropping edits of the whole one, as torch's does."""
        if self._grad_before_unshard_grad is not None:
            return
        if self.sharded and not self.is_unsharded:
            raise AssertionError(
                f"Expects tensor to be unsharded with size {torch.Size([self.layout.numel])} but got "
                f"{self.flat_param.size()}: call unshard_grad() after the handle's unshard() "
                "(`_runtime_utils._unshard`)"
            )
        full = self.gather_full_grad()
        self._grad_before_unshard_grad = (self.flat_param.grad,)
        whole = None if full is None else full[: self.layout.numel]
        assign_grad(self.flat_param, whole)
        for info, shown in self._shown_orig_params():
            view = None if whole is None else info.view_in(whole)
            shown.grad = view if self.orig_params[info].requires_grad else None

    def reshard_grad(self) -> None:
        """Undo `unshard_grad()`: the sharded gradient as before it."""
        if self._grad_before_unshard_grad is None:
            return
        (grad,), self._grad_before_unshard_grad = self._grad_before_unshard_grad, None
        assign_grad(self.flat_param, grad)
        for info, shown in self._shown_orig_params():
            if shown is not self.orig_params[info]:
                shown.grad = None  # (a gathered view the module still shows)
        if self.use_orig_params:
            self._use_orig_grad_views()

    def _shown_orig_params(self) -> Iterator[tuple[ParamInfo, torch.Tensor]]:
        """use_orig_params=True: each original parameter as its module registers it now (a gathered view after
        `_unshard`, or the Parameter itself)."""
        if not self.use_orig_params:
            return
        for module, name, info in self._attributes():
            yield info, module._parameters.get(name, self.orig_params[info])
