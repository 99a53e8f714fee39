"""`kvmesh bench fuzz` end to end: it starts a server (the embedded model on the CPU, 512-token
context) and a router in front of it, runs a small schemathesis pass on both OpenAPI schemas plus the
raw probes, and the invariants hold: no 5xx but 503, every error in the OpenAI schema, no hang, no
engine restart, no process that died, and the pools empty after. (The server's and router's answers to
each kind of bad input, one by one: tests/integration/test_robustness.py.)"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvmesh.bench.fuzz import passed
from kvmesh.common.python_child import kvmesh_command

pytestmark = pytest.mark.integration

BODY_TIMEOUT = 2.0
HEADER_TIMEOUT = 2.0


def test_fuzz_keeps_the_invariants(tmp_path):
    out = tmp_path / "fuzz.json"
    cmd = kvmesh_command(
        "bench",
        "fuzz",
        "--serve-args",
        "--max-model-len 512 --num-kv-blocks 256 --stats-interval 0.1",
        *("--max-examples", "8", "--seed", "1", "--request-timeout", "60"),
        *("--body-timeout", str(BODY_TIMEOUT), "--header-timeout", str(HEADER_TIMEOUT)),
        *("--output-dir", str(tmp_path), "--output", str(out)),
    )
    env = dict(os.environ, KVMESH_CPU_THREADS="1", KVMESH_LOG_LEVEL="WARNING")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(out.read_text())
    bad = {k: (t["server_errors"], t["bad_error_bodies"], t["hangs"]) for k, t in s["per_target"].items()}
    assert passed(s), (bad, s["pools_after"], s["engine_restarted"], s["crashed"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert s["requests"] > 200
    assert set(s["targets"]) == {"server", "router"}
    # the server (and router) still running when the fuzzing ended: none crashed
    assert s["crashed"] == 0
