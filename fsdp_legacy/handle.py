"""FlatParamHandle: owns one unit's flat parameter and moves it between its sharded and unsharded states.

States of the flat parameter's `.data`:
  sharded   -> the local shard (`local_shard`), what the optimizer steps on;
  unsharded -> `full_padded`, the all-gathered flat tensor whose storage is freed (resized to 0) while sharded, so
               that tensors autograd saved as views of it stay valid across a free and a later re-gather.
Mixed in: the gradient's way through backward, and where the sharded gradient lives (flat_param_grads.py); with
use_orig_params=True, that gradient on the original parameters (orig_param_grads.py) and what the modules register
for them (orig_param_views.py).
A unit whose parameters differ in dtype has one handle per dtype; each is what is described here.
"""

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from . import collectives as comm
from .flat_param import (
    FlatParameter,
    FlatParamLayout,
    ParamInfo,
    ParamRef,
    aligned_numel_for,
    build_layout,
    flatten,
    view_flat,
)
from .flat_param_grads import FlatParamGrads
from .handle_by_hand import HandleByHand
from .handle_state import HandleTrainingState, Summoned
from .handle_torch_names import TorchHandleNames
from .module_setattr import overrides_setattr, show, unsafe_setattr
from .naming import FLAT_PARAM
from .orig_param_grads import OrigParamGrads
from .orig_param_views import OrigParamViews
from .storage import alloc_storage, free_storage, freed_tensor, same_memory
from .tensor_parallel import DTensorParam, local_tensor

# Every parameter already flattened into some unit -> where, so that a second unit reaching it (tied weights across
# units) fails with a clear message instead of silently owning a stale copy.
FLATTENED: WeakIdKeyDictionary = WeakIdKeyDictionary()


# Each mixin declares the methods it uses of the others as stubs, so it must come after those that define them.
class FlatParamHandle(OrigParamGrads, OrigParamViews, FlatParamGrads, TorchHandleNames, HandleByHand):
    def __init__(
        self,
        module: nn.Module,
        references: Sequence[ParamRef],
        group: dist.ProcessGroup,
        sharded: bool,
        reshard_after_forward: bool,
        use_orig_params: bool,
        device: torch.device,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        offload_params: bool = False,
        keep_low_precision_grads: bool = False,
        flat_name: str = FLAT_PARAM,
    ):
        self.flat_name = flat_name  # its name on the wrapped module (use_orig_params=False) and in LOCAL state dicts
        self.group = group  # the ranks that share one copy of the parameters, a shard each
        self.rank = group.rank()
        self.world_size = group.size()
        # Hybrid sharding: the sharded gradient is then all-reduced across the replicas of this shard group.
        self.replicate_group = replicate_group
        # What the gradient is divided by before and after its reduction (their product: the mean over the data
        # parallel ranks); the unit's `_gradient_predivide_factor` / `_gradient_postdivide_factor`, which code
        # rescales (VeOmni: expert-parallel units), set them.
        replicas = replicate_group.size() if replicate_group is not None else 1
        self.pre_divide, self.post_divide = comm.gradient_divide_factors(self.world_size * replicas)
        self.comm_hook: Callable | None = None  # register_comm_hook: replaces the default reduction
        self.comm_hook_state: object = None
        self.sharded = sharded
        self.use_orig_params = use_orig_params
        self.training_state = HandleTrainingState.IDLE
        self.summoned: Summoned | None = None  # inside summon_full_params
        self.unshard_work: comm.Waitable | None = None
        self._gather_input: torch.Tensor | None = None  # the all-gather's input while it is in flight
        self.saved_grad: torch.Tensor | None = None
        self.new_grad: torch.Tensor | None = None  # this backward's reduced sharded gradient
        self.unsynced_grad: torch.Tensor | None = None  # unsharded gradients accumulated under no_sync()
        self.unsynced_in_grad = False  # NO_SHARD in full precision: `.grad` holds no_sync() gradients, unreduced
        self.needs_pre_backward = False  # set in forward, cleared by the first pre-backward hook
        self.backward_task = -1  # autograd's graph task of the last backward that reached the handle
        self.kept_gathered = False  # resharded with the unsharded storage kept (finish_backward)
        # Gathered in forward and kept for backward (the root, SHARD_GRAD_OP): the flat parameter shows its shard
        # meanwhile, as torch's, and the pre-backward shows the kept storage again instead of gathering.
        self.kept_for_backward = False
        self.prefetched = False  # gathered ahead by FSDP._unshard(): the next forward uses it, whatever came between
        self.backward_prepared = False  # prepare_gradient_for_backward ran in this backward
        self.post_backward_done = False
        self.post_backward_hooked = False  # the flat parameter's post-accumulate-grad hook is registered
        self.forward_views: dict[ParamInfo, torch.Tensor] = {}  # use_orig_params: forward's views, until resharded

        params = list({id(ref.param): ref.param for ref in references}.values())
        dtype = _uniform(params, lambda p: p.dtype, "dtype")
        # Mixed precision: forward and backward run on a low-precision unsharded copy; the full-precision local
        # shard stays the master copy, so only the low-precision unit is ever unsharded.
        self.compute_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        # What MixedPrecision left to the parameters' dtype, and that dtype (torch's name: frameworks set it): see
        # adopt_replaced_flat_param.
        self._param_dtype_given, self._reduce_dtype_given = param_dtype is not None, reduce_dtype is not None
        self._orig_param_dtype = dtype
        self.keep_low_precision_grads = keep_low_precision_grads
        self._debug_level = dist.get_debug_level()  # torch's name, read where torch reads it: at construction
        # CPUOffload: the shard, its gradient and so the optimizer step live on the CPU; compute on `device`.
        self.compute_device = device
        self.offload = offload_params
        self._strategy_reshards_after_forward = reshard_after_forward
        self._set_precision(dtype)
        requires_grad = any(p.requires_grad for p in params)
        if not use_orig_params:
            _uniform(params, lambda p: p.requires_grad, "`requires_grad` when `use_orig_params=False`")
        layout = build_layout(
            references,
            self.world_size,  # NO_SHARD too: torch pads the same way, which keeps the layouts interchangeable
            aligned_numel_for(self.compute_dtype) if use_orig_params else 0,
        )
        self.layout: FlatParamLayout = layout
        # Every original parameter reference (tied ones included) as (module, attribute name, ParamInfo), and where
        # each parameter's chunk lies among the flat parameter's splits: read at every forward and backward.
        self._attribute_refs: tuple[tuple[nn.Module, str, ParamInfo], ...] = (
            *((info.module, info.param_name, info) for info in layout.params),
            *((shared.module, shared.param_name, shared.primary) for shared in layout.shared),
        )
        self._param_chunks = tuple(i for i, (_, is_padding) in enumerate(layout.segments) if not is_padding)
        self._split_sizes: dict[int, list[int]] = {}  # the flat parameter's numel -> its split into segments
        # Modules whose class overrides __setattr__ see the views written through it, unless FSDP_USE_UNSAFE_SETATTR=1
        # (module_setattr.py; torch reads the variable here too).
        self._setattr_modules: list[nn.Module] = (
            [] if unsafe_setattr() else [m for m, _, _ in self._attributes() if overrides_setattr(m)]
        )
        originals = {info: _registered(info.module, info.param_name) for info in layout.params}
        # Parameter subclasses (quantized weights carrying their quantization state, say): the unsharded views and
        # placeholders are made of the same class with the same attributes, so layers that read them keep working.
        # (Only true subclasses: a parameter under FakeTensorMode is a FakeTensor, which is not one.)
        self._typed: dict[ParamInfo, nn.Parameter] = {
            i: p for i, p in originals.items() if issubclass(type(p), nn.Parameter) and type(p) is not nn.Parameter
        }
        # DTensor parameters (tensor parallelism): the flat parameter holds their local pieces; this is how they are
        # shown again as DTensors (tensor_parallel.py).
        self.dtensors: dict[ParamInfo, DTensorParam] = {
            i: DTensorParam.of(p) for i, p in originals.items() if isinstance(p, DTensor)
        }
        with torch.no_grad():
            tensors = {i: local_tensor(p).detach() for i, p in originals.items()}
            if sharded:  # only this rank's elements are copied
                n = layout.shard_numel
                self.local_shard = flatten(layout, tensors, device, dtype, self.rank * n, (self.rank + 1) * n)
            else:
                full = flatten(layout, tensors, device, dtype)
                self.local_shard = full[: layout.numel] if layout.padded_numel != layout.numel else full
        if offload_params:
            # Pinned memory lets the host-to-device copies of the shard run asynchronously on CUDA.
            pin = device.type == "cuda"
            self.local_shard = self.local_shard.to("cpu").pin_memory() if pin else self.local_shard.to("cpu").clone()
        self.flat_param = FlatParameter.create(self.local_shard, layout, requires_grad)
        self.flat_param._handle_ref = weakref.ref(self)
        # The shard's own alias (`.data`), with a version counter of its own: writing into it (summon's writeback,
        # loading a state dict) between a forward and its backward must not look like an in-place change of the
        # flat parameter that autograd saved views of. `_local_shard` is torch's name for it.
        self.local_shard = self.flat_param._local_shard = self.flat_param.data
        del tensors  # (the original parameters' data is released below)
        # use_orig_params=True keeps the original Parameters (as views of the shard); otherwise they are released,
        # and their storage with them, so the unsharded model does not outlive construction.
        self.orig_params: dict[ParamInfo, nn.Parameter] = originals if use_orig_params else {}
        self._local_pieces = {piece.info: piece for piece in layout.shard_pieces(self.rank)} if sharded else {}
        self._orig_grad_views = {}
        self.grads_on_orig_params = use_orig_params and self.uses_buffer
        self._compact_grad = None
        self._compact_views = {}
        self._registered_views = {}
        for info, param in originals.items():
            FLATTENED[param] = f"'{info.fqn}' of the FSDP unit wrapping {type(module).__name__}"
        if use_orig_params and self.dtensors:
            # A DTensor parameter cannot be a view of a plain shard: a plain Parameter takes its place (as in torch),
            # shown as a DTensor again in forward and summon_full_params.
            for info in self.dtensors:
                plain = nn.Parameter(torch.empty(0, dtype=dtype, device=device), originals[info].requires_grad)
                info.module._parameters[info.param_name] = plain
                for shared in layout.shared:
                    if shared.primary is info:
                        shared.module._parameters[shared.param_name] = plain
                originals[info] = FLATTENED[plain] = plain
        if use_orig_params:
            self._use_sharded_orig_params()
            for shared in layout.shared:  # a tied reference moves behind its module's own parameters, as in torch
                tied = shared.module is not shared.primary.module or shared.param_name != shared.primary.param_name
                if tied and shared.param_name in shared.module._parameters:
                    shared.module._parameters[shared.param_name] = shared.module._parameters.pop(shared.param_name)
        else:
            for info in layout.params:
                del info.module._parameters[info.param_name]
                if info not in self.dtensors:  # (a DTensor's data cannot become a plain tensor)
                    originals[info].data = torch.empty(0, dtype=dtype, device=device)
            for shared in layout.shared:  # (a module reached by two paths lists its parameters twice)
                shared.module._parameters.pop(shared.param_name, None)
            self._placeholders = {info: self._placeholder(info, dtype) for info in layout.params}
            self.drop_unsharded_views()
        # Last, once the original parameters are views of the shard or released: the buffer is allocated (then freed)
        # beside the shard only, not beside the unit's originals as well.
        self._allocate_unsharded()

    def _set_precision(self, dtype: torch.dtype) -> None:
        """What follows from the local shard's dtype and the compute dtype."""
        self.grad_dtype = self.compute_dtype if self.keep_low_precision_grads else dtype
        if self.keep_low_precision_grads and not self.sharded and not self.offload:
            self.grad_dtype = self.reduce_dtype  # torch's NO_SHARD skips the cast back: kept as all-reduced
        self.mixed = self.compute_dtype != dtype
        # Forward/backward use a separate unsharded buffer when sharded, low precision or offloaded (NO_SHARD in full
        # precision on the compute device computes on the flat parameter itself).
        self.uses_buffer = self.sharded or self.mixed or self.offload
        # NO_SHARD's unsharded buffer is a local cast (or copy) of the flat parameter: it is dropped after every
        # forward, the root's too, and recast in backward, as torch does, rather than held through backward.
        self.recast_only = self.uses_buffer and not self.sharded
        self.reshard_after_forward = self._strategy_reshards_after_forward or self.recast_only
        self.is_unsharded = not self.uses_buffer

    def _allocate_unsharded(self) -> None:
        """The unsharded buffer in the compute dtype (storage freed until an unshard), or the local shard itself when
        none is needed."""
        if not self.uses_buffer:
            self.full_padded = self.local_shard
            return
        dtype = self.compute_dtype  # (the local shard's own unless mixed)
        self.full_padded = freed_tensor(self.layout.padded_numel, dtype, self.compute_device)
        if self.mixed or self.offload:
            self._unsharded_buffers = {dtype: self.full_padded}  # by dtype: see select_precision

    @torch.no_grad()
    def adopt_replaced_flat_param(self, keep_device: bool = False) -> None:
        """Called at the first forward, as torch's FSDP1 reads the flat parameter again at its lazy init: frameworks
        replace its data after wrapping (Accelerate upcasts low-precision flat parameters to float32 by assigning
        `_flat_param.data`, and sets `_handle._orig_param_dtype`). The new data becomes the local shard, and as in
        torch a dtype other than `_orig_param_dtype` also becomes the compute dtype and the reduce dtype where
        MixedPrecision did not set them. The shard goes back where it lives (the CPU when offloaded, else the compute
        device) unless `keep_device` (flat_param_to)."""
        data, shard = self.flat_param.data, self.local_shard
        if self.is_unsharded and self.uses_buffer:
            return  # only at rest is .data the local shard
        if data.dtype == shard.dtype and same_memory(data, shard):
            return
        if data.shape != shard.shape:
            raise ValueError(
                f"The flat parameter of the FSDP unit holding {', '.join(self.flat_param._fqns)} was given data of "
                f"shape {tuple(data.shape)}; it must keep its local shard's shape {tuple(shard.shape)} (change its "
                "dtype or device only)."
            )
        if data.dtype != self._orig_param_dtype:
            if not self._param_dtype_given:
                self.compute_dtype = data.dtype
                if not self._reduce_dtype_given:
                    self.reduce_dtype = data.dtype
            self._orig_param_dtype = data.dtype
        if not keep_device:
            data = data.to("cpu" if self.offload else self.compute_device)
        self.local_shard = data
        self._set_precision(data.dtype)
        self._allocate_unsharded()
        self.flat_param.data = self.flat_param._local_shard = data
        if self.use_orig_params:
            self._use_sharded_orig_params()
        else:
            self._placeholders = {i: self._placeholder(i, data.dtype) for i in self._placeholders}
            self.drop_unsharded_views()

    @torch.no_grad()
    def flat_param_to(self, *args: Any, **kwargs: Any) -> None:
        """torch's `FlatParamHandle.flat_param_to`: the flat parameter moved in place by `.to(*args, **kwargs)`, at
        rest. verl offloads a model's parameters between its training steps this way (to the CPU, then back to the
        GPU, assigning `_local_shard` after each move): the moved data becomes the local shard at once, so the old
        storage is released and the next unshard gathers the new one. The unsharded buffer stays on the compute
        device, and a shard elsewhere is copied there to be gathered (NO_SHARD in full precision computes on the shard
        itself, so it needs it back on the compute device)."""
        if self.training_state != HandleTrainingState.IDLE or (self.is_unsharded and self.uses_buffer):
            raise RuntimeError(
                f"flat_param_to() on the FSDP unit holding {', '.join(self.flat_param._fqns)} while it is unsharded "
                "(inside forward, backward or summon_full_params): move it between iterations."
            )
        self.flat_param.data = self.flat_param.detach().to(*args, **kwargs)
        self.adopt_replaced_flat_param(keep_device=True)

    @property
    def _offload_params(self) -> bool:  # torch's name
        return self.offload

    # ----------------------------------------------------------------------------------------------------------------
    # Unshard / reshard

    def select_precision(self, full_precision: bool) -> None:
        """FSDP_USE_FULL_PREC_IN_EVAL: a mixed-precision unit then gathers and computes in full precision. The
        choice is made while resharded, so each unshard uses one buffer throughout; a unit still gathered in the other
        precision (kept for a backward, SHARD_GRAD_OP) reshards first, and that backward can no longer run."""
        if not self.mixed:
            return
        dtype = self.local_shard.dtype if full_precision else self.compute_dtype
        if dtype == self.full_padded.dtype:
            return
        if not self.must_gather:  # still gathered in the other precision from a forward (SHARD_GRAD_OP): let go
            self.reshard()
        self.full_padded = self.unsharded_buffer(dtype)

    def unsharded_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The unsharded buffer that gathers in `dtype` (storage freed while sharded; made, freed, if none yet)."""
        if not (self.mixed or self.offload):
            return self.full_padded
        if dtype not in self._unsharded_buffers:
            self._unsharded_buffers[dtype] = freed_tensor(self.layout.padded_numel, dtype, self.compute_device)
        return self._unsharded_buffers[dtype]

    @property
    def must_gather(self) -> bool:
        """Neither unsharded, nor being gathered, nor kept from forward (torch's `needs_unshard()`, a method:
        handle_torch_names.py)."""
        return not self.is_unsharded and self.unshard_work is None and not self.kept_for_backward

    @property
    def holds_gathered_copy(self) -> bool:
        """The unsharded storage holds a gather this iteration may still use (shown now, or kept for backward):
        anything that changes the shard must reshard first, so that backward gathers again."""
        return self.uses_buffer and (self.is_unsharded or self.kept_for_backward)

    def start_unshard(self) -> None:
        """Issue the all-gather of the full flat parameter (asynchronously); `wait_unshard` completes it."""
        if not self.must_gather:
            return
        self.prepare_unshard()
        if not self.sharded:  # NO_SHARD in low precision: a local cast, nothing to gather
            self.full_padded[: self.layout.numel].copy_(self.local_shard)
            self.unshard_work = comm.DONE
            return
        shard = self.local_shard.to(device=self.compute_device, dtype=self.full_padded.dtype, non_blocking=True)
        self.unshard_work = comm.all_gather(self.full_padded, shard, self.group)
        self._gather_input = shard

    def prepare_unshard(self) -> None:
        """What precedes any all-gather of this handle (its own, or one shared with other units: buckets.py):
        user edits of the original parameters reach the shard, and the unsharded storage is allocated."""
        self.writeback_orig_params()
        alloc_storage(self.full_padded)

    def wait_unshard(self) -> None:
        if self.is_unsharded:
            return
        if self.kept_for_backward:
            self.kept_for_backward = False
        else:
            self.start_unshard()
            self._finish_unshard_work()
        self.flat_param.data = self.full_padded  # `.grad` may keep the sharded gradient's shape: see above
        self.is_unsharded = True

    def _finish_unshard_work(self) -> None:
        work, self.unshard_work = self.unshard_work, None
        assert work is not None, "start_unshard() issues the all-gather first"
        work.wait()
        gather_input, self._gather_input = self._gather_input, None
        if gather_input is not None and gather_input is not self.local_shard and gather_input.device.type == "cpu":
            # A low-precision copy of the shard: free it now rather than whenever the backend's work object, which
            # keeps its inputs, is released (gloo's may outlive wait()).
            free_storage(gather_input)

    def reshard(self, free_unsharded_flat_param: bool = True) -> None:
        """Back to the local shard and free the unsharded storage (unless told not to: finish_backward). torch's
        name and meaning for the argument, which code passes by keyword."""
        free = free_unsharded_flat_param
        self.kept_gathered = self.uses_buffer and not free
        self.kept_for_backward = self.kept_for_backward and not free
        self.prefetched = False
        self.drop_unsharded_views()
        if not self.uses_buffer:
            return
        if self.unshard_work is not None:  # a prefetch nobody used: it must finish before its buffer is freed
            self._finish_unshard_work()
        if self.is_unsharded:
            self.flat_param.data = self.local_shard
            self.is_unsharded = False
        if free:
            free_storage(self.full_padded)
            self.forward_views = {}

    def keep_unsharded_after_forward(self) -> None:
        """Forward is over and the unit stays gathered for backward. As in torch, the flat parameter shows its local
        shard until then (the gathered storage waits aside); SHARD_GRAD_OP keeps showing the unsharded views of the
        original parameters (torch's `_skipped_use_sharded_views`), otherwise (a FULL_SHARD root, NO_SHARD)
        use_orig_params=True shows the original parameters again."""
        if self.use_orig_params and not self.skipped_sharded_views_after_forward:
            self.drop_unsharded_views()
        if self.uses_buffer and self.is_unsharded:
            self.flat_param.data = self.local_shard
            self.is_unsharded = False
            self.kept_for_backward = True

    @property
    def skipped_sharded_views_after_forward(self) -> bool:
        """use_orig_params with a strategy that keeps the gather after forward: the unsharded views stay shown."""
        return self.use_orig_params and self.sharded and not self._strategy_reshards_after_forward

    # ----------------------------------------------------------------------------------------------------------------
    # Views of the original parameters

    def use_unsharded_views(self) -> None:
        """Point each original parameter's attribute at a view of the unsharded flat parameter.

        The views are made afresh each forward so autograd records them under the current grad mode and routes their
        gradients into the flat parameter. They go into the module's __dict__, which attribute lookup reads before
        `_parameters`, so with use_orig_params=True the registered parameters stay untouched.
        """
        numel = self.flat_param.numel()
        sizes = self._split_sizes.get(numel)
        if sizes is None:
            sizes = [segment_numel for segment_numel, _ in self.layout.segments]
            if numel > self.layout.numel:  # the world-size padding: a last chunk that no parameter reads
                sizes.append(numel - self.layout.numel)
            self._split_sizes[numel] = sizes
        # One split (a single autograd node) rather than a slice per parameter, which would each backpropagate a
        # full-size gradient.
        chunks = self.flat_param.split_with_sizes(sizes)
        views = {
            info: view_flat(chunks[index], info.shape, info.stride)
            for info, index in zip(self.layout.params, self._param_chunks, strict=True)
        }
        for info, param in self.orig_params.items():
            if not param.requires_grad:  # frozen (use_orig_params=True): autograd computes no gradient for it
                views[info] = views[info].detach()
        for info in (*self._typed, *self.dtensors):
            views[info] = self.typed(views[info], info)
        # (torch sets use_orig_params=False views in forward only: backward's go straight into the dicts)
        forward = self.use_orig_params or self.training_state == HandleTrainingState.FORWARD
        through_setattr = forward and self._setattr_modules
        for module, name, info in self._attribute_refs:
            show(module, name, views[info], bool(through_setattr) and module in self._setattr_modules)
        if self.use_orig_params and self.training_state == HandleTrainingState.FORWARD:
            self._register_views(views)
            self.forward_views = views  # (torch's `_tensors`, until the unit reshards)

    def _placeholder(self, info: ParamInfo, dtype: torch.dtype) -> torch.Tensor:
        """A meta tensor of the parameter's shape (a DTensor parameter's global one) standing in outside forward, with
        the strides the parameter is viewed with (channels_last code reads them)."""
        record = self.dtensors.get(info)
        if record is not None:
            return torch.empty(record.shape, device="meta", dtype=dtype)
        if info.stride is not None:
            return self.typed(torch.empty_strided(info.shape, info.stride, device="meta", dtype=dtype), info)
        return self.typed(torch.empty(info.shape, device="meta", dtype=dtype), info)

    def typed(self, tensor: torch.Tensor, info: ParamInfo) -> torch.Tensor:
        """`tensor` as an instance of the original parameter's class with its attributes, when that is a Parameter
        subclass, or as the DTensor it is the local piece of (the result shares data and autograd history with
        `tensor`); `tensor` itself otherwise."""
        record = self.dtensors.get(info)
        if record is not None:
            return record.wrap(tensor)
        original = self._typed.get(info)
        if original is None:
            return tensor
        result = tensor.as_subclass(type(original))
        result.__dict__.update(original.__dict__)
        return result

    def as_parameter(self, data: torch.Tensor, info: ParamInfo, requires_grad: bool) -> nn.Parameter:
        """A parameter of the original's class (with its attributes) holding `data`, as summon_full_params shows it."""
        record = self.dtensors.get(info)
        if record is not None:
            return nn.Parameter(record.wrap(data), requires_grad=requires_grad)
        original = self._typed.get(info)
        if original is None:
            return nn.Parameter(data, requires_grad=requires_grad)
        param = torch.Tensor._make_subclass(type(original), data, requires_grad)
        param.__dict__.update(original.__dict__)
        return param

    def typed_grad(self, grad: torch.Tensor, info: ParamInfo) -> torch.Tensor:
        """A gradient as the parameter shows it: a DTensor for a DTensor parameter."""
        record = self.dtensors.get(info)
        return record.wrap(grad) if record is not None else grad

    def drop_unsharded_views(self) -> None:
        """Outside forward/backward: use_orig_params=True falls back to the registered (sharded) parameters. With
        use_orig_params=False the attributes become meta-device placeholders of the original shapes, so code such as
        `module.bias is not None` or repr() keeps working while any use of the data fails loudly.
        """
        for module, name, info in self._attributes():
            if self.use_orig_params:  # the registered parameter shows again (torch sets it)
                show(module, name, None, module in self._setattr_modules)
            else:  # (a placeholder: torch leaves the attribute as it was, so the module's __setattr__ sees nothing)
                module.__dict__[name] = self._placeholders[info]
        if self._registered_views:
            self._register_orig_params()

    def _attributes(self) -> tuple[tuple[nn.Module, str, ParamInfo], ...]:
        """(module, attribute name, ParamInfo) of every original parameter reference, tied ones included."""
        return self._attribute_refs

    def writeback_orig_params(self) -> None:
        """use_orig_params=True: take in replaced original parameters before an unshard (orig_param_views.py)."""
        if self.use_orig_params and self.training_state != HandleTrainingState.SUMMON_FULL_PARAMS:
            self._writeback_orig_params()  # (summon_full_params shows full views in their place, writes back itself)

    def follow_orig_requires_grad(self) -> None:
        """use_orig_params=True: the flat parameter requires grad while any original parameter does, frozen or
        unfrozen since wrapping (torch's FSDP1 sets it so at each root forward too)."""
        if self.use_orig_params and self.orig_params:
            self.flat_param.requires_grad = any(p.requires_grad for p in self.orig_params.values())

    def _use_sharded_orig_params(self) -> None:
        """use_orig_params=True: original parameters become views of the local shard (1-D pieces when sharded)."""
        for info, param in self.orig_params.items():
            param.data = self._local_view(self.local_shard, info)
        self._register_orig_params()

    # ----------------------------------------------------------------------------------------------------------------
    # End of backward (what becomes of the gradients: flat_param_grads.py)

    def finish_backward(self, free: bool = True) -> None:
        """End of backward: back to the shard, with this backward's gradient added to the sharded gradient. With
        `free` False (a backward with create_graph=True: runtime.py) the unsharded storage, which that backward's
        graph saved views of, keeps its data until the next iteration; a backward that needs it gathers it again."""
        self.reshard(free)
        self._settle_grads()
        self.training_state = HandleTrainingState.IDLE
        self.needs_pre_backward = False
        self.post_backward_done = False
        self.backward_prepared = False
        if self.unsynced_grad is None:
            self._step_optimizers_in_backward()


def _uniform(params: list[nn.Parameter], key, what: str):
    values = {key(p) for p in params}
    if len(values) > 1:
        raise ValueError(
            f"Must flatten tensors with uniform {what}, but one FSDP unit holds {sorted(map(str, values))}. "
            "Wrap the differing parameters in separate FSDP units (or use use_orig_params=True for mixed "
            "requires_grad)."
        )
    return values.pop()


def _registered(module: nn.Module, name: str) -> nn.Parameter:
    param = module._parameters[name]
    assert param is not None, f"the layout lists {name}, so it is registered"
    return param
