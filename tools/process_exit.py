"""Leaving a rank process once its distributed work is done, without the interpreter's teardown."""

import os
import sys
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    """gloo's worker threads may still hold the last reference to a tensor of the final collectives (a worker marks
    its work done before it lets go of it). If one lets go while the interpreter shuts down, torch takes the GIL from
    that thread to release the tensor's Python object, Python ends the thread instead, and the process aborts
    ("terminate called without an active exception", rarely, on a loaded machine; a torch issue, seen with backtrace
    in ProcessGroupGloo::runLoop -> TensorImpl::decref_pyobject -> pthread_exit). Call this after everything is
    written and the process group destroyed: nothing is left for the teardown to do."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
