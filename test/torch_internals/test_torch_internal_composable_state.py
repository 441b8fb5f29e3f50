"""A unit as torch's composable state: `_composable_state._get_module_state(unit)` and `isinstance(state,
_common_utils._FSDPState)`, as LLaMA2-Accessory's `make_param_groups` walks an FSDP1 model to find each parameter's
clean name and original shape (for weight-decay and learning-rate groups) when use_orig_params=True shows 1-D shards.
On ours next to torch's FSDP1, through the switch (the very same code), and against the oracle of the model before
wrapping."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from torch_side_by_side import _FSDP, _fsdp, _full_params, _run


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x)).relu()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied: torch lists it among the shared parameters

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def _clean_names_and_shapes(model: nn.Module) -> dict[str, tuple[list[int], bool]]:
    """Each parameter's name without FSDP's prefixes -> (original shape, requires_grad), found as LLaMA2-Accessory
    finds them: a module whose composable state is an `_FSDPState` contributes its flat parameters' recorded shapes and
    is walked into through `_fsdp_wrapped_module`; any other module must have no state."""
    composable = importlib.import_module("torch.distributed._composable_state")
    common = importlib.import_module("torch.distributed.fsdp._common_utils")
    found: dict[str, tuple[list[int], bool]] = {}

    def join(prefix: str, name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    def walk(module: nn.Module, prefix: str, shapes: dict[str, torch.Size]) -> None:
        state = composable._get_module_state(module)
        if isinstance(state, common._FSDPState):
            assert state._use_orig_params
            inner = {name.removeprefix(common.FSDP_PREFIX): shape for name, shape in shapes.items()}
            for handle in getattr(state, "_handles", None) or [state._handle]:  # (torch 2.0 listed its handles)
                flat = handle.flat_param
                for (name, _, owner), shape in zip(flat._param_infos, flat._shapes, strict=True):
                    inner[join(owner, name)] = shape
                for name, _, owner, primary, _, primary_owner in flat._shared_param_infos:
                    inner[join(owner, name)] = inner[join(primary_owner, primary)]
            walk(state._fsdp_wrapped_module, prefix, inner)
            return
        assert state is None, f"unknown state {type(state)}"
        for name, param in module.named_parameters(recurse=False):
            found[join(prefix, name)] = (list(shapes.get(name, param.shape)), param.requires_grad)
        for name, child in module.named_children():
            start = f"{name}."
            below = {key[len(start) :]: shape for key, shape in shapes.items() if key.startswith(start)}
            walk(child, join(prefix, name), below)

    walk(model, "", {})
    return found


def _groups(found: dict[str, tuple[list[int], bool]]) -> dict[str, list[str]]:
    """timm's rule, as LLaMA2-Accessory applies it: no weight decay for biases and parameters of at most 1 dimension."""
    groups: dict[str, list[str]] = {"decay": [], "no_decay": []}
    for name, (shape, requires_grad) in found.items():
        if requires_grad:
            groups["no_decay" if name.endswith(".bias") or len(shape) <= 1 else "decay"].append(name)
    return {key: sorted(names) for key, names in groups.items()}


def _param_groups_and_training() -> dict[str, Any]:
    fsdp = _fsdp()
    torch.manual_seed(0)
    plain = _Model()
    plain.blocks[0].norm.requires_grad_(False)
    oracle = {name: (list(p.shape), p.requires_grad) for name, p in plain.named_parameters()}
    model = _FSDP(
        plain,
        auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({_Block}),
        use_orig_params=True,
    )
    found = _clean_names_and_shapes(model)
    # The oracle: what the model said before wrapping (tied parameters once there, under their first name).
    assert {name: found[name] for name in oracle} == oracle, (found, oracle)
    groups = _groups(found)
    clean = importlib.import_module("torch.distributed.fsdp._common_utils").clean_tensor_name
    params = {clean(name): param for name, param in model.named_parameters()}
    optim = torch.optim.AdamW(
        [
            {"params": [params[name] for name in groups["decay"] if name in params], "weight_decay": 0.5},
            {"params": [params[name] for name in groups["no_decay"] if name in params], "weight_decay": 0.0},
        ],
        lr=0.05,
    )
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randint(0, 16, (4, 5), generator=generator)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    found_lists = {name: list(value) for name, value in sorted(found.items())}
    return {"found": found_lists, "groups": groups, "params": _full_params(model)}


def test_param_groups_from_the_composable_state_as_torch() -> None:
    """torch's answer, and ours through the switch: the unit is its own `_FSDPState`, so the walk finds every
    parameter's clean name and original shape (before, ours was taken for a plain module: names with
    `_fsdp_wrapped_module.` and 1-D shapes, so every weight fell in the no-decay group)."""
    for observed in _run(_param_groups_and_training):
        assert observed["groups"]["decay"] == [
            "blocks.0.proj.weight",
            "blocks.1.proj.weight",
            "embed.weight",
            "head.weight",
        ]
        assert "blocks.0.norm.weight" not in observed["groups"]["no_decay"]  # frozen
