"""Construction of FullyShardedDataParallel before flattening: resolving its arguments into a UnitSetup (enums,
ignored states, process groups, the compute device) and preparing the module (meta-device materialisation, moving,
broadcasting from rank 0). What the unit manages is found afterwards in one walk: unit_plan.py."""

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _get_default_group

from .api import BackwardPrefetch, ShardingStrategy
from .tensor_parallel import local_tensor
from .unit import FSDPUnit

# --------------------------------------------------------------------------------------------------------------------
# Argument resolution

HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


@dataclass(frozen=True)
class UnitSetup:
    """A unit's constructor arguments, resolved: what it leaves alone, which ranks share it, where it computes."""

    sharding_strategy: ShardingStrategy
    backward_prefetch: BackwardPrefetch | None
    ignored_modules: set[nn.Module]  # the ignored modules and all their submodules
    ignored_params: set[nn.Parameter]
    process_group: dist.ProcessGroup  # the ranks a unit shards over
    replicate_group: dist.ProcessGroup | None  # hybrid sharding: the ranks holding the same shard
    compute_device: torch.device
    # What auto-wrapped children are given (hybrid sharding without groups: the node groups made here, once).
    children_process_group: Any


def resolve_setup(
    module: nn.Module,
    *,
    process_group: Any,
    device_mesh: Any,
    sharding_strategy: Any,
    backward_prefetch: Any,
    ignored_modules: Iterable[nn.Module] | None,
    ignored_states: Any,
    device_id: Any,
    auto_wrapping: bool,
) -> UnitSetup:
    strategy = coerce_enum(ShardingStrategy, sharding_strategy) or ShardingStrategy.FULL_SHARD
    prefetch = coerce_enum(BackwardPrefetch, backward_prefetch)
    ignored_all, ignored_params = resolve_ignored(module, ignored_modules, ignored_states)
    hybrid = strategy in HYBRID_STRATEGIES
    if hybrid and process_group is None and device_mesh is None:
        if not auto_wrapping:
            raise ValueError(
                f"Manual wrapping with {strategy} requires explicit specification of process group or device_mesh."
            )
        process_group = node_groups()
    shard_group, replicate_group = resolve_groups(process_group, device_mesh, hybrid)
    device = compute_device(module, device_id, shard_group, ignored_params)
    return UnitSetup(
        strategy, prefetch, ignored_all, ignored_params, shard_group, replicate_group, device, process_group
    )


def fall_back_for_one_rank(setup: UnitSetup) -> UnitSetup:
    """torch FSDP1's rules, applied once the children are built: a single rank shards nothing (NO_SHARD, with a
    warning), and NO_SHARD chosen by the user is deprecated."""
    strategy = setup.sharding_strategy
    if setup.process_group.size() == 1 and strategy != ShardingStrategy.NO_SHARD:
        warnings.warn(
            f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.", stacklevel=3
        )
        setup = dataclasses.replace(setup, sharding_strategy=ShardingStrategy.NO_SHARD)
        if setup.replicate_group is not None:  # hybrid with one rank per shard group: plain replication
            setup = dataclasses.replace(setup, process_group=setup.replicate_group, replicate_group=None)
        return setup
    if strategy == ShardingStrategy.NO_SHARD:
        warnings.warn(
            "The `NO_SHARD` sharding strategy is deprecated. If having issues, please use "
            "`DistributedDataParallel` instead.",
            FutureWarning,
            stacklevel=3,
        )
    return setup


def coerce_enum(enum_cls: type[Enum], value: Any) -> Any:
    """Accept our enums and torch's equally (users mix imports): map by member name."""
    if value is None or isinstance(value, enum_cls):
        return value
    if isinstance(value, Enum) and value.name in enum_cls.__members__:
        return enum_cls[value.name]
    raise ValueError(f"Expected a {enum_cls.__name__} but got {value!r}")


def resolve_ignored(
    module: nn.Module, ignored_modules: Iterable[nn.Module] | None, ignored_states: Any
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time. Please just pass ignored_states."
        )
    states = list(ignored_modules if ignored_modules is not None else ignored_states or [])
    kinds = sorted({type(state) for state in states}, key=repr)  # torch's messages list the types so
    if ignored_modules is not None and not all(isinstance(state, nn.Module) for state in states):
        raise ValueError(f"ignored_modules expects nn.Module list elements but got types {kinds}")
    if not (all(isinstance(s, nn.Parameter) for s in states) or all(isinstance(s, nn.Module) for s in states)):
        raise ValueError(
            f"ignored_states expects all nn.Parameter or all nn.Module list elements but got types {kinds}"
        )
    modules = {m for m in states if isinstance(m, nn.Module)}
    params = {p for p in states if isinstance(p, nn.Parameter)}
    for m in modules:
        if isinstance(m, FSDPUnit):
            raise ValueError("`ignored_modules` should not include FSDP modules")
    ignored_modules_all = {sub for m in modules for sub in m.modules()}
    if module in ignored_modules_all:
        warnings.warn(
            "Trying to ignore the top-level module passed into the FSDP constructor itself will result in all "
            f"parameters being ignored and is not well-supported: {module}",
            stacklevel=4,
        )
    params |= {p for m in ignored_modules_all for p in m.parameters(recurse=False)}
    return ignored_modules_all, params


def resolve_groups(
    process_group: Any, device_mesh: Any, hybrid: bool
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(the group a unit shards over, the group across which hybrid sharding replicates, or None)."""
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "Cannot pass both process_group and device_mesh at the same time. Please just pass only one of them."
        )
    if process_group is None and device_mesh is None and not dist.is_initialized():
        raise RuntimeError(
            "FSDP needs torch.distributed to be initialized: call torch.distributed.init_process_group() first "
            "(launch with torchrun), or pass process_group."
        )
    if hybrid:
        if device_mesh is not None:
            if device_mesh.ndim != 2:  # torch's message
                raise ValueError(f"Expected device_mesh to have ndim=2 but got {device_mesh.ndim}")
            return device_mesh.get_group(mesh_dim=1), device_mesh.get_group(mesh_dim=0)
        pair = isinstance(process_group, tuple) and len(process_group) == 2
        if not pair or not all(isinstance(pg, dist.ProcessGroup) for pg in process_group):
            raise ValueError(  # torch's message, word for word
                "Expected process_group to be passed in as either None or "
                f"Tuple[dist.ProcessGroup, dist.ProcessGroup] but got {type(process_group)}"
            )
        return process_group
    if isinstance(process_group, tuple):
        raise ValueError(
            "A (shard_group, replicate_group) process_group is for HYBRID_SHARD / _HYBRID_SHARD_ZERO2; pass one "
            "group for other strategies."
        )
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError("A 2-D device_mesh is for hybrid sharding; pass a 1-D mesh for other strategies.")
        return device_mesh.get_group(), None
    return (process_group if process_group is not None else _get_default_group()), None


def node_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Hybrid sharding without explicit groups: shard within a node (LOCAL_WORLD_SIZE consecutive ranks, as torchrun
    assigns them) and replicate across nodes. Every rank must call this (group creation is collective)."""
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % per_node:
        raise ValueError(f"World size {world} is not a multiple of LOCAL_WORLD_SIZE={per_node}")
    shard, _ = dist.new_subgroups_by_enumeration([list(range(n, n + per_node)) for n in range(0, world, per_node)])
    replicate, _ = dist.new_subgroups_by_enumeration([list(range(i, world, per_node)) for i in range(per_node)])
    return shard, replicate


def compute_device(
    module: nn.Module, device_id: Any, group: dist.ProcessGroup, ignored: set[nn.Parameter]
) -> torch.device:
    if device_id is not None:
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    devices = {p.device for p in module.parameters() if p not in ignored and p.device.type != "meta"}
    if len(devices) > 1:
        raise ValueError(
            f"FSDP requires all parameters of a module on one device, but found {sorted(map(str, devices))}"
        )
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "cpu" and _backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())  # NCCL needs CUDA tensors
    return device


def _backend(group: Any) -> str | None:
    """The group's backend; None for an object that only has rank() and size() (torch's FSDP1 accepts such stand-ins
    to build and inspect the wrapped structure without a process group)."""
    try:
        return dist.get_backend(group)
    except (ValueError, RuntimeError, AttributeError):
        return None


def _breadth_first(root: nn.Module, is_boundary: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The unit's modules once each, breadth first, not entering nested units or ignored modules."""
    found, seen = [root], {id(root)}
    for module in found:  # (the list grows as it is walked: a queue)
        for child in module.children():
            if id(child) not in seen and not is_boundary(child):
                seen.add(id(child))
                found.append(child)
    return found


def materialize_and_move(module: nn.Module, device: torch.device, param_init_fn, is_boundary) -> None:
    """Materialise a meta-device unit as torch's FSDP1 does, each of its modules in breadth-first order:
    `param_init_fn(module)` for every one, else `to_empty` + `reset_parameters()` for those holding tensors. Then move
    the unit's tensors to `device`."""
    units = _breadth_first(module, is_boundary)
    if any(t.device.type == "meta" for m in units for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))):
        if param_init_fn is not None and not callable(param_init_fn):
            raise ValueError(f"Expected {param_init_fn} to be callable but got {type(param_init_fn)}")
        for sub in units:
            if param_init_fn is not None:
                param_init_fn(sub)
            elif any(True for _ in (*sub.parameters(recurse=False), *sub.buffers(recurse=False))):
                sub.to_empty(device=device, recurse=False)
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
    with torch.no_grad():
        for sub in units:
            for param in sub._parameters.values():
                if param is not None and param.device != device:
                    param.data = param.data.to(device)  # in place, so tied parameters stay tied
            for name, buffer in sub._buffers.items():
                if buffer is not None and buffer.device != device:
                    sub._buffers[name] = buffer.to(device)


def broadcast_from_rank0(states: Iterable[torch.Tensor], group: dist.ProcessGroup) -> None:
    """sync_module_states: every rank takes rank 0's values of the unit's parameters and buffers (UnitPlan order)."""
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in states:
            dist.broadcast(local_tensor(tensor.data), src=source, group=group)  # (a DTensor's own piece)
