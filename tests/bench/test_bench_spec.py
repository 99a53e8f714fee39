"""bench/gpu_spec.py runs end to end on the CPU (--smoke): with the oracle's drafts always right every
draft is accepted, and at every agreement the speculating engine's greedy tokens equal the plain run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_spec_bench_smoke_run_keeps_the_tokens(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "KVMESH_CPU_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-P", os.path.join(ROOT, "bench", "gpu_spec.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads((tmp_path / "gpu_spec.json").read_text())["rows"]
    assert rows and all(r["same"] for r in rows)
    assert all(r["acceptance"] == 1.0 for r in rows if r["p"] == 1.0)
    assert all(r["acceptance"] < 1.0 for r in rows if r["p"] < 1.0)
