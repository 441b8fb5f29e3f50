"""An optimizer state keyed by parameter index, as `optim.state_dict()` keys it (verl's per-rank files, Lightning's
full Trainer checkpoints), keyed by FQN instead, which is how every format of the converter keys it.

The index of a parameter is its place in the optimizer's parameter list, which is `model.parameters()` when the
optimizer was built from it (the usual case, and what torch's FSDP1 assumes when it re-keys by index). The
parameters' order is the state dict's, less buffers: so the match is made only where the caller knows which
entries are parameters, and every state tensor must have its parameter's shape, else it is refused.
"""

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import CheckpointError


def index_names(optim: Mapping[str, Any], names: Sequence[str], where: str, hint: str) -> dict[int, str]:
    """index -> FQN for an optimizer state dict keyed by index whose parameters are `names`, in order. `hint` ends
    the error raised when they cannot be matched (what to do instead)."""
    groups = optim.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) and "params" in g for g in groups):
        raise CheckpointError(f"{where}: the optimizer state has no param_groups with params: it is damaged.")
    indices = [index for group in groups for index in group["params"]]
    if not all(isinstance(i, int) for i in indices) or sorted(indices) != list(range(len(names))):
        raise CheckpointError(
            f"{where}: the optimizer state is keyed by parameter index ({len(indices)} indices) but the model has "
            f"{len(names)} parameters that could be those: which index is which parameter is then known only to the "
            f"model's code (the optimizer was given some of the parameters, or in another order). {hint}"
        )
    state = optim.get("state", {})
    unknown = [key for key in state if not isinstance(key, int) or not 0 <= key < len(names)]
    if unknown:
        raise CheckpointError(f"{where}: the optimizer state has state for indices {unknown} no parameter group has.")
    return dict(enumerate(names))


def keyed_by_name(optim: Mapping[str, Any], names: Mapping[int, str]) -> dict[str, Any]:
    """The optimizer state dict with every index replaced by its FQN (values are left as they are)."""
    return {
        "state": {names[index]: value for index, value in optim.get("state", {}).items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]} for group in optim["param_groups"]
        ],
    }


def check_shapes(state: Mapping[str, Mapping[str, Any]], shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Every state tensor with dimensions has its parameter's shape (a step count is a scalar)."""
    for name, entries in state.items():
        for key, shape in entries.items():
            if shape and tuple(shape) != tuple(shapes[name]):
                raise CheckpointError(
                    f"{where}: matched by its index, the optimizer state {key} of {name} has the shape {tuple(shape)} "
                    f"but the parameter {tuple(shapes[name])}: the indices do not follow the model's parameters (the "
                    "optimizer was given them in another order). Convert the model alone."
                )
