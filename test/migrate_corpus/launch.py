"""`torchrun launch.py [--fsdp1-on-cpu] PROGRAM ARGS...`: runs a corpus program (or its migration) unchanged, then
leaves the process without the interpreter's teardown (tools/process_exit.py: a gloo worker thread may abort it,
rarely, under load, after all the work is done).

--fsdp1-on-cpu patches torch's FSDP1 for its own CPU-only limits first: a FULL state dict with offload_to_cpu=True
frees storage still in use when the compute device is the CPU (test/frameworks/common.py mends it), and
sync_module_states refuses CPU tensors, which gloo broadcasts well (the check is skipped). On a GPU an FSDP1 program
needs neither; the migrated (FSDP2) programs need nothing."""

import runpy
import sys
from pathlib import Path

TEST = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TEST / "frameworks"), str(TEST.parent / "tools")]

from common import patch_torch_fsdp1_for_cpu  # noqa: E402

from process_exit import exit_now  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[0] == "--fsdp1-on-cpu":
        import torch.distributed.fsdp._init_utils as init_utils

        patch_torch_fsdp1_for_cpu()
        init_utils._check_module_states_for_sync_module_states = lambda module_states: None
        args = args[1:]
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")
    exit_now()
