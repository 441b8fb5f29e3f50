"""fsdp_legacy on a torch without FSDP1, as torch will be once it removes it: test/without_fsdp1/sitecustomize.py
hides torch's FSDP1 (its class and configs in torch.distributed.fsdp, the modules fully_sharded_data_parallel and
wrap, the legacy optimizer-state methods with the class) in every process of a 2-rank run of
test/without_fsdp1/check.py. fsdp_legacy by its own names, and code written for torch's FSDP1 under FSDP_LEGACY=1,
train equal to DDP, round-trip FULL / SHARDED / LOCAL state dicts and optimizer state through DCP, convert offline
and migrate to FSDP2; with the switch, torch's own DSD helpers work on the model too.

(torch 2.13's FSDP2 imports `_flat_param`, `api` and `_common_utils`, which therefore stay; so does the DSD module,
which imports FSDP1 names at its top and so loads here only with the switch, as a torch without FSDP1 will not need.)
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import repo_paths

HERE = repo_paths.TEST_DIR / "without_fsdp1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, switched: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FSDP_LEGACY"}
    env |= {"PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1])]), "OMP_NUM_THREADS": "1"}
    if switched:
        env["FSDP_LEGACY"] = "1"
    out = tmp_path / "found.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"]
    command += [f"--master-port={_free_port()}", str(HERE / "check.py"), "--out", str(out), "--dir", str(tmp_path)]
    done = subprocess.run(
        [*command, *(["--switched"] if switched else [])], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
@pytest.mark.parametrize("switched", [False, True], ids=["own_names", "FSDP_LEGACY=1"])
def test_fsdp_legacy_works_on_a_torch_without_fsdp1(tmp_path: Path, switched: bool) -> None:
    found = _run(tmp_path, switched)
    ours = "fsdp_legacy.fully_sharded_data_parallel.FullyShardedDataParallel"
    assert found["fsdp_class"] == ours
    if switched:  # torch's FSDP1 names are ours, the module a stand-in of fsdp_legacy's
        assert found["torch_fsdp1_module"] == "stand-in"
        assert found["torch_dsd_helpers_round_trip"] == 0.0
    else:
        assert found["torch_fsdp1_module"] == "gone" and not found["torch_has_fsdp1_class"]
    assert found["vs_ddp"] < 1e-6
    expected = [
        "block.fc1.bias",
        "block.fc1.weight",
        "block.fc2.weight",
        "l1.bias",
        "l1.weight",
        "l2.bias",
        "l2.weight",
    ]
    assert found["legacy_full_optim_state_dict"] == expected
    for exact in ("SHARDED_STATE_DICT_round_trip", "LOCAL_STATE_DICT_round_trip", "fsdp2_load", "converted_local"):
        assert found[exact] == 0.0, exact
