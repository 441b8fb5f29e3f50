"""Patches of torch's private FSDP1 functions and methods, as libraries apply them: ColossalAI's FP8 all-gather replaces
`FlatParamHandle._all_gather_flat_param`, Galvatron `_runtime_utils._finalize_params` (its replacement of
`_register_post_backward_hook` runs: the runtime calls that step through torch's name, see
test_torch_internal_runtime_names), ByteCheckpoint `_state_dict_utils._full_post_state_dict_hook`, an ODC-style gradient
service `_runtime_utils._reduce_grad` and `FlatParamHandle.prepare_gradient_for_optim`. Under the switch their code runs
on ours, which never calls torch's functions: a warning at the root's lazy init names each replacement once, rather than
a silent no-op; training is as without the patch. Nothing is said when nothing was replaced."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from torch_side_by_side import _FSDP, _full_params, _run_ours


@contextmanager
def _replaced(module_name: str, name: str, value: Any) -> Iterator[None]:
    namespace = importlib.import_module(module_name)
    if module_name.endswith("_flat_param"):
        namespace = namespace.FlatParamHandle
    missing = object()
    before = getattr(namespace, name, missing) if name in vars(namespace) else missing
    setattr(namespace, name, value)
    try:
        yield
    finally:
        if before is missing:
            delattr(namespace, name)
        else:
            setattr(namespace, name, before)


_PATCHES = {
    "colossalai": [("torch.distributed.fsdp._flat_param", "_all_gather_flat_param", lambda self, padded: padded)],
    "galvatron": [("torch.distributed.fsdp._runtime_utils", "_finalize_params", lambda state: None)],
    "bytecheckpoint": [
        ("torch.distributed.fsdp._state_dict_utils", "_full_post_state_dict_hook", lambda *args: args[2]),
    ],
    "odc": [
        ("torch.distributed.fsdp._runtime_utils", "_reduce_grad", lambda state, handle: None),
        ("torch.distributed.fsdp._flat_param", "prepare_gradient_for_optim", lambda self: None),
    ],
    "none": [],
}


def _train_with(library: str) -> dict[str, Any]:
    patches = _PATCHES[library]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _all_replaced(patches):
            torch.manual_seed(0)
            model = _FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                model(torch.ones(2, 4)).sum().backward()
                optim.step()
                optim.zero_grad()
            state = model.state_dict()
    said = [str(w.message) for w in caught if "never calls it" in str(w.message)]
    return {"said": said, "params": _full_params(model), "keys": sorted(state)}


@contextmanager
def _all_replaced(patches: list[tuple[str, str, Any]]) -> Iterator[None]:
    with ExitStack() as stack:
        for module_name, name, value in patches:
            stack.enter_context(_replaced(module_name, name, value))
        yield


def _all_libraries() -> dict[str, dict[str, Any]]:
    return {library: _train_with(library) for library in _PATCHES}


def test_replaced_torch_internals_are_named_once_and_change_nothing() -> None:
    for observed in _run_ours(_all_libraries):
        assert observed["none"]["said"] == []
        for library, patches in _PATCHES.items():
            said = observed[library]["said"]
            if not patches:
                continue
            assert len(said) == 1, (library, said)
            for module_name, name, _ in patches:
                owner = "FlatParamHandle" if module_name.endswith("_flat_param") else module_name.rpartition(".")[2]
                assert f"{owner}.{name}" in said[0], (library, said[0])
            # Training and the state dict as without the patch.
            assert observed[library]["params"] == observed["none"]["params"], library
            assert observed[library]["keys"] == observed["none"]["keys"], library


def _extension_set() -> dict[str, Any]:
    model = _FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    before = model._fsdp_extension
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model._fsdp_extension = object()  # (torch's FlatParamHandle would call its transforms)
        model(torch.ones(2, 4)).sum().backward()
    return {"before": before, "said": [str(w.message) for w in caught if "_fsdp_extension" in str(w.message)]}


def test_an_fsdp_extension_set_on_a_unit_is_named() -> None:
    for observed in _run_ours(_extension_set):
        assert observed["before"] is None
        assert len(observed["said"]) == 1 and "never calls an extension" in observed["said"][0]
