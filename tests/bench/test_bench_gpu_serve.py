"""bench/gpu_serve.py runs end to end on the CPU (--smoke): a random Llama folder with SmolLM2's tokenizer
served by a real `kvmesh serve` and loaded by `kvmesh bench serve`'s client at rate inf and at a Poisson
rate, against ``LLM.generate`` on the same prompts: every request of every pass completes with exactly the
asked output tokens, and the server's greedy tokens are the offline ones (float32: exact)."""

from __future__ import annotations

import argparse

import httpx
import pytest
from bench_smoke import run_smoke

from kvmesh.bench import serve as bench_serve
from kvmesh.testing.servers import alive

pytestmark = pytest.mark.integration


def test_serve_matches_offline_on_the_same_prompts(tmp_path):
    run = run_smoke("gpu_serve", tmp_path, timeout=240)
    res = run.results
    n, out_len = res["plan"]["prompts"], res["plan"]["output_len"]
    assert "errors" not in res and res["checks"]["pass"] and "PASS" in run.stdout
    off = res["offline"]
    assert off["completed"] == n and off["output_tokens"] == n * out_len
    assert off["kv_blocks"] == res["plan"]["kv_blocks"]  # the pool both sides were given
    for key in ("serve_inf", "serve_rate"):
        s = res[key]
        assert s["completed"] == n and s["failed"] == 0 and s["output_tokens"] == [out_len] * n
        assert s["total_input_tokens"] == n * res["plan"]["input_len"]
        assert s["cached_tokens"] == 0  # the cache was reset before each pass: every prompt prefilled in full
    assert res["serve_rate"]["rate"] == res["plan"]["rate"] and res["serve_inf"]["rate"] == "inf"
    assert res["tokens"] == {
        "rows": n, "exact_rows": n, "first_token_rows": n, "mean_agreement": 1.0, "lengths_ok": True
    }  # fmt: skip
    # The prompts are those of the `kvmesh bench serve` command the results name
    p = argparse.ArgumentParser()
    bench_serve.add_args(p)
    cli = p.parse_args(res["prompts"]["same_as"].split()[3:])
    reqs = bench_serve.make_dataset(cli)
    assert res["prompts"]["digest"] == _digest(reqs) and len(reqs) == n
    assert (tmp_path / "gpu_serve_server.log").exists()  # the server's output, beside the results
    # one server, stopped at the end: its API process and its engine are gone, nothing answers on its port
    srv = res["server"]
    assert srv["engine_pid"] is not None and not alive(srv["api_pid"]) and not alive(srv["engine_pid"])
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv["url"] + "/health", timeout=5)


def _digest(reqs) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps([r.prompt for r in reqs]).encode()).hexdigest()[:16]
