"""`kvmesh bench router`'s pure parts: trace loading, the ideal hit ratio, and the repeat summary."""

from __future__ import annotations

import json

import pytest

from kvmesh.bench import router as B

pytestmark = pytest.mark.unit


def test_load_trace_rejects_rows_without_mooncake_fields(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 10, "hash_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="output_length"):
        B.load_trace(str(p), 0)


def test_conversation_selection_keeps_whole_conversations(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 10, "input_length": 1024, "output_length": 1, "hash_ids": [0, 2]},
        {"timestamp": 20, "input_length": 1536, "output_length": 1, "hash_ids": [0, 1, 3]},
        {"timestamp": 30, "input_length": 512, "output_length": 1, "hash_ids": [0, 4]},
        {"timestamp": 40, "input_length": 1536, "output_length": 1, "hash_ids": [0, 4, 5]},
    ]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = B.load_trace(str(p), 0, "conversations", window_s=1.0)
    assert [r["hash_ids"][1] for r in got] == [1, 1, 4, 4]  # the one-turn conversation (2) left out


def test_ideal_hit_ratio_counts_whole_shared_blocks_only():
    a = [(0, [1] * 4), (1, [2] * 4)]
    b = [(0, [1] * 4), (1, [2] * 4), (2, [3] * 4)]  # shares both blocks of a
    c = [(0, [1] * 4), (9, [5] * 2)]  # shares block 0; its partial block never counts
    hit = 0 + 8 + 4
    assert B.ideal_hit_ratio([a, b, c]) == pytest.approx(hit / (8 + 12 + 6))
    # the last prompt token is always recomputed: a repeat of a is a hit of one block, not two
    assert B.ideal_hit_ratio([a, a]) == pytest.approx(4 / 16)


def test_summarize_means_deviations_and_runs():
    runs = [
        dict(
            hit_ratio=h,
            ttft_p50=0.1,
            ttft_p90=p90,
            ttft_p99=1.0,
            ttft_mean=0.2,
            throughput=4.0,
            output_tok_s=30.0,
            makespan_s=40.0,
            imbalance=im,
            router_cpu_pct=None,
            ok=10,
            failed=f,
            ideal_hit_ratio=0.5,
            round=i,
        )
        for i, (h, p90, im, f) in enumerate([(0.4, 1.0, 1.2, 0), (0.5, 1.4, 1.4, 1), (0.6, 1.2, 1.0, 0)])
    ]
    s = B.summarize(runs)
    assert s["hit_ratio"] == pytest.approx(0.5) and s["ttft_p90"] == pytest.approx(1.2)
    assert s["sd"]["hit_ratio"] == pytest.approx(0.1) and s["sd"]["imbalance"] == pytest.approx(0.2)
    assert s["ok"] == 30 and s["failed"] == 1 and s["router_cpu_pct"] is None
    assert s["runs"] == runs
    assert B.summarize(runs[:1]) is runs[0]  # one run: reported as it is


def test_variants_parse_and_refuse_clashing_names():
    got = B.parse_variants(["share0=--weight-share 0", "q='--weight-load' 0.5"], {"kvmesh"})
    assert got == {"share0": ["--weight-share", "0"], "q": ["--weight-load", "0.5"]}
    for bad in (["kvmesh=--weight-share 0"], ["noequals"], ["a,b=--x 1"], ["v=", "v=--x 1"]):
        with pytest.raises(ValueError, match="NAME=FLAGS"):
            B.parse_variants(bad, {"kvmesh"})


def test_ideal_hits_per_request_and_losses():
    a = [(0, [1] * 4), (1, [2] * 4), (2, [3] * 1)]
    b = [(0, [1] * 4), (1, [2] * 4), (3, [4] * 4), (4, [5] * 4)]  # 8 of a's tokens cached, then new
    c = [(7, [9] * 4), (8, [8] * 2)]
    ideal = B.ideal_hits([a, b, c])
    assert ideal == [(0, 9), (8, 16), (0, 6)]
    assert B.ideal_hit_ratio([a, b, c]) == B.ideal_hit_ratio(per=ideal) == pytest.approx(8 / 31)
    # b went where its prefix was not: all 8 ideal tokens lost, one missed follow-up
    got = B.hit_losses(ideal, [0, 0, 0])
    assert got == {"lost_ratio": pytest.approx(8 / 31), "missed_followups": 1, "lost_in_missed": 1.0}
    # (b's ideal is half its prompt: a follow-up; a partial hit of 4 is not "missed", 0 is)
    ideal2 = [(0, 9), (8, 16)]
    assert B.hit_losses(ideal2, [0, 4])["missed_followups"] == 0
    assert B.hit_losses(ideal2, [0, 0]) == {
        "lost_ratio": pytest.approx(8 / 25),
        "missed_followups": 1,
        "lost_in_missed": 1.0,
    }
    assert B.hit_losses(ideal2, [0, 8])["lost_ratio"] == 0.0
    # a router that drops usage: no figures rather than wrong ones
    assert B.hit_losses(ideal2, [0, None])["lost_ratio"] is None


def test_usage_cached_reads_the_stream_chunk():
    chunk = json.dumps({"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}})
    assert B.usage_cached(chunk) == 32
    assert B.usage_cached(json.dumps({"usage": {"prompt_tokens": 40}})) is None
    assert B.usage_cached("not json") is None
