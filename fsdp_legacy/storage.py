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


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a.is_set_to(b)`: the same storage, offset, shape and strides. Compared here because is_set_to has no meta
    kernel: under FakeTensorMode (the memory estimator) each call ran it on real zero-filled tensors of their size."""
    return (
        a.untyped_storage()._cdata == b.untyped_storage()._cdata
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )
