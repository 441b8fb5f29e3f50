"""A program's file that reaches another through its package (Lumina-mGPT's `import xllmx.util as util`, then
`util.ckpt.save(model, ...)`, the package's `__init__.py` not among the files) imports from it: where that file stays
FSDP1, so does the caller, rather than hand an FSDP2 model to FSDP1's blocks (a failure at the first save, the
program half migrated). A builder written as a `@staticmethod` (Lumina-mGPT's `setup_fsdp_sync`) is followed as a
method is."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("libcst")

from fsdp_legacy.migrate.program import migrate_program

_CKPT = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType


    def save(model, optimizer, path):
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            torch.save(model.state_dict(), path)
    """
)

_SOLVER = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    import xllmx.util as util


    class Solver:
        def build(self, net):
            model = self.setup_fsdp_sync(net)
            optimizer = torch.optim.AdamW(model.parameters())
            return model, optimizer

        @staticmethod
        def setup_fsdp_sync(model: nn.Module) -> FSDP:
            model = FSDP(model, device_id=torch.cuda.current_device())
            return model

        def save(self, model, optimizer):
            util.ckpt.save(model, optimizer, "ckpt.pt")
    """
)


def test_a_file_reaching_a_kept_file_through_its_package_stays_too() -> None:
    program = migrate_program({"xllmx/util/ckpt.py": _CKPT, "xllmx/solvers/solver.py": _SOLVER})
    ckpt, solver = program.results["xllmx/util/ckpt.py"], program.results["xllmx/solvers/solver.py"]
    assert ckpt.migrated == _CKPT and ckpt.findings
    assert solver.migrated == _SOLVER
    assert any("xllmx/util/ckpt.py, which stays FSDP1" in f.what for f in solver.findings)


def test_a_staticmethod_builder_is_followed_as_a_method() -> None:
    alone = migrate_program({"xllmx/solvers/solver.py": _SOLVER.replace("util.ckpt.save", "print")})
    result = alone.results["xllmx/solvers/solver.py"]
    assert result.findings == [], [f.format("solver.py") for f in result.findings]
    assert "fully_shard(model)" in result.migrated and "-> FSDPModule:" in result.migrated
