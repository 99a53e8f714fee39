"""`kvmesh bench router`'s pure parts: trace loading, the request builder, the ideal hit ratio, and the
repeat summary."""

from __future__ import annotations

import argparse
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


def _scaling(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    B.add_args(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_build_requests_scales_cuts_and_seeds(monkeypatch):
    monkeypatch.setattr(B, "_WORDS", [f" w{i}" for i in range(50)])  # no tokenizer needed
    rows = [
        {"timestamp": 0, "input_length": 2048, "output_length": 300, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 500, "input_length": 700, "output_length": 1, "hash_ids": [1, 9]},
    ]
    # the replay's defaults: 512-token hash blocks -> 4 words each, lengths x 4/512, outputs clamped
    reqs = B.build_requests(rows, _scaling(block_tokens=4, max_output=8), seed="kvmesh", max_len=1024)
    assert [r["t"] for r in reqs] == [0.0, 0.5]
    assert [[len(w) for _, w in r["blocks"]] for r in reqs] == [[4, 4, 4, 4], [4, 2]]  # ceil(700 x 4/512) = 6
    assert [h for h, _ in reqs[0]["blocks"]] == [1, 2, 3, 4]
    assert [r["max_tokens"] for r in reqs] == [8, 1]
    assert reqs[0]["blocks"][0] == reqs[1]["blocks"][0]  # hash id 1 -> the same words in both prompts
    # real workers: prompts cut to --max-blocks, outputs divided by --output-divisor before the clamp
    cut = B.build_requests(
        rows, _scaling(block_tokens=4, max_blocks=2, output_divisor=128, max_output=3), seed="kvmesh", max_len=1024
    )
    assert [[h for h, _ in r["blocks"]] for r in cut] == [[1, 2], [1, 9]]
    assert [r["max_tokens"] for r in cut] == [2, 1]  # 300 // 128 = 2; 1 // 128 = 0 -> at least 1
    assert cut[0]["blocks"] == reqs[0]["blocks"][:2]
    # the prompt fits the context: max_len - max_output - 1 tokens at most
    short = B.build_requests(rows[:1], _scaling(block_tokens=4, max_output=8), seed="kvmesh", max_len=16)
    assert sum(len(w) for _, w in short[0]["blocks"]) == 16 - 8 - 1
    # another policy's seed: other words for the same hash ids (no run warms the next one's cache)
    other = B.build_requests(rows, _scaling(block_tokens=4), seed="sglang", max_len=1024)
    assert other[0]["blocks"][0][1] != reqs[0]["blocks"][0][1]


def test_trace_is_required_but_for_overhead(capsys):
    assert B.run(_scaling()) == 2
    assert B.run(_scaling(tokenizer=5)) == 2
    assert "--trace is required" in capsys.readouterr().err


def test_peer_policies_and_unknown_ones(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}) + "\n")
    assert B.PEERS["sglang-rr"] == ("sglang", "round_robin") and B.PEERS["vllm"] == ("vllm", "cache_aware")
    assert B.peer_command("sglang", _scaling(peer_venvs=str(tmp_path))) is None  # no venv-sgl there
    assert B.run(_scaling(trace=str(trace), policies="kvmesh,nonesuch")) == 2
    assert "unknown policies ['nonesuch']" in capsys.readouterr().err


def test_tier_runs_need_the_tier_and_compare_side_by_side(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}) + "\n")
    assert B.base_policy("kvmesh+tier") == "kvmesh" and B.base_policy("sglang") == "sglang"
    assert B.run(_scaling(trace=str(trace), policies="kvmesh,kvmesh+tier")) == 2
    assert "need --kv-offload-blocks" in capsys.readouterr().err
    assert B.run(_scaling(trace=str(trace), policies="nonesuch+tier", kv_offload_blocks=8)) == 2
    assert "unknown policies ['nonesuch+tier']" in capsys.readouterr().err
    results = {
        "kvmesh": {"ok": 3, "hit_ratio": 0.2, "ideal_hit_ratio": 0.5, "ttft_p50": 0.4, "ttft_p90": 1.2},
        "kvmesh+tier": {"ok": 3, "hit_ratio": 0.45, "ideal_hit_ratio": 0.5, "ttft_p50": 0.3, "ttft_p90": 0.6},
        "sglang": {"ok": 3, "hit_ratio": 0.3, "ttft_p90": 1.0},  # no tiered run: not compared
        "vllm+tier": {"skipped": "no venv"},
    }
    got = B.tier_comparison(results)
    assert list(got) == ["kvmesh"]
    assert got["kvmesh"]["hit_ratio"] == 0.2 and got["kvmesh"]["hit_ratio_tier"] == 0.45
    assert got["kvmesh"]["ttft_p90_speedup"] == pytest.approx(2.0)
    B.print_tier_comparison(got)
    assert "2.000" in capsys.readouterr().out
