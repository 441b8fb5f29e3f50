"""The damage helpers of the readers' tests (test_seals.py, test_malformed_inputs.py): they live with the checkpoint
fuzzer, which mutates checkpoints with them too (tools/checkpoint_fuzz/damage.py)."""

import sys

import repo_paths

sys.path.insert(0, str(repo_paths.TOOLS))

from checkpoint_fuzz.damage import (
    data_record_offset,
    dcp_items,
    flip_bit,
    flip_in_item,
    largest_tensor,
    pickle_offset,
    rewrite_metadata,
    rewrite_safetensors_header,
    safetensors_header,
    set_record_field,
    tensors_holding,
)

__all__ = [
    "data_record_offset",
    "dcp_items",
    "flip_bit",
    "flip_in_item",
    "largest_tensor",
    "pickle_offset",
    "rewrite_metadata",
    "rewrite_safetensors_header",
    "safetensors_header",
    "set_record_field",
    "tensors_holding",
]
