"""Offline checkpoint conversion and checkpoint safety (CPU only, no process group, no model code).

    from fsdp_legacy.convert import convert_checkpoint
    report = convert_checkpoint("ckpt/local", "ckpt/fsdp2", to="dcp")

The command line: `python tools/convert_checkpoint.py SOURCE DESTINATION --to {local,dcp,full}`.
"""

from .converter import FORMATS, ConversionReport, convert_checkpoint, format_of, open_checkpoint, verify_conversion
from .errors import CheckpointError
from .record import FlatParamRecord, ParamRecord

__all__ = [
    "FORMATS",
    "CheckpointError",
    "ConversionReport",
    "FlatParamRecord",
    "ParamRecord",
    "convert_checkpoint",
    "format_of",
    "open_checkpoint",
    "verify_conversion",
]
