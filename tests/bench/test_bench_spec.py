"""bench/gpu_spec.py runs end to end on the CPU (--smoke): with the oracle's drafts always right every
draft is accepted, and at every agreement the speculating engine's greedy tokens equal the plain run's;
every row counts its steps with drafts (all eager on the CPU, which has no CUDA graphs)."""

from __future__ import annotations

import pytest
from bench_smoke import run_smoke

pytestmark = pytest.mark.unit


def test_the_spec_bench_smoke_run_keeps_the_tokens(tmp_path):
    rows = run_smoke("gpu_spec", tmp_path).results["rows"]
    assert rows and all(r["same"] for r in rows)
    assert all(r["acceptance"] == 1.0 for r in rows if r["p"] == 1.0)
    assert all(r["acceptance"] < 1.0 for r in rows if r["p"] < 1.0)
    assert all(r["verify_eager_steps"] > 0 and r["verify_graph_steps"] == 0 for r in rows)
