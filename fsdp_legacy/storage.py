"""Freeing a tensor's storage in place, and allocating it again.

A freed tensor keeps its identity, shape and dtype: views that autograd saved of the unsharded flat parameter stay
valid across a free and a later re-gather into the same storage (see handle.py). Freeing also returns at once memory
that a backend's work object would otherwise keep alive until it is released.
"""

import torch


def free_storage(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def freed_tensor(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `numel` elements whose storage is freed until `alloc_storage`."""
    tensor = torch.empty(numel, dtype=dtype, device=device)
    free_storage(tensor)
    return tensor


def alloc_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)
