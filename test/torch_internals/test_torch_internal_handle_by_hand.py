"""A FlatParamHandle built by hand with torch FSDP1's constructor call, as torch's test_fsdp_flatten_params builds one:
`FlatParamHandle(params, module, device, strategy, offload_params, param_dtype, reduce_dtype,
keep_low_precision_grads, group, use_orig_params)`, then `shard()`, then `_get_shard_metadata(first, last)` assigned
to `flat_param._shard_param_infos` and read back through `shard_metadata()`.

Oracle: torch's FSDP1, side by side on 2 ranks through the same code (it names torch's `_flat_param` module only, which
is ours under the switch): the flat parameter as built (unsharded, the modules showing views of it) and after
`shard()`, the metadata of arbitrary intervals, the errors of a call with nothing to flatten. Also the shard metadata
of FSDP's own units holding a parameter without elements, where ours followed other rules until the handle's
`_get_shard_metadata` was added.
"""

from __future__ import annotations

import importlib
import operator
from typing import Any

import torch
import torch.distributed as dist
from parameterized import parameterized
from torch import nn

from torch_side_by_side import _FSDP, _flat, _run, _run_both, _units


def _flat_param_module() -> Any:
    return importlib.import_module("torch.distributed.fsdp._flat_param")


class _Tied(nn.Module):
    """Odd sizes (world-size and alignment padding), a tied weight reached twice, a parameter without elements."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.first = nn.Linear(5, 3, dtype=dtype)
        self.middle = nn.Module()
        self.middle.empty = nn.Parameter(torch.empty(0, dtype=dtype))
        self.second = nn.Linear(3, 3, bias=False, dtype=dtype)
        self.last = nn.Linear(3, 7, dtype=dtype)
        self.again = nn.Linear(3, 3, bias=False, dtype=dtype)
        self.again.weight = self.second.weight


def _build(strategy: str, use_orig_params: bool, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    flat_param = _flat_param_module()
    module = _Tied(dtype)
    handle = flat_param.FlatParamHandle(
        list(module.parameters()),
        module,
        torch.device("cpu"),
        flat_param.HandleShardingStrategy[strategy],
        False,
        None,
        None,
        False,
        dist.distributed_c10d._get_default_group(),
        use_orig_params,
    )
    return module, handle


def _infos(infos: Any) -> list[tuple]:
    return [tuple(info) for info in infos]


def _built_then_sharded(strategy: str, use_orig_params: bool, half: bool) -> dict[str, Any]:
    module, handle = _build(strategy, use_orig_params, torch.float16 if half else torch.float32)
    flat = handle.flat_param
    seen: dict[str, Any] = {
        "built numel": flat.numel(),
        "unpadded unsharded size": tuple(flat._unpadded_unsharded_size),
        "built values": _flat(flat),
        "fqns": list(flat._fqns),
        "numels with padding": list(flat._numels_with_padding),
        "strategy": handle._sharding_strategy.name,
        # The modules show views of the unsharded flat parameter, tensors rather than parameters.
        "shown": {
            fqn: (type(operator.attrgetter(fqn)(module)) is torch.Tensor, _flat(operator.attrgetter(fqn)(module)))
            for fqn in (*flat._fqns, "again.weight")
        },
    }
    handle.shard()
    flat = handle.flat_param
    seen.update(
        {
            "sharded numel": flat.numel(),
            "sharded values": _flat(flat),
            "sharded size": tuple(flat._sharded_size),
            "shard numel padded": flat._shard_numel_padded,
            "shard param infos": _infos(flat._shard_param_infos),
            "shard metadata": [list(field) for field in handle.shard_metadata()],
            "metadata type": type(handle.shard_metadata()).__name__,
        }
    )
    if use_orig_params:  # the original parameters, registered again, as views of the shard
        seen["parameters"] = {name: _flat(p) for name, p in module.named_parameters()}
    return seen


CASES = [
    (strategy, uop, half)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    for uop in (False, True)
    for half in (False, True)
    if not half or (strategy == "FULL_SHARD")
]


@parameterized.expand(CASES)
def test_handle_built_by_hand_then_sharded(strategy: str, use_orig_params: bool, half: bool) -> None:
    for seen in _run(_built_then_sharded, strategy, use_orig_params, half):
        assert seen["built numel"] == seen["unpadded unsharded size"][0], seen
        assert seen["metadata type"] == "FlatParamShardMetadata", seen


# Intervals [first, last] of the unsharded flat parameter, both ends included: inside one parameter, across
# parameters and padding, at the parameter without elements, past the end; one ending before it starts (an error
# where it meets a parameter, none past the end).
INTERVALS = [(0, 0), (0, 14), (3, 20), (14, 18), (17, 17), (18, 26), (20, 60), (40, 1000), (5, 4), (2000, 1000)]


def _interval_metadata(use_orig_params: bool) -> list[Any]:
    _, handle = _build("FULL_SHARD", use_orig_params)
    handle.shard()
    seen = []
    for first, last in INTERVALS:
        try:
            infos = handle._get_shard_metadata(first, last)
        except AssertionError:
            seen.append((first, last, "AssertionError"))
            continue
        handle.flat_param._shard_param_infos = infos
        seen.append((first, last, _infos(infos), [list(field) for field in handle.shard_metadata()]))
    handle.shard()  # (ours: drops the assigned infos; torch's: shards again; read no further)
    return seen


@parameterized.expand([(False,), (True,)])
def test_shard_metadata_of_any_interval(use_orig_params: bool) -> None:
    for seen in _run(_interval_metadata, use_orig_params):
        assert seen[1][3][0] == ["first.weight"], seen
        assert seen[2][3][0] == ["first.weight", "first.bias", "middle.empty", "second.weight"], seen
        assert seen[-2][2] == "AssertionError", seen


def _nothing_to_flatten() -> dict[str, Any]:
    flat_param = _flat_param_module()
    module = nn.Linear(2, 2)
    seen = {}
    for label, params in (("empty", []), ("elsewhere", [nn.Parameter(torch.ones(2))])):
        try:
            flat_param.FlatParamHandle(
                params,
                module,
                torch.device("cpu"),
                flat_param.HandleShardingStrategy.FULL_SHARD,
                False,
                None,
                None,
                False,
                dist.distributed_c10d._get_default_group(),
                False,
            )
        except ValueError as error:
            seen[label] = str(error).split("tree")[0]
    return seen


def test_handle_with_nothing_to_flatten_raises() -> None:
    for seen in _run(_nothing_to_flatten):
        assert seen["empty"] == "Cannot construct a FlatParamHandle with an empty parameter list", seen


def _with_an_extension() -> str:
    """A handle built with an `fsdp_extension` whose transforms pass the tensors through (torch's own protocol)."""
    flat_param = _flat_param_module()
    extensions = importlib.import_module("torch.distributed.fsdp._fsdp_extensions")

    class PassThrough(extensions.FSDPExtensions):
        def pre_flatten_transform(self, tensor):  # type: ignore[no-untyped-def]
            return tensor, None

        def post_unflatten_transform(self, tensor, param_extension):  # type: ignore[no-untyped-def]
            return tensor

        def chunk_tensor(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("not reached")

        def chunk_dtensor(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("not reached")

        def pre_load_state_dict_transform(self, tensor):  # type: ignore[no-untyped-def]
            raise AssertionError("not reached")

        def all_gather_dtensor(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("not reached")

    module = nn.Linear(2, 2)
    args = (flat_param.HandleShardingStrategy.FULL_SHARD, False, None, None, False)
    group = dist.distributed_c10d._get_default_group()
    try:
        flat_param.FlatParamHandle(
            list(module.parameters()), module, torch.device("cpu"), *args, group, False, fsdp_extension=PassThrough()
        )
    except NotImplementedError as error:
        return str(error)
    return "built"


def test_handle_with_an_extension_is_built_by_torch_and_refused_by_name_on_ours() -> None:
    """torch's FSDP1 calls the extension's transforms; ours flattens DTensors itself and says so, not ignoring it."""
    for seen in _run_both(_with_an_extension):
        assert seen["torch"] == "built", seen
        assert "fsdp_extension" in seen["ours"] and "DTensor" in seen["ours"], seen


def _unit_shard_infos(strategy: str, use_orig_params: bool) -> list[list[tuple]]:
    fsdp = importlib.import_module("torch.distributed.fsdp")
    model = _FSDP(
        _Tied(torch.float32), sharding_strategy=fsdp.ShardingStrategy[strategy], use_orig_params=use_orig_params
    )
    return [_infos(unit._handle.flat_param._shard_param_infos) for unit in _units(model)]


@parameterized.expand([(strategy, uop) for strategy in ("FULL_SHARD", "NO_SHARD") for uop in (False, True)])
def test_unit_shard_infos_with_a_parameter_without_elements(strategy: str, use_orig_params: bool) -> None:
    _run(_unit_shard_infos, strategy, use_orig_params)
