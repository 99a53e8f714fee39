"""bench/gpu_kv_offload.py runs end to end on the CPU (--smoke): a long prompt's blocks pushed to the host
tier come back (blocks loaded, prompt tokens admitted from the host tier) with the recompute's token."""

from __future__ import annotations

import pytest
from bench_smoke import run_smoke

pytestmark = pytest.mark.unit


def test_the_offload_bench_smoke_run_loads_blocks_back(tmp_path):
    got = run_smoke("gpu_kv_offload", tmp_path).results["offload"]
    assert got["loaded_blocks"] > 0 and got["host_hit_tokens"] == got["loaded_blocks"] * 16
    assert got["same_first_token"] and got["recompute_same_first_token"]  # float32: exact
