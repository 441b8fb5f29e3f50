"""summon_full_params: the full parameters (and optionally gradients) of FSDP units, outside forward/backward.

Inside the context each original parameter is a view of its unit's all-gathered flat parameter, registered under its
own name (use_orig_params=False) or as the `.data` of the original Parameter (True). On exit, edits are written back
into the local shards (writeback=True) and the units reshard.
"""

import contextlib
import warnings
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from .handle import FlatParamHandle, HandleTrainingState, Summoned
from .storage import same_memory
from .unit import FSDPUnit, TrainingState


@contextlib.contextmanager
def summon_full_params(
    units: Sequence[FSDPUnit],
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    if writeback and rank0_only:
        raise NotImplementedError("writeback=True and rank0_only=True is not supported yet")
    if offload_to_cpu and not rank0_only:
        warnings.warn(
            "offload_to_cpu=True and rank0_only=False may result in the"
            "unsharded parameters being redundantly copied to CPU memory for "
            "GPUs sharing the same CPU memory, which risks CPU OOM. We "
            "recommend using offload_to_cpu=True with rank0_only=True.",
            stacklevel=3,
        )
    for unit in units:
        if unit.training_state == TrainingState.FORWARD_BACKWARD:
            raise AssertionError("Cannot manually unshard parameters during forward/backward")
        if unit.training_state == TrainingState.SUMMON_FULL_PARAMS:
            raise AssertionError("Cannot manually unshard parameters when already unsharding parameters")
    with contextlib.ExitStack() as stack:
        for unit in units:
            stack.enter_context(_summon_unit(unit, writeback, rank0_only, offload_to_cpu, with_grads))
        yield


@contextlib.contextmanager
def _summon_unit(
    unit: FSDPUnit, writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
) -> Iterator[None]:
    unit.training_state = TrainingState.SUMMON_FULL_PARAMS
    try:
        with contextlib.ExitStack() as stack:
            for handle in unit._handles:
                stack.enter_context(_summon_handle(unit, handle, writeback, rank0_only, offload_to_cpu, with_grads))
            if len(unit._handles) > 1 and not unit._use_orig_params:
                _in_registration_order(unit)
            yield
    finally:
        unit.training_state = TrainingState.IDLE


@contextlib.contextmanager
def _summon_handle(
    unit: FSDPUnit, handle: FlatParamHandle, writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
) -> Iterator[None]:
    _writeback_on_every_rank(handle)
    handle.training_state = HandleTrainingState.SUMMON_FULL_PARAMS
    try:
        # use_orig_params=True: take in what the user did to the gradients since backward (zero_grad), or the exit,
        # which points the parameters' .grad at the sharded gradient again, would bring the old one back.
        handle.sync_grad_from_orig_params()
        # Gathered in full precision into a buffer of its own (not the forward's, which may be low precision); under
        # NO_SHARD the local flat parameter is already whole, so edits to it persist, as torch documents.
        full = handle.gather_full(handle.local_shard)
        full_grad = handle.gather_full_grad() if with_grads else None
        if rank0_only and handle.rank != 0 and handle.sharded:
            handle.summoned = Summoned(None, rank0_only)
            yield  # this rank keeps its shard; it took part in the collective for rank 0
            return
        if offload_to_cpu and full.device.type != "cpu":
            full = full.cpu()
        # Meanwhile the flat parameter is the unsharded one, without the world padding, as torch's.
        data_before = handle.flat_param.data
        if handle.sharded:
            handle.flat_param.data = full[: handle.layout.numel]
        handle.summoned = Summoned(full, rank0_only)
        _expose(unit, handle, full, full_grad)
        try:
            yield
        finally:
            if writeback and handle.sharded:
                _write_back(handle, handle.summoned.full if handle.summoned.full is not None else full)
            if handle.sharded:  # (NO_SHARD's flat parameter stayed the local shard, converted in place or not)
                handle.flat_param.data = data_before
            _hide(unit, handle)
    finally:
        handle.summoned = None
        handle.training_state = HandleTrainingState.IDLE


@torch.no_grad()
def _write_back(handle: FlatParamHandle, full: torch.Tensor) -> None:
    """This rank's range of the whole flat tensor into its local shard (the padding past the parameters stays; a
    tensor `_apply` converted inside the summon is unpadded, and copy_ casts it back)."""
    n = handle.layout.shard_numel
    start = handle.rank * n
    piece = full[start : min(start + n, full.numel())]
    handle.local_shard[: piece.numel()].copy_(piece)


def adopt_summoned_conversion(handle: FlatParamHandle) -> bool:
    """After nn.Module._apply inside a summon of a sharded unit: the converted unsharded flat parameter becomes what
    the summon shows and writes back (the original parameters view it), and the local shard stays as it was, as with
    torch's FSDP1, whose reshard at the summon's end puts the unconverted shard back. Returns whether the handle was
    summoned so (the caller then leaves the flat parameter's new data alone)."""
    summoned = handle.summoned
    if summoned is None or summoned.full is None or not handle.sharded:
        return False
    data = handle.flat_param.data
    if same_memory(data, summoned.full[: handle.layout.numel]):
        return True  # unchanged (`.to()` of the device and dtype it has already)
    summoned.full = data
    for info, param in handle.orig_params.items():
        if info not in handle.dtensors:
            param.data = info.view_in(data)
    return True


def _writeback_on_every_rank(handle: FlatParamHandle) -> None:
    """use_orig_params=True: replaced parameters are written back before the gather, as torch does. A rank that
    cannot (a changed shape) raises torch's error; the others learn of it and raise too rather than wait in the
    all-gather (torch's ranks would hang there)."""
    if not handle.use_orig_params:
        return
    handle.drop_unsharded_views()  # views kept from a forward (SHARD_GRAD_OP) give way to the parameters, as in torch
    error: RuntimeError | NotImplementedError | None = None
    try:
        handle.writeback_orig_params()
    except (RuntimeError, NotImplementedError) as raised:
        error = raised
    if handle.sharded and handle.world_size > 1:
        failed = torch.tensor([float(error is not None)], device=handle.compute_device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=handle.group)
        if failed.item() and error is None:
            raise RuntimeError(
                "Cannot writeback: another rank of this FSDP unit's group found a parameter or gradient whose shape "
                f"changed (units holding {', '.join(handle.flat_param._fqns)})"
            )
    if error is not None:
        raise error


def _in_registration_order(unit: FSDPUnit) -> None:
    """Parameters shown by several flat parameters (use_orig_params=False), each module's in registration order, as
    named_parameters() lists them on the plain model."""
    rank = unit._registration_order
    for handle in unit._handles:
        owners = [(i.module, i.module_name) for i in handle.layout.params]
        for module, module_name in owners + [(s.module, s.module_name) for s in handle.layout.shared]:
            params = module._parameters
            prefix = module_name + "." if module_name else ""
            shown = sorted((n for n in params if prefix + n in rank), key=lambda n: rank[prefix + n])
            for name in shown:  # moved to the end in order; the module's other parameters stay in front
                params[name] = params.pop(name)


def _expose(unit: FSDPUnit, handle: FlatParamHandle, full: torch.Tensor, full_grad: torch.Tensor | None) -> None:
    views = {info: info.view_in(full) for info in handle.layout.params}
    if handle.use_orig_params:
        handle._register_orig_params()
        for info, param in handle.orig_params.items():
            param.data = views[info]
            if full_grad is not None and param.requires_grad:
                param.grad = info.view_in(full_grad)
        for module, name, info in handle._attributes():  # DTensor parameters are shown as DTensors, as in torch
            if info in handle.dtensors:
                param = handle.orig_params[info]
                shown = handle.as_parameter(param.data, info, param.requires_grad)
                if param.grad is not None:
                    shown.grad = handle.typed_grad(param.grad, info)
                module._parameters[name] = shown
        return
    unit.module._parameters.pop(handle.flat_name, None)
    requires_grad = handle.flat_param.requires_grad
    params = {}
    for info, view in views.items():
        param = handle.as_parameter(view, info, requires_grad)
        if full_grad is not None:
            param.grad = handle.typed_grad(info.view_in(full_grad), info)
        params[info] = param
    for module, name, info in handle._attributes():
        module.__dict__.pop(name, None)
        module._parameters[name] = params[info]


def _hide(unit: FSDPUnit, handle: FlatParamHandle) -> None:
    if handle.use_orig_params:
        for module, name, info in handle._attributes():
            if info in handle.dtensors:
                module._parameters[name] = handle.orig_params[info]
        handle._use_sharded_orig_params()
        # The gradients shown before the context again, as torch: the sharded ones (also when the unit stays
        # unsharded after a forward), or under no_sync() the accumulated unsharded ones.
        if handle.uses_buffer and handle.unsynced_grad is not None:
            handle._expose_unsynced_grads()
        else:
            handle._use_orig_grad_views()
        return
    for module, name, _ in handle._attributes():
        module._parameters.pop(name, None)
    unit.module.register_parameter(handle.flat_name, handle.flat_param)
    handle.drop_unsharded_views()
