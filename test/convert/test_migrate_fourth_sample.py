"""`fsdp-legacy migrate` on what a fourth sample of public FSDP1 programs showed (docs/migration.md):

- switti: the trainer's construction stays FSDP1 (its class is chosen at run time), and it hands `trainer.switti`, an
  attribute of another object, to checkpoint helpers in `utils/fsdp.py`. The helpers were rewritten for FSDP2 all the
  same: a program half FSDP1, half FSDP2. A file that stays FSDP1 now keeps the files it imports from as they are.
- switti again: its run configuration's own `args.state_dict()` inside the FULL block became `state_dict_beside`,
  which raised for any object that is not a module. An object holding no module is its own call, as in FSDP1.
- Self-Forcing: `fsdp_module.module` in a function every call hands the wrapped model stayed FSDP1's wrapped-module
  attribute, which an FSDP2 model lacks (AttributeError). It is the model itself now, as for the file's own models.
- Dit: `ema_net.load_state_dict(ema_state, assign=True)` on a wrapped model was left as written, silently: FSDP2's
  `load_state_dict` is the module's own, and `assign` has no counterpart in set_model_state_dict. Such a call is
  reported, and the file left as it is, so that a second run reports the same."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch.nn as nn

pytest.importorskip("libcst")

from fsdp_legacy.migrate.program import migrate_program
from fsdp_legacy.migrate.rewriter import migrate_source

_HELPERS = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


    def save_model_state(step, args, model):
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
            torch.save({"model": model.state_dict(), "args": args.state_dict(), "step": step}, "model.pt")
    """
)

_TRAIN = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from utils.fsdp import save_model_state


    class NullDDP(torch.nn.Module):
        def __init__(self, module, **kwargs):
            super().__init__()
            self.module = module


    class Trainer:
        def __init__(self, switti):
            self.switti = switti


    def main(args, net, distributed):
        switti = (FSDP if distributed else NullDDP)(net, use_orig_params=True)
        trainer = Trainer(switti)
        save_model_state(0, args, trainer.switti)
    """
)


def test_a_file_a_kept_fsdp1_file_imports_from_stays_too() -> None:
    program = migrate_program({"utils/fsdp.py": _HELPERS, "train.py": _TRAIN})
    helpers, train = program.results["utils/fsdp.py"], program.results["train.py"]
    assert train.migrated == _TRAIN and train.fsdp1_constructions
    assert helpers.migrated == _HELPERS  # rewritten alone, it was FSDP2's calls on the trainer's FSDP1 model
    assert any("train.py imports from it and stays FSDP1" in f.what for f in helpers.findings)
    again = migrate_program({"utils/fsdp.py": helpers.migrated, "train.py": train.migrated})
    assert [f.what for f in again.results["utils/fsdp.py"].findings] == [f.what for f in helpers.findings]


def test_the_helpers_alone_still_migrate() -> None:
    """The rule holds the helpers only beside a file that stays FSDP1: alone, they are FSDP2's."""
    program = migrate_program({"utils/fsdp.py": _HELPERS})
    assert "get_model_state_dict" in program.results["utils/fsdp.py"].migrated


_HANDED = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


    def names(fsdp_module):
        return [name for name, _ in fsdp_module.module.named_parameters()]


    def build():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        model = FSDP(net, use_orig_params=True, device_id=torch.device("cpu"))
        return model, names(model)
    """
)


def _names_both_ways(original: str, migrated: str) -> dict[str, Any]:
    seen = {}
    for kind, source in (("fsdp1", original), ("fsdp2", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, f"{kind}.py", "exec"), namespace)
        _, seen[kind] = namespace["build"]()
    return seen


def test_the_wrapped_module_of_a_handed_model_is_the_model_itself(ranks: Any) -> None:
    migrated = migrate_program({"train.py": _HANDED}).results["train.py"].migrated
    assert "fsdp_module.named_parameters()" in migrated and ".module." not in migrated
    for seen in ranks(_names_both_ways, 2, _HANDED, migrated):
        assert seen["fsdp2"] == seen["fsdp1"] == ["0.weight", "0.bias", "2.weight", "2.bias"]  # torch's FSDP1's


_EMA = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


    def build():
        return FSDP(torch.nn.Linear(4, 4))


    def main():
        net = build()
        ema = build()
        with torch.no_grad():
            ema.load_state_dict(net.state_dict(), assign=True)
        return net, ema
    """
)


def test_a_state_dict_call_with_arguments_fsdp2_lacks_keeps_the_file_and_reports_it_again() -> None:
    result = migrate_source(_EMA)
    assert result.migrated == _EMA
    whats = [f.what for f in result.findings]
    assert "`ema.load_state_dict(...)` with these arguments" in whats and "FSDP1 state-dict calls kept" in whats
    assert [f.what for f in migrate_source(result.migrated).findings] == whats


class _Config:
    def __init__(self, model: nn.Module | None = None) -> None:
        self.lr, self.nested = 0.1, {"depth": [1, {"model": model}]}


def test_an_object_is_its_own_state_dict_call_unless_a_module_is_among_its_attributes() -> None:
    from fsdp_legacy.migrate.beside_runtime import _holds_a_module

    assert not _holds_a_module(_Config())
    assert _holds_a_module(_Config(nn.Linear(1, 1)))  # four levels down: an attribute, a dict, a list, a dict
