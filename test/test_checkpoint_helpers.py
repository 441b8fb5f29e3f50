"""fsdp_legacy.checkpoint: torch's state_dict helpers for our models. Oracle: torch's own helpers on torch's FSDP1
(same keys and values), and FSDP2 continuing training from what they saved."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as torch_dsd
from torch.distributed.checkpoint.state_dict import StateDictOptions

from fsdp_legacy import checkpoint as our_dsd
from fsdp_utils import Config, assert_close, build_ours, build_torch_fsdp
from harness import run_on_ranks
from test_optim_state import adam, train


def _full_values(state: dict) -> dict:
    """Tensors (ShardedTensor/DTensor gathered) of a possibly nested state dict, flattened by dotted key."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _full_values(value).items()})
        elif isinstance(value, torch.Tensor):
            out[key] = value
    return out


def _same_as_torch(use_orig_params: bool, full: bool) -> None:
    config = Config("net", use_orig_params=use_orig_params)
    _, ours = build_ours(config)
    theirs = build_torch_fsdp(config)
    our_opt, their_opt = adam(ours), adam(theirs)
    train(ours, our_opt, config, range(2))
    train(theirs, their_opt, config, range(2))
    options = StateDictOptions(full_state_dict=full)
    our_model, our_optim = our_dsd.get_state_dict(ours, our_opt, options=options)
    their_model, their_optim = torch_dsd.get_state_dict(theirs, their_opt, options=options)
    assert list(our_model) == list(their_model)
    assert list(our_optim["state"]) == list(their_optim["state"])
    if full:
        for key, value in _full_values({"model": our_model, "optim": our_optim["state"]}).items():
            expected = _full_values({"model": their_model, "optim": their_optim["state"]})[key]
            assert_close(value, expected, key)


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_same_keys_and_values_as_torch_helpers_on_torch_fsdp1(use_orig_params: bool, full: bool) -> None:
    run_on_ranks(_same_as_torch, 2, use_orig_params, full)


def _save(use_orig_params: bool, path: str):
    config = Config("net", use_orig_params=use_orig_params)
    _, ours = build_ours(config)
    optim = adam(ours)
    train(ours, optim, config, range(2))
    model_sd, optim_sd = our_dsd.get_state_dict(ours, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return train(ours, optim, config, range(2, 4))


def _load_into_fresh_ours(use_orig_params: bool, path: str):
    config = Config("net", use_orig_params=use_orig_params)
    _, ours = build_ours(config, seed=123)
    optim = adam(ours)
    model_sd, optim_sd = our_dsd.get_state_dict(ours, optim)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    our_dsd.set_state_dict(ours, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return train(ours, optim, config, range(2, 4))


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_round_trip_through_dcp_continues_identically(tmp_path, use_orig_params: bool) -> None:
    expected = run_on_ranks(_save, 2, use_orig_params, str(tmp_path))
    actual = run_on_ranks(_load_into_fresh_ours, 2, not use_orig_params, str(tmp_path))
    for want, got in zip(expected, actual):
        for step, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, f"loss {step + 2}")


def _unsupported() -> None:
    _, ours = build_ours(Config("net"))
    with pytest.raises(NotImplementedError, match="broadcast_from_rank0"):
        our_dsd.get_model_state_dict(ours, options=StateDictOptions(broadcast_from_rank0=True))
    with pytest.raises(NotImplementedError, match="one optimizer"):
        our_dsd.get_optimizer_state_dict(ours, [adam(ours), adam(ours)])


def test_unsupported_options_are_refused() -> None:
    run_on_ranks(_unsupported, 2)
