"""The per-step state machine shared by all FSDP units under one root.

    forward:   pre_forward (all-gather, views)  -> wrapped module -> post_forward (reshard, pre-backward hooks)
    backward:  pre-backward hook on the unit's outputs (all-gather again if resharded)
               -> post-backward hook after the flat parameter's gradient accumulates (reduce-scatter, reshard)
               -> end-of-backward callback once autograd is done (wait reductions, install sharded gradients);
                  after a backward that raised, the root's next forward ends it instead

Collectives are asynchronous, and each overlaps the compute of one unit:
- all-gathers: the next unit's (prefetch) is issued before waiting on the current one's. In backward as
  `backward_prefetch` says; in forward as `forward_prefetch` says, and on CPU also implicitly (below).
- reductions: a unit's gradient reduction completes at the next unit's post-backward (or at the end of backward), so
  it runs during that unit's backward, and the unsharded gradients alive are one unit's (or one bucket's) at a time.
"""

from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map_only

from . import runtime_names
from .api import BackwardPrefetch, full_precision_eval_requested
from .buckets import ReduceBucket, bucket_bytes_from_env, gather_group, unshard_together, upcoming
from .exec_order import ExecOrderCheck, enabled
from .flat_param_grads import PendingReduction
from .handle import FlatParamHandle, HandleTrainingState
from .unit import FSDPUnit, TrainingState, set_training_state

# On CUDA the CPU runs ahead of the GPU; this many resharded-but-not-yet-executed units are allowed before the
# CPU waits, which bounds the memory of all-gathers issued ahead (torch FSDP1's limit_all_gathers).
MAX_INFLIGHT_RESHARDS = 2


class Runtime:
    def __init__(self, root: FSDPUnit, units: Sequence[FSDPUnit]):
        self.root = root
        self.units = units  # pre-order, root first
        self.forward_order: list[FSDPUnit] = []  # this iteration's first-use order of units with parameters
        self.previous_forward_order: list[FSDPUnit] = []  # the last iteration's, for forward prefetch
        self.iteration_done = True  # the next root forward starts a new iteration
        # Issued reductions, oldest first; the units reduced by one collective together are one entry.
        self.pending: deque[list[PendingReduction]] = deque()
        self.backward_callback_queued = False
        self.compute_device = root.compute_device
        self.limit_all_gathers = root.limit_all_gathers and self.compute_device.type == "cuda"
        self.reshard_events: deque = deque()
        self.full_precision_eval = False
        # Per unit with frozen flat parameters: its runs in this iteration whose backward is still to come (-1: a run
        # that cannot be tracked, so they reshard at the end of backward).
        self.frozen_runs: dict[FSDPUnit, int] = {}
        # torch's execution-order checks, at the DETAIL debug level only (else no cost but this None).
        self.exec_order = ExecOrderCheck(root, units) if enabled() else None
        # Consecutive small units share one all-gather, and one reduce-scatter, within this many unsharded bytes
        # (buckets.py). Not at the DETAIL level, whose collectives are torch's one for one: a rank whose forward order
        # changed (which torch's check warns about there) then issues as many collectives as the others, as in torch.
        self.gather_bucket_bytes = 0 if self.exec_order is not None else bucket_bytes_from_env()
        self.reduce_bucket = ReduceBucket(self.gather_bucket_bytes)

    # ----------------------------------------------------------------------------------------------------------------
    # Forward

    def pre_forward(self, unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if unit is self.root:
            args, kwargs = self._root_pre_forward(args, kwargs)
        set_training_state(unit, TrainingState.FORWARD_BACKWARD)
        mp = unit.mixed_precision
        # (as torch's, a unit without parameters casts nothing: cast_forward_inputs follows the unit's handle)
        cast = (mp.cast_forward_inputs and bool(unit._handles)) or (unit is self.root and mp.cast_root_forward_inputs)
        if mp.param_dtype is not None and cast and not self.full_precision_eval:
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: t.to(mp.param_dtype) if t.is_floating_point() else t, (args, kwargs)
            )
        if not unit._handles:
            self._register_post_backward_hook(unit, None)
        else:
            rerun_in_backward = unit._handles[0].training_state == HandleTrainingState.BACKWARD_PRE  # (checkpointing)
            # (not for an activation-checkpointed re-run in backward, as torch)
            if self.exec_order is not None and not rerun_in_backward:
                self.exec_order.pre_forward(unit, unit.training)
            for handle in unit._handles:
                if not handle.must_gather:  # a gathering unit writes back in start_unshard(), before its all-gather
                    handle.writeback_orig_params()
                handle.training_state = HandleTrainingState.FORWARD
                handle.prefetched = False  # (an FSDP._unshard() gather is this forward's now)
                self._register_post_backward_hook(unit, handle)  # (unfrozen since it was wrapped)
            if unit not in self.forward_order:
                self.forward_order.append(unit)
            self._issue_unshard(unit, backward=False)
            if self._prefetches_in_forward(unit, rerun_in_backward):
                limit = self.root._exec_order_data._forward_prefetch_limit if unit.forward_prefetch else 1
                following = _ahead(self.previous_forward_order, unit, +1, limit)
                if following not in self.forward_order:  # (not one this iteration ran already: an order changed)
                    self._prefetch(following, backward=False)
            for handle in unit._handles:
                handle.wait_unshard()
                handle._use_unsharded_views(as_params=False)  # (through the class: see the handle)
            if not rerun_in_backward:  # (the original forward's hook covers an activation-checkpointed re-run)
                self._register_frozen_reshard(unit, args, kwargs)
        return args, kwargs

    def _prefetches_in_forward(self, unit: FSDPUnit, rerun_in_backward: bool) -> bool:
        """`forward_prefetch`, and on CPU also the implicit prefetch that CUDA gets for free: there the CPU runs ahead
        of the GPU and issues the next unit's all-gather while this one computes; on CPU nothing runs ahead, so the
        all-gather is issued here. Implicitly only with BACKWARD_PRE, under which backward holds two units' unsharded
        parameters anyway (a forward holding two raises no peak), and not in a re-run of forward during backward
        (activation checkpointing), whose next unit in forward order has had its backward already. Not at the DETAIL
        debug level either, whose collectives are torch's one for one (see `gather_bucket_bytes`)."""
        if unit.forward_prefetch:
            return True
        return (
            self.compute_device.type == "cpu"
            and self.exec_order is None
            and unit.backward_prefetch == BackwardPrefetch.BACKWARD_PRE
            and not rerun_in_backward
        )

    def _register_frozen_reshard(self, unit: FSDPUnit, args: tuple, kwargs: dict) -> None:
        """A flat parameter without gradient (frozen weights, integer ones) has no post-backward hook to reshard it:
        reshard it once the gradients of the unit's inputs are computed, when its backward is over, as torch's FSDP1
        does, rather than holding it unsharded until the end of backward. A unit run several times waits for the
        backward of every run; one run whose inputs need no gradient leaves no such moment: the end of backward."""
        if not torch.is_grad_enabled() or all(handle.flat_param.requires_grad for handle in unit._handles):
            return
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:
            self.frozen_runs[unit] = -1  # untracked until the end of backward
        elif self.frozen_runs.get(unit, 0) >= 0:
            self.frozen_runs[unit] = self.frozen_runs.get(unit, 0) + 1
            torch.autograd.graph.register_multi_grad_hook(inputs, partial(self._reshard_frozen, unit))

    def _reshard_frozen(self, unit: FSDPUnit, grads: Sequence[torch.Tensor | None]) -> None:
        runs = self.frozen_runs.get(unit, 0)
        if runs <= 0:
            return
        self.frozen_runs[unit] = runs - 1
        if runs > 1:
            return
        # (FORWARD: a non-reentrant activation-checkpointed re-run, which stops once it has recomputed what backward
        # needs, before the unit's post-forward)
        in_backward = (HandleTrainingState.BACKWARD_PRE, HandleTrainingState.FORWARD)
        for handle in unit._handles:
            if not handle.flat_param.requires_grad and handle.training_state in in_backward:
                self._post_backward_reshard(unit, handle)

    def _root_pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.backward_callback_queued and not _inside_backward():
            self._end_interrupted_backward()
        if self.iteration_done:
            self.previous_forward_order, self.forward_order = self.forward_order, []
            self.iteration_done = False
            self.frozen_runs.clear()
            # A unit gathered ahead (a group, a prefetch) that the last iteration did not run, or whose unsharded
            # storage a backward with create_graph=True (or a forward whose backward never came) kept: its gather
            # may predate an optimizer step or a load, so it is dropped rather than used.
            for unit in self.units:
                for handle in unit._handles:
                    if handle.prefetched:  # gathered by FSDP._unshard() for this forward
                        continue
                    if handle.unshard_work is not None or handle.kept_gathered or handle.kept_for_backward:
                        self._reshard(handle)
        # torch FSDP1's switch: in eval mode, mixed-precision units compute in full precision.
        full_precision_eval = not self.root.training and full_precision_eval_requested()
        if full_precision_eval != self.full_precision_eval:  # buffers too, as torch's (back in train mode)
            for unit in self.units:
                unit._cast_buffers(full_precision_eval)
        self.full_precision_eval = full_precision_eval
        for unit in self.units:
            for handle in unit._handles:
                handle.select_precision(self.full_precision_eval)
                handle.follow_orig_requires_grad()
                # use_orig_params: after zero_grad(set_to_none=True) the sharded gradients are freed now, not when
                # backward reaches each unit (they would live through forward, at the step's peak).
                handle.sync_grad_from_orig_params()
        if self.compute_device.type != "cpu":
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: t.to(self.compute_device, non_blocking=True), (args, kwargs)
            )
        return args, kwargs

    def post_forward(self, unit: FSDPUnit, output: Any) -> Any:
        grad_enabled = torch.is_grad_enabled()
        for handle in unit._handles:
            # The root keeps its parameters for the backward that follows at once (as torch FSDP1 does), unless they
            # are only a local recast (NO_SHARD); without grad there is no backward, so everything reshards.
            if not grad_enabled or (handle.reshard_after_forward and (unit is not self.root or handle.recast_only)):
                self._reshard(handle)
            else:
                handle.keep_unsharded_after_forward()
            handle.training_state = HandleTrainingState.IDLE
            # (a run without grad leaves an earlier run's pending backward as it is: that one still needs the gather)
            handle.needs_pre_backward = handle.needs_pre_backward or grad_enabled
        register = runtime_names.replacement("_register_pre_backward_hooks")
        if register is not None:  # code wrapped torch's name (runtime_names.py): it runs, and calls ours back
            output = register(unit, unit, output, unit._handles[0] if unit._handles else None)
        else:
            output = self.register_pre_backward_hooks(unit, output)
        if not grad_enabled and unit is self.root:
            self.iteration_done = True
        # As in torch: a unit is IDLE between its forward and its backward (which may never come), so summon,
        # clip_grad_norm_ and state dicts work there; the pre-backward hook sets FORWARD_BACKWARD again.
        set_training_state(unit, TrainingState.IDLE)
        return output

    def register_pre_backward_hooks(self, unit: FSDPUnit, output: Any) -> Any:
        """The unit's pre-backward hook on every tensor of `output` that requires grad (none without grad)."""
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(partial(self._pre_backward, unit))
        return output

    @staticmethod
    def _register_post_backward_hook(unit: FSDPUnit, handle: FlatParamHandle | None) -> None:
        register = runtime_names.replacement("_register_post_backward_hook")
        if register is not None:  # (torch's calls it for a unit without parameters too, with None)
            register(unit, handle)
        elif handle is not None:
            unit._hook_post_backward(handle)

    def _post_backward_reshard(self, unit: FSDPUnit, handle: FlatParamHandle) -> None:
        reshard = runtime_names.replacement("_post_backward_reshard")
        if reshard is not None:
            reshard(unit, handle)
        else:
            self.reshard_after_backward(handle)

    # ----------------------------------------------------------------------------------------------------------------
    # Backward

    def _pre_backward(self, unit: FSDPUnit, grad: torch.Tensor) -> None:
        self._queue_backward_callback()
        set_training_state(unit, TrainingState.FORWARD_BACKWARD)
        task = torch._C._current_graph_task_id()
        handles = [handle for handle in unit._handles if handle.needs_pre_backward or _backward_again(handle, task)]
        if not handles:
            return
        # (torch shows use_orig_params views through `_use_unsharded_views` in backward unless forward left them shown)
        views_through_torch_name = {h: h.use_orig_params and not h._skipped_use_sharded_views for h in handles}
        for handle in handles:
            handle.needs_pre_backward = False
            handle.backward_task = task
            handle.training_state = HandleTrainingState.BACKWARD_PRE
        self._issue_unshard(unit, backward=True)
        if unit.backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
            self._prefetch_for_backward(unit)
        for handle in handles:
            handle.wait_unshard()
            handle.prepare_gradient_for_backward()
            # Activation checkpointing re-runs the unit's forward, or the part of it inside the unit, during backward:
            # the attributes must hold the data, and (autograd runs hooks without grad) views that require grad as in
            # forward. Otherwise a reentrant re-run gives the parameters no gradient, and a non-reentrant one saves
            # fewer tensors than the forward did and raises.
            with torch.enable_grad():
                if views_through_torch_name[handle]:
                    handle._use_unsharded_views(as_params=False)
                else:
                    handle.use_unsharded_views()

    def post_backward(self, unit: FSDPUnit, handle: FlatParamHandle) -> None:
        """Runs once this backward's gradient has accumulated into one of the unit's unsharded flat parameters."""
        self._queue_backward_callback()
        # The reductions issued before this unit's backward have overlapped it: complete them before issuing more.
        self._finish_reductions()
        handle.training_state = HandleTrainingState.BACKWARD_POST
        grad = handle.take_unsharded_grad()
        self._post_backward_reshard(unit, handle)  # before reducing, as torch FSDP1 does: no longer needed
        handle.unsynced_in_grad = not unit._sync_gradients and not handle.uses_buffer
        if not unit._sync_gradients:
            if handle.uses_buffer:  # otherwise (NO_SHARD) the gradient simply keeps accumulating into .grad
                handle.accumulate_unsynced(grad)
            handle.post_backward_done = True
            return
        if handle.uses_buffer:
            grad = handle.take_unsynced_into(grad)
        self._reduce(handle, grad)
        del grad
        handle.post_backward_done = True
        if unit.backward_prefetch == BackwardPrefetch.BACKWARD_POST:
            self._prefetch_for_backward(unit)

    def _reduce(self, handle: FlatParamHandle, grad: torch.Tensor | None) -> None:
        """Reduce the gradient, or leave it waiting in the bucket for the next units' gradients (buckets.py)."""
        bucket = self.reduce_bucket
        if grad is not None and bucket.budget > 0 and bucket.accepts(handle):
            if not bucket.fits(handle):
                self._issue_reductions(bucket.flush())
            if bucket.fits(handle):  # (a gradient alone over the budget is reduced alone)
                bucket.add(handle, grad)
                return
        self._issue_reductions(bucket.flush())  # (keeps the collectives in backward order)
        pending = handle.reduce_grad(grad)
        if pending is not None:
            self._issue_reductions([pending])

    def _issue_reductions(self, pending: list[PendingReduction]) -> None:
        if pending:
            self.pending.append(pending)

    def _queue_backward_callback(self) -> None:
        if not self.backward_callback_queued and _inside_backward():  # (code driving the hooks by hand calls
            self.backward_callback_queued = True  # end_backward_by_hand() instead)
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def post_backward_by_hand(self, unit: FSDPUnit, handle: FlatParamHandle) -> None:
        """torch's `_post_backward_hook` called by code outside a backward (Galvatron reduces the gradients that
        no_sync() accumulated this way, after gathering the unit): reduce the unit's unsharded gradient now."""
        handle.training_state = HandleTrainingState.BACKWARD_PRE
        handle.prepare_gradient_for_backward()  # (the accumulated gradient stays aside, as before a backward)
        self.post_backward(unit, handle)

    def reshard_after_backward(self, handle: FlatParamHandle) -> None:
        """torch's `_post_backward_reshard`, from the runtime's post-backward or called by code (Galvatron's own copy
        of torch's post-backward hook): the parameters are no longer needed; the gradient stays where it is (on the
        flat parameter, where such code reads it, until `reduce_by_hand`)."""
        handle.training_state = HandleTrainingState.BACKWARD_POST
        if handle.uses_buffer:
            self._reshard(handle)

    def reduce_by_hand(self, handle: FlatParamHandle) -> None:
        """torch's `_reduce_grad` / `_reduce_grad_no_shard` called by such code: reduce the unsharded gradient the
        flat parameter holds now into the sharded one (joined at `end_backward_by_hand`)."""
        handle.training_state = HandleTrainingState.BACKWARD_POST
        grad = handle.take_grad_left_by_code()
        if grad is not None:
            self._reduce(handle, grad)
        handle.post_backward_done = True

    def end_backward_by_hand(self) -> None:
        """torch's `_post_backward_final_callback` called by such code: complete the reductions, reshard, and go
        back to idle, as at the end of a backward."""
        unreduced = [
            unit
            for unit in self.units
            if unit._sync_gradients and any(h.unsynced_grad is not None for h in unit._handles)
        ]
        if unreduced:
            raise RuntimeError(
                f"FSDP's post-backward final callback found {len(unreduced)} unit(s) still holding gradients that "
                "no_sync() accumulated and nothing reduced. With use_orig_params=True the flat parameter shows no "
                "unsharded gradient, so code that reduces what `flat_param.grad` holds (a copy of torch's "
                "post-backward hook calling `_reduce_grad`) finds none: call "
                "`_runtime_utils._post_backward_hook(state, handle, None)` for each unit instead, or use "
                "use_orig_params=False."
            )
        self._end_of_backward()

    def _end_of_backward(self) -> None:
        self._issue_reductions(self.reduce_bucket.flush())
        self._finish_reductions()
        # A backward with create_graph=True (a gradient penalty's `autograd.grad(out, x, create_graph=True)`, a
        # Hessian-vector product) built a graph that saved views of the gathered parameters: a backward of that graph
        # reads them, possibly before any hook of ours runs, so their storage keeps its data until the next iteration.
        higher_order = _inside_backward() and torch.is_grad_enabled()
        for unit in self.units:
            for handle in unit._handles:
                handle.finish_backward(free=not higher_order)
            set_training_state(unit, TrainingState.IDLE)
        self.reshard_events.clear()
        self.frozen_runs.clear()
        self.backward_callback_queued = False
        self.iteration_done = True
        if self.exec_order is not None:
            self.exec_order.next_iteration()

    def _end_interrupted_backward(self) -> None:
        """A backward that raised (an error in a loss, a hook or a custom function; a KeyboardInterrupt) never ran
        its end-of-backward callback: autograd drops queued callbacks on error, and without this every later backward
        would leave its gradients unreduced. Found at the next forward, which is after whatever the user did about
        the error (typically zero_grad()), so the interrupted backward's gradients are dropped (torch's FSDP1 adds
        them to the next backward's, past that zero_grad()): the collectives every rank issued before the error
        complete, their results are discarded, and each unit returns to its idle, sharded state with the gradient it
        had before that backward. (Gradients already in `.grad` stay, as plain autograd leaves them: with
        use_orig_params=True a unit's reduced gradient joins `.grad` as its reduction completes.)"""
        self.reduce_bucket.discard()
        while self.pending:
            for pending in self.pending.popleft():
                pending.work.wait()
        for unit in self.units:
            for handle in unit._handles:
                handle.new_grad = None
                handle.sync_grad_from_orig_params()  # (what the user did to the gradients since the error stands)
        self._end_of_backward()

    def _finish_reductions(self) -> None:
        """Complete the issued reductions, oldest first (the order every rank issued them in)."""
        while self.pending:
            for pending in self.pending.popleft():
                pending.handle.finish_reduction(pending)

    # ----------------------------------------------------------------------------------------------------------------
    # All-gather scheduling

    def _prefetch(self, unit: FSDPUnit | None, backward: bool) -> None:
        if unit is not None:
            self._issue_unshard(unit, backward, only_sharded=True)

    def _prefetch_for_backward(self, current: FSDPUnit) -> None:
        """Start the all-gather of a unit whose backward comes next: the one before `current` in forward order, or as
        many places before it as the root's backward prefetch limit says (torch's meaning of the limit)."""
        following = _ahead(self.forward_order, current, -1, self.root._exec_order_data._backward_prefetch_limit)
        if following is not None and any(handle.needs_pre_backward for handle in following._handles):
            self._prefetch(following, backward=True)

    def _issue_unshard(self, unit: FSDPUnit, backward: bool, only_sharded: bool = False) -> None:
        """All-gather the unit's flat parameters; a small one takes the units expected next along in the same
        collective (buckets.py): those that follow in forward order, or precede it in backward."""
        for handle in unit._handles:
            if not handle.must_gather or (only_sharded and not handle.sharded):
                continue
            if self.limit_all_gathers:
                while len(self.reshard_events) >= MAX_INFLIGHT_RESHARDS:
                    self.reshard_events.popleft().synchronize()
            group = [handle]
            if len(unit._handles) == 1 and self.gather_bucket_bytes > 0:
                order = self.forward_order if backward else self.previous_forward_order
                group = gather_group(handle, upcoming(order, unit, backward), self.gather_bucket_bytes)
            if len(group) > 1:
                unshard_together(group)
            else:
                handle.start_unshard()

    def _reshard(self, handle: FlatParamHandle) -> None:
        handle.reshard()
        if self.limit_all_gathers and handle.sharded:
            event = torch.cuda.Event()
            event.record()
            self.reshard_events.append(event)


def _inside_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a forward re-run for activation
    checkpointing, say), as torch.utils.checkpoint asks it."""
    return torch._C._current_graph_task_id() != -1


def _backward_again(handle: FlatParamHandle, task: int) -> bool:
    """A graph kept by `retain_graph=True` backpropagated once more (`loss.backward(retain_graph=True)` twice, two
    losses of one forward, `autograd.grad` of an activation before `backward()`): an earlier backward (another graph
    task) ended, which resharded every unit, whether it reached the unit or not. A hook firing for a unit at rest means
    autograd needs its parameters again, so it gathers them again, and the gradients of the backwards add up, as
    without FSDP. torch's FSDP1 does not: autograd then reads the freed storage and raises."""
    return handle.training_state == HandleTrainingState.IDLE and handle.backward_task != task


def _ahead(order: list[FSDPUnit], unit: FSDPUnit, direction: int, limit: int) -> FSDPUnit | None:
    """The unit `limit` places from `unit` along `order` in `direction` (+1 forward, -1 backward), or the last one
    there is in that direction: what torch's prefetch limits (`_exec_order_data._forward_prefetch_limit`) pick. So
    with a limit of 2 each unit gathers the one after next, and the next one was gathered by the unit before it."""
    try:
        index = order.index(unit)
    except ValueError:
        return None
    target = min(max(index + direction * max(limit, 1), 0), len(order) - 1)
    return order[target] if target != index else None
