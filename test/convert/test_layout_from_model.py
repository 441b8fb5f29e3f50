"""`fsdp-legacy convert --layout-from pkg.mod:factory --wrap pkg.mod.Layer`: the layout of a LOCAL checkpoint that
carries none (torch's FSDP1, a plain dcp.save), built from the model's code on fake tensors.

The oracles: torch's FSDP1 FULL state dicts of the saved model (what the converted checkpoint must hold), and the
layout records our own LOCAL save writes for the same model and wrapping.
"""

import os

import pytest
import torch
from test_convert import _save_local, assert_same

from fsdp_legacy.cli import main
from fsdp_legacy.cli.common import UsageError
from fsdp_legacy.cli.model_layout import is_model_spec, layout_of_model
from fsdp_legacy.convert import open_checkpoint
from fsdp_utils import Config
from harness import run_on_ranks

SPEC, WRAP = "models:Transformer", "models.TransformerBlock"


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "uop"])
def test_torch_fsdp1_local_checkpoint_converts_with_the_layout_of_the_model_code(tmp_path, use_orig_params) -> None:
    config = Config("transformer", use_orig_params=use_orig_params)
    theirs, ours = str(tmp_path / "torch_local"), str(tmp_path / "ours_local")
    expected = run_on_ranks(_save_local, 2, config, theirs, "torch")[0]
    run_on_ranks(_save_local, 2, config, ours)

    built = layout_of_model(SPEC, WRAP, use_orig_params)
    with open_checkpoint(ours) as checkpoint:
        saved = checkpoint.side_records
    assert {key: record.at_world_size(2) for key, record in built.items()} == dict(saved), "as our LOCAL save records"

    args = ["convert", theirs, str(tmp_path / "full.pt"), "--to", "full", "--layout-from", SPEC, "--wrap", WRAP]
    assert main([*args, *(["--use-orig-params"] if use_orig_params else []), "--quiet"]) == 0
    stored = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_same(stored["model"], expected["model"], "torch FSDP1 LOCAL -> full, model")
    assert_same(stored["optim"], expected["optim"], "torch FSDP1 LOCAL -> full, optimizer")


def test_the_wrong_wrapping_or_a_missing_wrap_is_refused(tmp_path, capsys) -> None:
    theirs = str(tmp_path / "torch_local")
    run_on_ranks(_save_local, 2, Config("transformer"), theirs, "torch")
    args = ["convert", theirs, str(tmp_path / "full.pt"), "--to", "full", "--layout-from", SPEC]
    assert main([*args, "--quiet"]) == 2
    assert "needs --wrap" in capsys.readouterr().err
    assert main([*args, "--wrap", "models.Block", "--quiet"]) == 1  # a class the model does not have: one unit
    assert "belongs to another model, wrapping or world size" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "full.pt")
    with pytest.raises(UsageError, match="cannot import nowhere"):
        layout_of_model("nowhere:build", WRAP, False)


def test_a_path_is_not_a_model_spec(tmp_path) -> None:
    assert is_model_spec("mypkg.models:build") and not is_model_spec(str(tmp_path / "ckpt"))
    assert not is_model_spec("C:/ckpt") and not is_model_spec("ckpt:") and not is_model_spec(":build")
