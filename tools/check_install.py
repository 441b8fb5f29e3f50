"""Check an installed fsdp_legacy (run from outside the checkout, so the installed copy is the one imported).

    cd /tmp && python3 /path/to/checkout/tools/check_install.py
    cd /tmp && FSDP_LEGACY=1 python3 /path/to/checkout/tools/check_install.py --switched

Two gloo ranks on 127.0.0.1 wrap a small model, train a step, and take the paths that need more than torch itself:
the optimizer state dict (torch's object collectives, which need numpy) and a DCP save and load. `--switched`: the
same through torch's own names, which the installed .pth hook must have made fsdp_legacy's (FSDP_LEGACY=1). Then the
installed commands (both ways): the `fsdp-legacy` script's help, and `python -m fsdp_legacy inspect` on the
DCP checkpoint the ranks saved, which must list the model's parameters and the optimizer state.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn

from process_exit import exit_now


def _rank(rank: int, world_size: int, port: int, directory: str, switched: bool) -> None:
    import fsdp_legacy

    names = importlib.import_module("torch.distributed.fsdp" if switched else "fsdp_legacy")
    FSDP, StateDictType = names.FullyShardedDataParallel, names.StateDictType
    ModuleWrapPolicy = importlib.import_module(f"{names.__name__}.wrap").ModuleWrapPolicy
    if FSDP is not fsdp_legacy.FullyShardedDataParallel:
        raise SystemExit("FSDP_LEGACY=1 did not put fsdp_legacy under torch's names: is the .pth hook installed?")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = FSDP(
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), auto_wrap_policy=ModuleWrapPolicy({nn.Linear})
        )
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
            dcp.save(state, checkpoint_id=directory)
            dcp.load(state, checkpoint_id=directory)
            model.load_state_dict(state["model"])
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))
    finally:
        dist.destroy_process_group()
    exit_now()  # (done: out without the teardown, where a gloo worker can abort the process; see process_exit.py)


# The model of _rank by clean FQN (FSDP(nn.Sequential(Linear(8, 16), ReLU(), Linear(16, 4)))), as inspect lists it
_PARAMETERS = {"0.weight": [16, 8], "0.bias": [16], "2.weight": [4, 16], "2.bias": [4]}  # all float32


def check_commands(checkpoint: str) -> None:
    """The installed script's help, and `python -m fsdp_legacy inspect` on the checkpoint the ranks saved."""
    script = Path(sysconfig.get_path("scripts")) / "fsdp-legacy"
    if not script.is_file():
        raise SystemExit(f"no {script}: the console script of setup.cfg's [options.entry_points] was not installed")
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=False)
    if done.returncode != 0 or not all(f"\n    {name}" in done.stdout for name in ("inspect", "convert", "mem-report")):
        raise SystemExit(f"{script} --help failed (exit code {done.returncode}):\n{done.stdout}{done.stderr}")
    command = [sys.executable, "-m", "fsdp_legacy", "inspect", checkpoint, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit code {done.returncode}):\n{done.stderr}")
    found = json.loads(done.stdout)
    listed = {p["name"]: p["shape"] for p in found["parameters"]}
    dtypes = {p["dtype"] for p in found["parameters"]}
    if found["format"] != "dcp" or listed != _PARAMETERS or dtypes != {"float32"} or not found["optimizer"]["present"]:
        raise SystemExit(
            f"inspect does not describe the saved checkpoint ({_PARAMETERS}, with Adam state):\n{done.stdout}"
        )


def main() -> None:
    import fsdp_legacy

    switched = "--switched" in sys.argv[1:]
    location = Path(fsdp_legacy.__file__).resolve()
    checkout = Path(__file__).resolve().parents[1]
    if checkout in location.parents:
        sys.exit(
            f"fsdp_legacy was imported from the checkout ({location}), not from an installed copy: run from elsewhere"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        mp.start_processes(_rank, args=(2, port, directory, switched), nprocs=2, start_method="spawn")
        check_commands(directory)  # under FSDP_LEGACY=1 too: their first import is fsdp_legacy itself
    through = "under torch's names (FSDP_LEGACY=1)" if switched else "by its own names"
    print(f"installed fsdp_legacy works {through}: {location.parent}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
