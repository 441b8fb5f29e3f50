"""DTensor parameters (tensor parallelism) in flat parameters: torch FSDP1's 2-D recipe.

    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(block, mesh["tp"], {...})                  # parameters become DTensors on mesh["tp"]
    FSDP(model, device_mesh=mesh["dp"], use_orig_params=..., auto_wrap_policy=...)

A flat parameter holds plain bytes, so each DTensor parameter contributes its *local* tensor (this tp rank's piece),
flattened and sharded over the dp group like any parameter; the ranks of one dp group share a tp coordinate, hence
the same local shapes and the same layout. What the local tensor cannot say (mesh, placements, global shape and
stride) is kept in a `DTensorParam` per parameter, from which the parameter is shown again as a DTensor: the views of
the unsharded flat parameter in forward (through `DTensor.from_local`, which keeps autograd, so the gradient reaches
the flat parameter), summon_full_params, and the state dicts (FULL: a DTensor on the tp mesh; SHARDED: a DTensor on
the 2-D mesh, dim 0 sharded over dp, as torch's FSDP1 writes them).
"""

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor


@dataclass(frozen=True)
class DTensorParam:
    """What a flat parameter remembers of one DTensor parameter, whose local tensor it holds."""

    mesh: DeviceMesh  # the parameter's 1-D (tp) mesh
    placements: tuple[Placement, ...]
    shape: torch.Size  # global
    stride: tuple[int, ...]  # global

    @classmethod
    def of(cls, param: DTensor) -> "DTensorParam":
        return cls(param.device_mesh, tuple(param.placements), param.shape, tuple(param.stride()))

    @property
    def tp_sharded(self) -> bool:
        """Whether the tp ranks hold different pieces (their norms add up) rather than copies."""
        return any(isinstance(p, Shard) for p in self.placements)

    def wrap(self, local: torch.Tensor) -> DTensor:
        """`local` (this rank's piece, a view of the flat parameter) as the DTensor parameter; differentiable, so
        gradients of the DTensor flow back into the view."""
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def local_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a tensor of the global shape (every rank holds `full`): no communication."""
        return distribute_tensor(full.detach(), self.mesh, self.placements, src_data_rank=None).to_local()


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor a flat parameter stores for `param`: a DTensor's local piece, anything else as it is."""
    return param.to_local() if isinstance(param, DTensor) else param


def root_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The mesh `mesh` was sliced from (mesh["dp"] of a 2-D mesh), None for a mesh of its own. (torch keeps the
    relation privately; its FSDP1 reads it the same way.)"""
    if mesh is None:
        return None
    root = mesh._get_root_mesh()
    return None if root is mesh or root == mesh else root


def _dim_in(root: DeviceMesh, mesh: DeviceMesh) -> int | None:
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if not names or not root_names or len(names) != 1 or names[0] not in root_names:
        return None
    return root_names.index(names[0])


def check_param(fqn: str, owner: str, param: DTensor, fsdp_mesh: DeviceMesh | None, hybrid: bool) -> str | None:
    """Why FSDP cannot hold this DTensor parameter, or None. Every rank reaches the same verdict (it reads only
    meshes and placements, which are global), so the error is raised on every rank."""
    what = f"Parameter '{fqn}' of {owner} is a DTensor on {param.device_mesh} with placements {param.placements}"
    recipe = (
        "FSDP supports DTensor parameters in torch's 2-D recipe: mesh = init_device_mesh(device, (dp, tp), "
        'mesh_dim_names=("dp", "tp")), parallelize_module(..., mesh["tp"], ...), then FSDP(model, '
        'device_mesh=mesh["dp"], ...)'
    )
    if hybrid:
        return f"{what}, and HYBRID_SHARD / _HYBRID_SHARD_ZERO2 do not support DTensor parameters. {recipe}."
    root = root_mesh(fsdp_mesh)
    if fsdp_mesh is None or root is None:
        how = "without a device_mesh" if fsdp_mesh is None else f"on {fsdp_mesh}, which is not sliced from a 2-D mesh"
        return (
            f"{what}, but FSDP was built {how}: it cannot tell the data-parallel ranks from the tensor-parallel ones. "
            f"{recipe}."
        )
    param_mesh = param.device_mesh
    tp_dim, dp_dim = _dim_in(root, param_mesh), _dim_in(root, fsdp_mesh)
    if param_mesh.ndim != 1 or param_mesh._get_root_mesh() != root or tp_dim is None or tp_dim == dp_dim:
        return (
            f"{what}, which is not compatible with FSDP's device_mesh {fsdp_mesh}: the parameter's mesh must be "
            f"another 1-D slice of the same mesh {root} (e.g. mesh['tp'] beside FSDP's mesh['dp']). {recipe}."
        )
    placement = param.placements[0]
    if isinstance(placement, Partial):
        return (
            f"{what}: a Partial parameter holds summands, not values, which FSDP cannot shard or save. Make it "
            "Replicate (param.redistribute(placements=[Replicate()])) or Shard before wrapping."
        )
    if type(placement) not in (Shard, Replicate):  # e.g. _StridedShard, which torch's FSDP1 refuses too
        return (
            f"{what}: FSDP supports Shard(dim) and Replicate() placements of DTensor parameters only (as torch's "
            "FSDP1 does). Redistribute it to one of those before wrapping."
        )
    return None


def sharded_dtensor(local: torch.Tensor, fsdp_mesh: DeviceMesh, record: DTensorParam | None) -> DTensor | None:
    """SHARDED_STATE_DICT value over the 2-D mesh when FSDP's mesh is sliced from one (None otherwise): dim 0 sharded
    over the dp dimension; a DTensor parameter keeps its placement on the tp dimension, a plain one is replicated
    there. `local` is this rank's whole (unsharded over dp) parameter: the tp piece of a DTensor parameter."""
    root = root_mesh(fsdp_mesh)
    if root is None:
        return None
    dp_dim = _dim_in(root, fsdp_mesh)
    assert dp_dim is not None, "a sliced mesh has a name in its root"
    replicated: list[Placement] = [Replicate()] * root.ndim
    shape, stride = local.shape, local.stride()
    if record is not None:
        tp_dim = _dim_in(root, record.mesh)
        assert tp_dim is not None, "check_param admitted it"
        replicated[tp_dim] = record.placements[0]
        shape, stride = record.shape, record.stride
    sharded = list(replicated)
    sharded[dp_dim] = Shard(0)
    # (a copy: `local` may be a view of a gather buffer that is freed after the state dict is taken)
    whole = DTensor.from_local(local.detach().clone(), root, replicated, run_check=False, shape=shape, stride=stride)
    return whole.redistribute(root, sharded)
