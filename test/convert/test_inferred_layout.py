"""A LOCAL checkpoint saved with a plain `dcp.save` (torch's FSDP1, or ours outside fsdp_legacy.dcp_checkpoint)
converts offline with no layout given: the layout is inferred from the optimizer state saved beside it.

The oracles: the FULL state dicts of the saved model and optimizer (torch's FSDP1, or ours); and, for what cannot be
inferred, the error that names why and the ways to give the layout.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_convert import _save_local, assert_same

from fsdp_legacy.cli import main
from fsdp_legacy.convert import CheckpointError, convert_checkpoint
from fsdp_utils import Config
from harness import run_on_ranks

TIED = "head.weight"  # models.Transformer ties its LM head to the token embedding


@pytest.mark.parametrize("impl", ["torch", "ours"])
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "uop"])
def test_plain_dcp_local_checkpoint_converts_without_a_layout(
    tmp_path: Path, impl: str, use_orig_params: bool, capsys
) -> None:
    config = Config("transformer", use_orig_params=use_orig_params)
    source = str(tmp_path / "local")
    expected = run_on_ranks(_save_local, 2, config, source, impl, True)[0]
    assert main(["convert", source, str(tmp_path / "full.pt"), "--to", "full"]) == 0
    out = capsys.readouterr().out
    stored = torch.load(tmp_path / "full.pt", weights_only=True)
    assert "inferred from the optimizer state" in out
    if use_orig_params:  # the tied name is seen in the per-rank views and kept
        assert f"{TIED} is tied to tok.weight" in out
        assert_same(stored["model"], expected["model"], "model")
    else:  # invisible without use_orig_params: named once, and the report says so
        assert "named once" in out and TIED not in stored["model"]
        assert_same(stored["model"], {k: v for k, v in expected["model"].items() if k != TIED}, "model")
    assert_same(stored["optim"], expected["optim"], "optimizer")


def test_an_untied_model_converts_to_every_format_as_saved(tmp_path: Path) -> None:
    """The net model (no ties) at 2 ranks: full equals torch's FULL dicts; re-laid out for 3 ranks and back it
    is the same checkpoint."""
    source = str(tmp_path / "local")
    expected = run_on_ranks(_save_local, 2, Config("net"), source, "torch", True)[0]
    convert_checkpoint(source, str(tmp_path / "full.pt"), "full")
    stored = torch.load(tmp_path / "full.pt", weights_only=True)
    assert "layout" in stored  # the inferred records travel along, so the way back needs no model code either
    assert_same({k: stored[k] for k in expected}, expected, "net, torch FSDP1 LOCAL -> full")
    convert_checkpoint(source, str(tmp_path / "local3"), "local", world_size=3)
    convert_checkpoint(str(tmp_path / "local3"), str(tmp_path / "back.pt"), "full")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert_same({k: back[k] for k in expected}, expected, "-> local at 3 ranks -> full")


def _save_plain(path: Path, flat: torch.Tensor, state: dict, params: list[str]) -> str:
    """One process's plain dcp.save of a LOCAL-style model section and an FQN-keyed optimizer state."""
    groups = [{"lr": 0.1, "params": params}]
    dcp.save(
        {"model": {"_flat_param": flat}, "optim": {"state": state, "param_groups": groups}},
        checkpoint_id=str(path),
        no_dist=True,
    )
    return str(path)


def _adam(shape: tuple[int, ...]) -> dict:
    return {"exp_avg": torch.randn(shape), "exp_avg_sq": torch.rand(shape), "step": torch.tensor(3.0)}


def test_what_the_optimizer_state_cannot_tell_is_refused_with_the_fix(tmp_path: Path) -> None:
    state = {"a": _adam((3, 4)), "b": _adam((5,))}
    dcp.save({"model": {"_flat_param": torch.randn(17)}}, checkpoint_id=str(tmp_path / "bare"), no_dist=True)
    cases = {
        "no state": (
            _save_plain(tmp_path / "frozen", torch.randn(17), {"a": state["a"]}, ["a", "b"]),
            "holds no state (frozen, or not stepped yet) for b",
        ),
        "too few": (_save_plain(tmp_path / "few", torch.randn(20), state, ["a", "b"]), "do not fill it"),
        "no optimizer": (str(tmp_path / "bare"), "has no optimizer state"),
    }
    for name, (source, why) in cases.items():
        with pytest.raises(CheckpointError) as error:
            convert_checkpoint(source, str(tmp_path / f"{name}.pt"), "full")
        assert why in str(error.value) and "--layout-from pkg.mod:factory" in str(error.value), name
        assert not (tmp_path / f"{name}.pt").exists()


def test_a_layout_inferred_from_17_elements_holds_the_parameters_in_order(tmp_path: Path) -> None:
    """Analytic: a (3, 4) and a (5,) parameter, in the optimizer's order, fill a 17-element flat parameter."""
    flat = torch.arange(17.0)
    state = {"a": _adam((3, 4)), "b": _adam((5,))}
    convert_checkpoint(_save_plain(tmp_path / "ok", flat, state, ["a", "b"]), str(tmp_path / "ok.pt"), "full")
    model = torch.load(tmp_path / "ok.pt", weights_only=True)["model"]
    assert torch.equal(model["a"], flat[:12].view(3, 4)) and torch.equal(model["b"], flat[12:])


def _save_views(path: Path, flat: torch.Tensor, extra: dict[str, torch.Tensor]) -> str:
    """use_orig_params' shape of a LOCAL state dict at one rank: the flat parameter, each parameter's 1-D view, and
    `extra` keys (buffers, or a tied parameter's view)."""
    model = {"_flat_param": flat, "a": flat[:6].clone(), "b": flat[6:].clone(), **extra}
    state = {"a": _adam((2, 3)), "b": _adam((6,))}
    dcp.save(
        {"model": model, "optim": {"state": state, "param_groups": [{"lr": 0.1, "params": ["a", "b"]}]}},
        checkpoint_id=str(path),
        no_dist=True,
    )
    return str(path)


def test_a_view_holding_a_parameters_piece_is_its_tied_name(tmp_path: Path) -> None:
    flat = torch.randn(12)
    buffer = torch.randn(6)
    source = _save_views(tmp_path / "tied", flat, {"c": flat[:6].clone(), "running": buffer})
    report = convert_checkpoint(source, str(tmp_path / "tied.pt"), "full")
    model = torch.load(tmp_path / "tied.pt", weights_only=True)["model"]
    assert "c is tied to a" in report.notes
    assert torch.equal(model["c"], flat[:6].view(2, 3)) and torch.equal(model["a"], model["c"])
    assert torch.equal(model["running"], buffer) and torch.equal(model["b"], flat[6:])

    flat[:6] = 1.0  # a constant piece: a buffer of ones would hold the same bits
    source = _save_views(tmp_path / "ones", flat, {"c": torch.ones(6)})
    with pytest.raises(CheckpointError, match="whether it is a buffer or that parameter's tied name cannot be told"):
        convert_checkpoint(source, str(tmp_path / "ones.pt"), "full")
