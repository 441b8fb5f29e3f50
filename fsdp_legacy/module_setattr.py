"""How an original parameter's attribute is written on its module, as torch's FSDP1 writes it.

torch's FSDP1 sets the views of the flat parameter on the modules with `delattr` and `setattr` by default, so a module
class that overrides `__setattr__` sees every write (its "safe" mode); with the environment variable
FSDP_USE_UNSAFE_SETATTR=1, read when a unit is built, it writes the module's dicts directly. Ours writes the dicts
(what attribute lookup reads first, leaving `_parameters` to the handle), and for a module whose class overrides
`__setattr__` in safe mode goes through that override as well, so the module sees the same writes as under torch's.
"""

import os

from torch import nn

UNSAFE_SETATTR = "FSDP_USE_UNSAFE_SETATTR"  # torch's name for the variable


def unsafe_setattr() -> bool:
    return os.environ.get(UNSAFE_SETATTR, "") == "1"


def overrides_setattr(module: nn.Module) -> bool:
    return type(module).__setattr__ is not nn.Module.__setattr__


def show(module: nn.Module, name: str, value: object, through_setattr: bool) -> None:
    """Make `module.<name>` read `value`, or (None) whatever `_parameters` registers. `through_setattr`: by way of
    the module's own `__setattr__`, with the registered parameter set aside meanwhile (nn.Module refuses a plain
    tensor over a registered name) and put back after, as the handle keeps it."""
    if not through_setattr:
        if value is None:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = value
        return
    registered = module._parameters.pop(name, None)
    module.__dict__.pop(name, None)
    try:
        setattr(module, name, registered if value is None else value)
    finally:
        if registered is not None:
            module._parameters[name] = registered
            if value is None:
                module.__dict__.pop(name, None)
