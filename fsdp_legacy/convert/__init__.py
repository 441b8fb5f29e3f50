"""Offline checkpoint conversion and checkpoint safety (CPU only, no process group, no model code).

    from fsdp_legacy.convert import convert_checkpoint
    report = convert_checkpoint("ckpt/local", "ckpt/fsdp2", to="dcp")

The command line: `python tools/convert_checkpoint.py SOURCE DESTINATION --to {local,dcp,full,safetensors}
[--from {auto,local,dcp,full,accelerate,lightning,verl,safetensors}]`.
"""

from .converter import FORMATS, ConversionReport, convert_checkpoint, format_of, open_checkpoint, verify_conversion
from .errors import CheckpointError
from .record import FlatParamRecord, ParamRecord
from .sources import SOURCE_LAYOUTS, detect_layout

__all__ = [
    "FORMATS",
    "SOURCE_LAYOUTS",
    "CheckpointError",
    "ConversionReport",
    "FlatParamRecord",
    "ParamRecord",
    "convert_checkpoint",
    "detect_layout",
    "format_of",
    "open_checkpoint",
    "verify_conversion",
]
