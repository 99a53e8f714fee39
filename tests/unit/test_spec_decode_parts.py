"""Speculative decoding's parts on their own (engine/spec/): the config's parsing and checks, the
n-gram proposer, the rejection sampler's exactness (greedy: the target's argmax; random: each emitted
token distributed as the target's, by a chi-square test over fixed seeds), the runner's logit rows,
and the Prometheus counters."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from kvmesh import SamplingParams
from kvmesh.engine.core.sched_output import ScheduledRequest, SchedulerOutput
from kvmesh.engine.runner.inputs import plan_step
from kvmesh.engine.spec.config import SpeculativeConfig
from kvmesh.engine.spec.ngram import NgramProposer
from kvmesh.engine.spec.rejection import verify

pytestmark = pytest.mark.unit


def test_config_parses_vllm_json():
    c = SpeculativeConfig.parse(
        '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}'
    )
    assert c == SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=2)
    d = SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "num_speculative_tokens": 3})
    assert d is not None and d.model == "/m" and d.num_speculative_tokens == 3
    e = SpeculativeConfig.parse('{"method":"draft_model","model":"embedded","num_speculative_tokens":2}')
    assert e is not None and e.model is None
    assert SpeculativeConfig.parse(e.to_json()) == e and SpeculativeConfig.parse(c.to_json()) == c
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("  ") is None


@pytest.mark.parametrize(
    "value, message",
    [
        ("{method", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"method":"eagle","num_speculative_tokens":2}', "method"),
        ('{"method":"ngram"}', "num_speculative_tokens"),
        ('{"method":"ngram","num_speculative_tokens":0}', "num_speculative_tokens"),
        ('{"method":"ngram","num_speculative_tokens":2.5}', "num_speculative_tokens"),
        ('{"method":"ngram","num_speculative_tokens":2,"model":"x"}', "unknown keys"),
        ('{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":3,"prompt_lookup_max":2}', "exceed"),
        ('{"method":"draft_model","num_speculative_tokens":2,"model":5}', "path"),
    ],
)
def test_config_errors_name_the_problem(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_engine_args_carry_it_to_the_engine_config():
    from kvmesh.engine.args import EngineArgs
    from kvmesh.engine.models.loader import load_model

    cfg = load_model(None, load_weights=False).config
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    ec = EngineArgs(speculative_config=json.dumps(spec), device="cpu").create_engine_config(cfg, "x")
    assert ec.speculative == SpeculativeConfig("ngram", 3)
    assert EngineArgs(device="cpu").create_engine_config(cfg, "x").speculative is None
    assert EngineArgs.from_crd({"speculativeConfig": json.dumps(spec)}).speculative_config == json.dumps(spec)
    assert EngineArgs.from_crd({}).speculative_config is None


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(3, 1, 3)
    assert p.propose([7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]  # the most recent [1, 2, 3]
    assert p.propose([5, 6, 7, 8]) == []  # nothing recurs
    assert p.propose([1, 2, 1, 2], k=1) == [1]
    assert NgramProposer(4, 2, 2).propose([3, 1, 4, 1]) == []  # only 1-grams recur, 2 asked


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    V = 6
    logits = torch.full((4, V), -5.0)
    for i, t in enumerate([2, 3, 1, 5]):
        logits[i, t] = 5.0
    g = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0)
    assert [r.token_id for r in verify(logits, greedy, [2, 3, 1], None, None, g)[0]] == [2, 3, 1, 5]  # + bonus
    toks, kept = verify(logits, greedy, [2, 4, 1], None, None, g)
    assert [r.token_id for r in toks] == [2, 3] and kept == 1
    # a penalty sees the drafts before each position: 2 repeated is pushed below 0 at position 1
    logits2 = torch.zeros(2, V)
    logits2[:, 2] = 1.0
    pen = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    hist = (np.array([0], dtype=np.int64), np.zeros(0, dtype=np.int64))
    toks, kept = verify(logits2, pen, [2], None, hist, g)
    assert kept == 1 and toks[1].token_id != 2


def _chi2_crit(df: int, z: float = 3.09) -> float:
    """The chi-square critical value at p = 0.001 (Wilson-Hilferty): no scipy needed."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    keep = probs * n >= 5  # pool the rare cells
    exp = np.append(probs[keep] * n, probs[~keep].sum() * n)
    obs = np.append(counts[keep], counts[~keep].sum())
    ok = exp > 0
    return float(((obs[ok] - exp[ok]) ** 2 / exp[ok]).sum()), int(ok.sum()) - 1


@pytest.mark.parametrize("draft_kind", ["one_hot", "draft_q"])
def test_rejection_sampling_keeps_the_target_distribution(draft_kind):
    """Every emitted position is distributed as the target's filtered p: the first token over all
    draws, the second among the draws that kept the first draft (its p is conditioned on it)."""
    V, k, N = 8, 2, 6000
    g0 = torch.Generator().manual_seed(1234)
    raw = torch.randn(k + 1, V, generator=g0) * 1.5
    params = SamplingParams(temperature=0.9, top_k=6)
    q = torch.randn(k, V, generator=g0).softmax(-1) if draft_kind == "draft_q" else None
    gen = torch.Generator().manual_seed(99)
    from kvmesh.engine.runner.sampling_filter import filter_row

    p = [filter_row(raw[i], params).softmax(-1).numpy() for i in range(k + 1)]
    d0 = int(np.argsort(p[0])[-2])  # a likely first draft, not the likeliest: rejected often enough too
    if q is not None:
        q[0] = 0.5 * q[0] + 0.5 * torch.nn.functional.one_hot(torch.tensor(d0), V)
    first = np.zeros(V)
    second = np.zeros(V)
    for _ in range(N):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)] if q is not None else [d0, 5]
        toks, kept = verify(raw, params, drafts, q, None, gen)
        assert len(toks) == kept + 1
        first[toks[0].token_id] += 1
        if kept >= 1 and drafts[0] == d0:
            second[toks[1].token_id] += 1
    stat, df = _chi2(first, p[0])
    assert stat < _chi2_crit(df), (stat, df, first, p[0])
    stat, df = _chi2(second, p[1])
    assert stat < _chi2_crit(df), (stat, df, second, p[1])


def test_seeded_verification_is_reproducible():
    raw = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)
    a = [verify(raw, params, [1, 2], None, None, torch.Generator().manual_seed(7))[0] for _ in range(3)]
    assert all([r.token_id for r in x] == [r.token_id for r in a[0]] for x in a)


def test_plan_keeps_the_logits_of_every_verified_position():
    sp = SamplingParams()
    rows = [
        ScheduledRequest("a", [1, 2, 3, 4, 9, 9], 3, 3, sp, block_ids=[0], spec_token_ids=[9, 9]),  # 1 + 2 drafts
        ScheduledRequest("b", [5, 6, 7], 2, 1, sp, block_ids=[1]),  # plain decode
        ScheduledRequest("c", [1, 2, 3, 4, 5], 0, 3, sp, block_ids=[2]),  # prefill chunk: no logits
        ScheduledRequest("d", [1, 2, 3], 2, 1, sp, block_ids=[3]),
    ]
    p = plan_step(SchedulerOutput(scheduled=rows), 16)
    assert p.rows.tolist() == [0, 1, 3]
    assert p.logits_idx.tolist() == [0, 1, 2, 3, 7]


def test_metrics_export_the_spec_decode_counters():
    from prometheus_client.parser import text_string_to_metric_families

    from kvmesh.engine.core.messages import EngineStats
    from kvmesh.services.api.metrics import ServerMetrics

    m = ServerMetrics("smol")
    m.on_stats(
        EngineStats(spec_decode_num_drafts=2, spec_decode_num_draft_tokens=8, spec_decode_accepted_per_pos=[2, 1])
    )
    m.on_stats(
        EngineStats(
            spec_decode_num_drafts=3,
            spec_decode_num_draft_tokens=12,
            spec_decode_num_accepted_tokens=5,
            spec_decode_accepted_per_pos=[3, 2, 0, 0],
        )
    )
    text = m.render().decode()
    got = {
        (s.name, s.labels.get("position")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("vllm:spec_decode") and s.name.endswith("_total")
    }
    assert got[("vllm:spec_decode_num_drafts_total", None)] == 3
    assert got[("vllm:spec_decode_num_draft_tokens_total", None)] == 12
    assert got[("vllm:spec_decode_num_accepted_tokens_total", None)] == 5
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [got[(per_pos, str(i))] for i in range(4)] == [3, 2, 0, 0]
