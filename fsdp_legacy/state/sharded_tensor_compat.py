"""torch's ShardedTensor, while torch has it.

torch deprecates ShardedTensor in favour of DTensor. FSDP1's SHARDED and LOCAL state dicts without a device mesh
hold ShardedTensors, and fsdp_legacy keeps that format while torch offers the class. Once it is gone, `AVAILABLE` is
False, `ShardedTensor` is a stand-in no value is an instance of (so isinstance checks simply fail), and SHARDED state
dicts hold DTensors on a 1-D mesh over the unit's process group instead (state_dict_dtensor.py), as FSDP2 saves them.
"""

try:
    from torch.distributed._shard.sharded_tensor import (
        Shard,
        ShardedTensor,
        ShardedTensorMetadata,
        ShardMetadata,
        TensorProperties,
    )

    AVAILABLE = True
except ImportError:  # a torch without ShardedTensor
    AVAILABLE = False

    class ShardedTensor:  # type: ignore[no-redef]
        """Stands in for the missing class: nothing is an instance of it."""

    Shard = ShardedTensorMetadata = ShardMetadata = TensorProperties = None  # type: ignore[assignment,misc]

__all__ = ["AVAILABLE", "Shard", "ShardMetadata", "ShardedTensor", "ShardedTensorMetadata", "TensorProperties"]
