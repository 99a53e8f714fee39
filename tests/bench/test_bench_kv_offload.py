"""bench/gpu_kv_offload.py runs end to end on the CPU (--smoke): a long prompt's blocks pushed to the host
tier come back (blocks loaded, prompt tokens admitted from the host tier) with the recompute's token."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_offload_bench_smoke_run_loads_blocks_back(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "KVMESH_CPU_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-P", os.path.join(ROOT, "bench", "gpu_kv_offload.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    got = json.loads((tmp_path / "gpu_kv_offload.json").read_text())["offload"]
    assert got["loaded_blocks"] > 0 and got["host_hit_tokens"] == got["loaded_blocks"] * 16
    assert got["same_first_token"] and got["recompute_same_first_token"]  # float32: exact
