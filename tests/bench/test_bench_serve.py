"""`kvmesh bench serve` pieces that need no server: datasets, trace replay, percentiles."""

from __future__ import annotations

import argparse
import json

import pytest

from kvmesh.bench import serve as bench_serve

pytestmark = pytest.mark.unit


def _args(**kw):
    p = argparse.ArgumentParser()
    bench_serve.add_args(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_random_and_shared_prefix_lengths():
    reqs = bench_serve.make_dataset(_args(dataset="random", num_prompts=5, input_len=7, output_len=3))
    assert [len(r.prompt) for r in reqs] == [7] * 5 and {r.output_len for r in reqs} == {3}
    reqs = bench_serve.make_dataset(
        _args(dataset="shared-prefix", num_prompts=4, num_prefixes=2, prefix_len=5, input_len=2)
    )
    assert reqs[0].prompt[:5] == reqs[2].prompt[:5] != reqs[1].prompt[:5]
    assert all(len(r.prompt) == 7 for r in reqs)


def test_trace_hash_ids_share_blocks(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 900, "hash_ids": [0, 1, 2]},
        {"timestamp": 6000, "input_length": 300, "output_length": 5, "hash_ids": [3]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    reqs = bench_serve.load_trace(
        str(path), 10, block_tokens=8, time_scale=0.5, max_in=None, max_out=100, lo=10, hi=100, seed=0
    )
    assert [len(r.prompt) for r in reqs] == [16, 18, 5]  # lengths scaled by 8/512, rounded up
    assert reqs[0].prompt == reqs[1].prompt[:16]  # hash ids 0, 1 -> the same 16 tokens
    assert reqs[2].prompt[:5] != reqs[0].prompt[:5]
    assert [r.send_at for r in reqs] == [0.0, 1.5, 3.0] and reqs[1].output_len == 100


def test_summary_percentiles():
    rs = [
        bench_serve.RequestResult(ok=True, prompt_len=10, output_tokens=5, ttft=t, e2e=t + 0.4, itl=[0.1] * 4)
        for t in (0.1, 0.2, 0.3, 0.4, 0.5)
    ]
    rs.append(bench_serve.RequestResult(error="HTTP 503"))
    s = bench_serve.summarize(rs, 2.0, [50, 99])
    assert s["completed"] == 5 and s["failed"] == 1 and s["errors"] == ["HTTP 503"]
    assert s["median_ttft_ms"] == pytest.approx(300) and s["p99_ttft_ms"] == pytest.approx(496)
    assert s["mean_tpot_ms"] == pytest.approx(100) and s["output_throughput"] == pytest.approx(12.5)
