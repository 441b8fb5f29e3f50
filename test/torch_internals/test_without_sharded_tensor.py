"""fsdp_legacy on a torch without ShardedTensor (deprecated in favour of DTensor), as torch will be once it removes it:
test/without_sharded_tensor/check.py hides `torch.distributed._shard.sharded_tensor` in every rank of a 2- and a 4-rank
run (at 4 ranks, l2's two rows leave ranks 2 and 3 empty pieces).
SHARDED model and optimizer state dicts without a device mesh then hold DTensors on a 1-D mesh over the process group,
laid out as torch FSDP1's with a 1-D device mesh (the oracle), and round-trip through DCP, load into FSDP2 and convert
offline; LOCAL_STATE_DICT (a ShardedTensor format) is refused with a clear error. Whenever torch has ShardedTensor,
the SHARDED format stays torch's ShardedTensors (test_state_dict.py).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import repo_paths

HERE = repo_paths.TEST_DIR / "without_sharded_tensor"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, world_size: int, use_orig_params: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FSDP_LEGACY"} | {"OMP_NUM_THREADS": "1"}
    out = tmp_path / "found.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={world_size}",
        "--master-addr=127.0.0.1",
    ]
    command += [f"--master-port={_free_port()}", str(HERE / "check.py"), "--out", str(out), "--dir", str(tmp_path)]
    command += ["--use-orig-params"] if use_orig_params else []
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.heavy  # a whole program in other processes: CI runs it after the README's tests (pytest -m heavy)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "uop"])
def test_sharded_state_dicts_fall_back_to_dtensors_without_sharded_tensor(
    tmp_path: Path, world_size: int, use_orig_params: bool
) -> None:
    found = _run(tmp_path, world_size, use_orig_params)
    assert found["sharded_tensor_hidden"] and not found["fsdp_legacy_sees_sharded_tensor"]
    assert found["same_layout_as_torch_with_a_mesh"], found["layout"]
    assert found["layout"]["model"]["l1.weight"][:3] == ["DTensor", [5, 3], ["S(0)"]]
    assert found["vs_torch_with_a_mesh"] < 1e-6
    for exact in ("dcp_round_trip", "dcp_round_trip_optim", "fsdp2_load", "converted"):
        assert found[exact] == 0.0, exact
    assert "LOCAL_STATE_DICT holds each unit's flat shard as a ShardedTensor" in found["local_state_dict"]
