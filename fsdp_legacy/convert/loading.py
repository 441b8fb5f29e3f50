"""torch.load, always with weights_only=True, with errors that name the file and say what to do."""

import pickle
from typing import Any, BinaryIO, Union

import torch

from .errors import CheckpointError


def safe_load(file: Union[str, BinaryIO], where: str, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) onto the CPU: tensors and plain containers only, never pickled code."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        lines = [line.strip() for line in str(error).splitlines()]
        reason = next((line for line in lines if "unsupported" in line.lower()), lines[0] if lines else "")
        raise CheckpointError(
            f"{where} holds pickled Python objects other than tensors and plain containers ({reason}); loading them "
            "could run arbitrary code, so it is refused (torch.load(weights_only=True)). If you trust the file's "
            "origin, load it yourself with weights_only=False and save its tensors again with torch.save."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointError(
            f"{where} cannot be read: it is truncated or corrupted ({str(error).splitlines()[0]}). Restore it from a "
            "copy or re-create the checkpoint."
        ) from None
