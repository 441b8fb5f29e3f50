"""summon_full_params before any forward, as torch's test_fsdp_unshard_params (`_test_unshard_params_param_data`)
does on a model whose root is no FSDP instance: torch's FSDP1 lazily initialises each unit it unshards, outermost
first, so afterwards the units that nothing wraps are roots (`_is_root` True, the nested ones False), and with
`recurse=False` a module that is no FSDP instance gathers nothing. Read through `_traversal_utils`, side by side."""

from __future__ import annotations

from typing import Any

from parameterized import parameterized
from torch import nn

from torch_side_by_side import _FSDP, _fsdp, _run, _traversal


def _model() -> nn.Module:
    """Two FSDP roots under a plain Sequential, the first with a nested unit."""
    inner = nn.Sequential(nn.Linear(4, 4), _FSDP(nn.Linear(4, 4)))
    return nn.Sequential(nn.Linear(3, 4), _FSDP(inner), _FSDP(nn.Linear(4, 2)))


def _roots_after_summon(recurse: bool) -> dict[str, Any]:
    model = _model()
    before = [p.numel() for p in model.parameters()]
    with _fsdp().FullyShardedDataParallel.summon_full_params(model, recurse=recurse):
        inside = [p.numel() for p in model.parameters()]
    return {
        "is_root": [state._is_root for state in _traversal()._get_fsdp_states(model)],
        "numels before": before,
        "numels inside": inside,
    }


@parameterized.expand([(True,), (False,)])
def test_summon_full_params_initialises_units_as_torch(recurse: bool) -> None:
    for observed in _run(_roots_after_summon, recurse):
        # not vacuous: gathering changed the sizes (recurse) and made the two outer units roots
        assert observed["is_root"] == ([True, False, True] if recurse else [None, None, None]), observed
        assert (observed["numels before"] != observed["numels inside"]) == recurse, observed
