"""`--layout-from pkg.mod:factory --wrap pkg.mod.Layer`: the flat-parameter layout of a model, from its code.

A LOCAL checkpoint written by a plain `dcp.save` (or by torch's FSDP1) holds each unit's flat parameter but not what
it is made of. The converter reads that from layout records; where the checkpoint has none, this builds them from
the model itself: the factory's model is wrapped by fsdp_legacy on fake tensors in a fake world (nothing is
allocated, no process group is needed, any size of model), and each unit's layout is recorded as a LOCAL save of it
would record it. The wrapping must be the one the checkpoint was saved with (the class each unit wraps,
use_orig_params); the converter then checks the layout against the checkpoint's sizes.
"""

from __future__ import annotations

import warnings

from torch._subclasses.fake_tensor import FakeTensorMode

from ..convert.record import FlatParamRecord
from ..fully_sharded_data_parallel import FullyShardedDataParallel
from ..memory.fake_world import fake_process_group
from ..state.state_dict import clean_key
from ..unit import FSDPUnit
from ..wrap import ModuleWrapPolicy
from .common import UsageError, import_name, module_class

FAKE_WORLD = 2  # any size above 1 (one rank is NO_SHARD); the converter lays the records out at the checkpoint's


def is_model_spec(text: str) -> bool:
    """Whether --layout-from names model code (pkg.mod:factory) rather than a checkpoint path."""
    module, colon, factory = text.partition(":")
    return bool(colon) and module.replace(".", "").replace("_", "").isalnum() and factory.isidentifier()


def layout_of_model(spec: str, wrap: str | None, use_orig_params: bool) -> dict[str, FlatParamRecord]:
    """The layout records, by flat key, of `spec`'s model (pkg.mod:factory, a function returning the plain model)
    wrapped in one FSDP unit per `wrap` class (pkg.mod.Layer) and one for the root."""
    if not wrap:
        raise UsageError(
            f"--layout-from {spec} needs --wrap: the dotted class of the module each FSDP unit wraps (your "
            "transformer layer, e.g. mypkg.models.Layer), as when the checkpoint was saved."
        )
    module, _, factory = spec.partition(":")
    build = import_name(module, factory, f"--layout-from {spec}")
    if not callable(build):
        raise UsageError(f"--layout-from {spec}: {factory} is not a function returning a model.")
    unit_class = module_class(wrap)
    with fake_process_group(FAKE_WORLD), FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FullyShardedDataParallel(
            build(), auto_wrap_policy=ModuleWrapPolicy({unit_class}), use_orig_params=use_orig_params
        )
        records = {}
        for name, unit in model.named_modules():
            if isinstance(unit, FSDPUnit):
                prefix = clean_key(f"{name}." if name else "")
                for handle in unit._handles:
                    record = FlatParamRecord.from_layout(
                        handle.layout, prefix, handle.local_shard.dtype, handle.flat_name
                    )
                    records[record.flat_key] = record
    if not records:
        raise UsageError(f"--layout-from {spec}: the model has no parameters to lay out.")
    return records
