"""FSDP1's construction keywords as fully_shard's, decided at run time: what a migrated program calls where the
source does not say which strategy, precision or offload an `FSDP(...)` got (`sharding_strategy=cfg.strategy`,
`mixed_precision=mp_policy()`, `cpu_offload=CPUOffload(offload_params=cfg.offload)`).

`fsdp1_options` maps the values exactly as the rewriter maps the same values written as literals (construction.py),
so a migrated program trains as FSDP1 did for every value; a value FSDP2 cannot be given the same way raises
ValueError naming it and the fix, before any collective (every rank given the same configuration raises alike).
`hybrid_mesh` is FSDP1's HYBRID_SHARD pair of process groups as FSDP2's 2-D mesh."""

from __future__ import annotations

import os
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["fsdp1_options", "hybrid_mesh"]

_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def strategy_name(strategy: Any) -> str:
    """The member name of a ShardingStrategy (torch's or fsdp_legacy's), or of its name as a string
    ("SHARD_GRAD_OP", "ShardingStrategy.SHARD_GRAD_OP", any case); None is FSDP1's default, FULL_SHARD."""
    if strategy is None:
        return "FULL_SHARD"
    if isinstance(strategy, Enum) and type(strategy).__name__ == "ShardingStrategy":
        return strategy.name
    if isinstance(strategy, str):
        name = strategy.rsplit(".", 1)[-1]
        found = [s for s in _STRATEGIES if s.upper() == name.upper()]
        if found:
            return found[0]
    raise ValueError(
        f"sharding_strategy={strategy!r} is not a ShardingStrategy (nor one's name): FSDP1 would not have taken it "
        f"either; pass one of ShardingStrategy.{', ShardingStrategy.'.join(_STRATEGIES)}"
    )


def _placement(name: str, process_group: Any, device_mesh: DeviceMesh | None) -> dict[str, Any]:
    """fully_shard's mesh (and reshard_after_forward) for a strategy over FSDP1's process_group / device_mesh."""
    out: dict[str, Any] = {"reshard_after_forward": False} if name in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2") else {}
    if name == "NO_SHARD" and (process_group is not None or device_mesh is not None):
        raise ValueError(
            "sharding_strategy=NO_SHARD with a process_group or device_mesh: FSDP2 replicates only over a mesh "
            "dimension of its own; build a 2-D mesh with init_device_mesh(device, (replicas, 1), "
            'mesh_dim_names=("replicate", "shard")) and pass it to fully_shard as mesh= by hand'
        )
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError("FSDP(..., process_group=..., device_mesh=...): FSDP1 takes one of them, not both")
        if name in _HYBRID and device_mesh.ndim != 2:
            raise ValueError(
                f"sharding_strategy={name} with a {device_mesh.ndim}-D device_mesh: FSDP1 needs a 2-D mesh "
                "(replicate, shard) for hybrid sharding; pass one built with init_device_mesh(device, (nodes, gpus))"
            )
        return {**out, "mesh": device_mesh}
    if process_group is not None:
        if name in _HYBRID:
            return {**out, "mesh": hybrid_mesh(process_group)}
        if not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(
                f"sharding_strategy={name} with process_group={type(process_group).__name__}: FSDP1 takes a pair of "
                "groups only for the hybrid strategies; pass one ProcessGroup"
            )
        return {**out, "mesh": DeviceMesh.from_group(process_group, _device_type())}
    if name in _HYBRID or name == "NO_SHARD":
        world = dist.get_world_size()
        if name == "NO_SHARD":
            shard = 1
        elif os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
            shard = int(os.environ["LOCAL_WORLD_SIZE"])
        else:
            raise ValueError(
                f"sharding_strategy={name} without process_group or device_mesh: FSDP1 shards within a node, and the "
                "node size is read from LOCAL_WORLD_SIZE, which is not set; launch with torchrun, or pass "
                "device_mesh=init_device_mesh(device, (nodes, ranks_per_node)) or process_group=(intra, inter)"
            )
        if shard < 1 or world % shard:
            raise ValueError(
                f"sharding_strategy={name}: the world size {world} is not a multiple of LOCAL_WORLD_SIZE={shard}; "
                "pass device_mesh= with the layout you mean"
            )
        mesh = init_device_mesh(_device_type(), (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        return {**out, "mesh": mesh}
    return out


def _precision(policy: Any) -> dict[str, Any]:
    """FSDP1's MixedPrecision (torch's or fsdp_legacy's) as fully_shard's mp_policy and apply_fully_shard's
    buffer_dtype; FSDP2's MixedPrecisionPolicy as it is."""
    if policy is None:
        return {}
    if isinstance(policy, MixedPrecisionPolicy):
        return {"mp_policy": policy}
    if type(policy).__name__ != "MixedPrecision" or not hasattr(policy, "buffer_dtype"):
        raise ValueError(
            f"mixed_precision={policy!r} is neither FSDP1's MixedPrecision nor FSDP2's MixedPrecisionPolicy; pass one"
        )
    if policy.keep_low_precision_grads:
        raise ValueError(
            f"mixed_precision={policy!r}: keep_low_precision_grads=True has no FSDP2 counterpart (FSDP2 gives the "
            "gradients in the parameters' dtype); drop it, or set MixedPrecisionPolicy(output_dtype=...) by hand"
        )
    # cast_forward_inputs / cast_root_forward_inputs: FSDP2 casts each unit's floating inputs to param_dtype, which
    # is where FSDP1's casts end up (as the rewriter maps them written as literals).
    out: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(policy.param_dtype, policy.reduce_dtype)}
    if policy.buffer_dtype is not None:
        out["buffer_dtype"] = policy.buffer_dtype
    return out


def _offload(offload: Any) -> dict[str, Any]:
    """FSDP1's CPUOffload (torch's or fsdp_legacy's) as fully_shard's offload_policy; FSDP2's policy as it is."""
    if offload is None:
        return {}
    if isinstance(offload, OffloadPolicy):
        return {"offload_policy": offload}
    if type(offload).__name__ != "CPUOffload" or not hasattr(offload, "offload_params"):
        raise ValueError(f"cpu_offload={offload!r} is neither FSDP1's CPUOffload nor FSDP2's OffloadPolicy; pass one")
    # pinned where there is an accelerator (pinning needs one; torch's FSDP1 always pins, and fails without one)
    return {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} if offload.offload_params else {}


def fsdp1_options(
    sharding_strategy: Any = None,
    mixed_precision: Any = None,
    cpu_offload: Any = None,
    process_group: Any = None,
    device_mesh: DeviceMesh | None = None,
) -> dict[str, Any]:
    """FSDP(...)'s keyword values, known only at run time, as the keywords of `apply_fully_shard` (fully_shard's,
    and `buffer_dtype`, the cast FSDP1's MixedPrecision makes and FSDP2's policy lacks):

    - sharding_strategy (a ShardingStrategy of torch's or fsdp_legacy's, or its name; None: FULL_SHARD) with
      process_group / device_mesh: FULL_SHARD the default, SHARD_GRAD_OP `reshard_after_forward=False`, a group as a
      1-D mesh of its ranks, HYBRID_SHARD (and its ZeRO-2 form) as a 2-D (replicate, shard) mesh over FSDP1's pair
      of groups, over device_mesh, or over nodes of LOCAL_WORLD_SIZE ranks; NO_SHARD as a mesh that replicates on
      every rank;
    - mixed_precision: FSDP1's MixedPrecision as MixedPrecisionPolicy(param_dtype, reduce_dtype) plus buffer_dtype;
    - cpu_offload: CPUOffload(offload_params=True) as CPUOffloadPolicy(), False as FSDP2's default.

    FSDP2's own MixedPrecisionPolicy / OffloadPolicy are passed on as they are. What FSDP2 cannot be given the way
    FSDP1 applied it raises ValueError naming the value and the fix."""
    name = strategy_name(sharding_strategy)
    return {
        **_placement(name, process_group, device_mesh),
        **_precision(mixed_precision),
        **_offload(cpu_offload),
    }


def hybrid_mesh(process_group: tuple[dist.ProcessGroup, dist.ProcessGroup]) -> DeviceMesh:
    """FSDP1's `process_group=(intra_node_group, inter_node_group)` for HYBRID_SHARD as FSDP2's 2-D mesh: dim 0
    ("replicate") the inter-node groups, dim 1 ("shard") the intra-node ones, the groups themselves reused. A rank
    knows only its own two groups, so each tells the members of the other its own group (no rank outside the two
    groups takes part, as in FSDP1): a rank's row is its intra group, and each member of its inter group brings
    another row; the row's ranks are put in the order of their inter groups (columns)."""
    if not (isinstance(process_group, (tuple, list)) and len(process_group) == 2):
        raise ValueError(
            f"HYBRID_SHARD's process_group must be the pair (intra_node_group, inter_node_group), got "
            f"{type(process_group).__name__}: pass the pair, or device_mesh= a 2-D (replicate, shard) mesh"
        )
    intra, inter = process_group
    mine = (tuple(dist.get_process_group_ranks(intra)), tuple(dist.get_process_group_ranks(inter)))
    columns: list[Any] = [None] * dist.get_world_size(intra)  # the inter group of each member of my intra group
    dist.all_gather_object(columns, mine[1], group=intra)
    rows: list[Any] = [None] * dist.get_world_size(inter)  # the intra group of each member of my inter group
    dist.all_gather_object(rows, mine[0], group=inter)
    column_of = {rank: index for index, column in enumerate(sorted(set(columns))) for rank in column}
    layout = [sorted(row, key=column_of.__getitem__) for row in sorted(set(rows))]
    if sorted(r for row in layout for r in row) != sorted(column_of) or len({len(row) for row in layout}) != 1:
        raise ValueError(
            f"the groups do not form a grid: intra-node groups {sorted(set(rows))}, inter-node groups "
            f"{sorted(set(columns))}"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return DeviceMesh.from_group([inter, intra], device, mesh=layout, mesh_dim_names=("replicate", "shard"))
