"""No silent wrong loads of optimizer state: a state dict whose tensors cannot be the parameters' (one rank's pieces
where whole states are expected, keys naming no parameter, an id-keyed dict) raises on every rank; the case reported
with torch's DSD helpers (a SHARDED model + optimizer checkpoint at 2 ranks, use_orig_params=True, SHARD_GRAD_OP,
loaded at 1 rank) now either refuses at save time (switch off) or loads the right state (switch on)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as torch_dsd
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

import fsdp_legacy
from fsdp_legacy import FullyShardedDataParallel as FSDP
from fsdp_utils import Config, batch, build_ours, loss_of
from harness import run_on_ranks

CONFIG = Config("net", "SHARD_GRAD_OP", use_orig_params=True)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_ours(CONFIG)[1]
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):
        loss_of(model(batch(CONFIG, step))).backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _refused(case: str) -> None:
    model, optim = _trained()
    names = {p: n for n, p in model.named_parameters()}
    params = [p for group in optim.param_groups for p in group["params"]]
    raw = optim.state_dict()
    full = FSDP.optim_state_dict(model, optim)
    if case == "pieces by name":  # what torch's DSD helpers saved from our model before the switch existed
        osd = {
            "state": {names[params[i]]: state for i, state in raw["state"].items()},
            "param_groups": [{**g, "params": [names[params[i]] for i in g["params"]]} for g in raw["param_groups"]],
        }
        expected = "looks like one rank's flat piece"
    elif case == "unknown key":
        osd = {
            "state": {("x" + k if k == "l1.weight" else k): v for k, v in full["state"].items()},
            "param_groups": full["param_groups"],
        }
        expected = r"states for \['xl1.weight'\], which name no parameter of this model"
    else:  # an id-keyed dict
        osd = raw
        expected = "keyed by parameter ids"
    with pytest.raises(ValueError, match=expected):
        FSDP.optim_state_dict_to_load(model, optim, osd)


@pytest.mark.parametrize("case", ["pieces by name", "unknown key", "ids"])
def test_an_optimizer_state_that_cannot_be_this_models_raises_on_every_rank(case: str) -> None:
    run_on_ranks(_refused, 2, case)


def _save_with_torch_helpers(path: str, switched: bool) -> None:
    model, optim = _trained()
    if not switched:
        with pytest.raises(RuntimeError, match=r"fsdp_legacy\.install\(\)"):
            torch_dsd.get_state_dict(model, optim)
        return
    fsdp_legacy.install()
    try:
        model_state, optim_state = torch_dsd.get_state_dict(model, optim)
    finally:
        fsdp_legacy.uninstall()
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    full = FSDP.optim_state_dict(model, optim)
    if torch.distributed.get_rank() == 0:
        torch.save(full, path + ".expected")


def _load_at_one_rank(path: str) -> None:
    model = build_ours(CONFIG, seed=1)[1]
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_of(model(batch(CONFIG, 0))).backward()
    optim.step()  # the state exists before loading, as DCP needs
    optim.zero_grad()
    with FSDP.state_dict_type(model, fsdp_legacy.StateDictType.SHARDED_STATE_DICT):
        model_state = {"model": model.state_dict()}
        dcp.load(model_state, checkpoint_id=path)
        model.load_state_dict(model_state["model"])
        loaded = load_sharded_optimizer_state_dict(model_state["model"], "optim", dcp.FileSystemReader(path))
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, loaded["optim"]))
    expected = torch.load(path + ".expected", weights_only=True)
    now = FSDP.optim_state_dict(model, optim)
    assert list(now["state"]) == list(expected["state"])
    for fqn, state in expected["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(now["state"][fqn][name], value, msg=f"{fqn}.{name}")


def test_the_reported_torch_helpers_case_refuses_or_loads_right(tmp_path) -> None:
    path = str(tmp_path / "checkpoint")
    run_on_ranks(_save_with_torch_helpers, 2, path, False)
    run_on_ranks(_save_with_torch_helpers, 2, path, True)
    run_on_ranks(_load_at_one_rank, 1, path)
