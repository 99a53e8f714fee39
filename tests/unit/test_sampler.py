"""The sampling filters and draws, run here on CPU tensors: the device path's batched filter
(`filter_batched`) and the CPU's per-row rule (`filter_row`) keep exactly what a plain sort-based
reference of the rules keeps, and the device draws follow that distribution."""

from __future__ import annotations

import pytest
import torch

from kvmesh import SamplingParams
from kvmesh.engine.runner.device_draw import draw_on_device
from kvmesh.engine.runner.sampling_filter import filter_batched, filter_row, top_p_threshold, top_p_threshold_sorted

pytestmark = pytest.mark.unit

V = 5003  # not a power of two


def _logits(kind: str, rows: int, gen: torch.Generator, V: int = V) -> torch.Tensor:
    """``peaked``: a trained LM's shape (max - logit ~ 1.8 ln(rank), as SmolLM2's; nucleus of a few
    to a few dozen tokens at T 0.8, top_p 0.95); ``flat``: N(0, 1), the nucleus is most of the row."""
    if kind == "flat":
        return torch.randn(rows, V, generator=gen)
    slope = torch.empty(rows, 1).uniform_(1.2, 2.4, generator=gen)
    x = -slope * torch.arange(1, V + 1).float().log() + 0.3 * torch.randn(rows, V, generator=gen)
    return x.gather(1, torch.rand(rows, V, generator=gen).argsort(-1))


CASES = {
    "top_p": dict(temperature=0.8, top_p=0.95),
    "small top_p": dict(temperature=1.0, top_p=0.3),
    "top_k": dict(temperature=0.8, top_k=40),
    "large top_k": dict(temperature=1.2, top_k=3000),
    "top_k top_p min_p": dict(temperature=0.7, top_k=200, top_p=0.9, min_p=0.02),
    "large top_k top_p": dict(temperature=0.9, top_k=2000, top_p=0.8),
    "top_p min_p": dict(temperature=1.0, top_p=0.99, min_p=0.001),
    "temperature": dict(temperature=0.6),
    "min_p": dict(temperature=1.0, min_p=0.05),
}


def _reference(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The rules as written, on one row, with a full sort: temperature; top-k keeps the tokens at or
    above the k-th largest logit; top-p keeps the smallest prefix of the descending order whose mass
    reaches top_p (a token stays iff the mass before it is <= top_p); min-p drops what is below
    min_p x the largest remaining probability. Returns the masked logits (dropped: -inf)."""
    x = row / max(p.temperature, 1e-5)
    if p.top_k and 0 < p.top_k < x.numel():
        x = x.masked_fill(x < x.sort(descending=True).values[p.top_k - 1], float("-inf"))
    if p.top_p < 1.0:
        sx, order = x.sort(descending=True)
        sp = sx.softmax(-1)
        x = x.clone()
        x[order[sp.cumsum(-1) - sp > p.top_p]] = float("-inf")
    if p.min_p > 0.0:
        pr = x.softmax(-1)
        x = x.masked_fill(pr < p.min_p * pr.max(), float("-inf"))
    return x


def _kept(probs: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """What the device draw can pick: at or above the row's threshold, and not masked out."""
    return (probs >= lo[:, None]) & (probs > 0)


def _check_rows(x: torch.Tensor, params: list[SamplingParams]) -> None:
    """The batched filter (probabilities and per-row thresholds, the draw's own inputs) and the
    per-row rule keep what the reference keeps, with its probabilities."""
    probs, lo = filter_batched(x, params)
    drawn_all = _kept(probs, lo)
    for i, p in enumerate(params):
        ref = _reference(x[i], p)
        kept = torch.isfinite(ref)
        row = filter_row(x[i], p)
        assert torch.equal(torch.isfinite(row), kept), (i, p, int(kept.sum()), int(torch.isfinite(row).sum()))
        assert (row.softmax(-1) - ref.softmax(-1)).abs().max() <= 1e-6
        drawn = drawn_all[i]
        assert torch.equal(drawn, kept), (i, p, int(kept.sum()), int(drawn.sum()))
        assert (probs[i] * drawn / (probs[i] * drawn).sum() - ref.softmax(-1)).abs().max() <= 1e-6


@pytest.mark.parametrize("kind", ["peaked", "flat"])
@pytest.mark.parametrize("case", list(CASES))
def test_batched_filter_matches_reference(case, kind):
    gen = torch.Generator().manual_seed(2 * list(CASES).index(case) + (kind == "flat"))
    _check_rows(_logits(kind, 6, gen), [SamplingParams(**CASES[case])] * 6)


def test_llama3_vocabulary():
    """128,256 tokens: the radix search takes two passes (16 + 15 bits) instead of three."""
    gen = torch.Generator().manual_seed(9)
    x = torch.cat([_logits("peaked", 2, gen, 128256), _logits("flat", 2, gen, 128256)])
    _check_rows(x, [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.5)] * 2)


def test_mixed_batch_matches_reference():
    """Every kind of row in one batch: per-row settings must not leak between rows."""
    gen = torch.Generator().manual_seed(7)
    kinds = ["peaked", "flat"] * len(CASES)
    params = [SamplingParams(**CASES[c]) for c in CASES for _ in range(2)]
    x = torch.cat([_logits(k, 1, gen) for k in kinds])
    _check_rows(x, params)


def test_top_p_keeps_nucleus_of_flat_rows():
    """Flat rows: the nucleus is most of the vocabulary (the random-weights model's case)."""
    x = _logits("flat", 4, torch.Generator().manual_seed(3))
    kept = _kept(*filter_batched(x, [SamplingParams(temperature=0.8, top_p=0.95)] * 4)).sum(-1)
    assert (kept > V // 2).all()


def _threshold_by_rule(p: torch.Tensor, top_p: float) -> float:
    """The smallest kept probability under 'keep a token iff the mass strictly above it is <= top_p'."""
    above = (p[None, :] * (p[None, :] > p[:, None])).sum(-1)
    return float(p[above <= top_p].min())


def test_top_p_threshold_exact_with_ties():
    """Tied probabilities (a few values, many tokens each): the radix search finds the rule's
    threshold exactly, and every token tied with it is kept."""
    gen = torch.Generator().manual_seed(11)
    for top_p in (0.1, 0.5, 0.9, 0.999):
        w = torch.randint(1, 6, (8, 300), generator=gen).float() ** 3  # 5 distinct values per row
        p = w / w.sum(-1, keepdim=True)
        t = top_p_threshold(p, torch.full((8,), top_p))
        for i in range(8):
            assert float(t[i]) == _threshold_by_rule(p[i], top_p)
    # exact binary fractions: a mass equal to top_p does not exceed it (the sort rule's ``>``); rows
    # in descending order, so the top-k candidates' version applies too
    p = torch.tensor([[0.4, 0.3, 0.3], [0.5, 0.25, 0.25], [0.5, 0.375, 0.125]])
    for fn in (top_p_threshold, top_p_threshold_sorted):
        assert fn(p, torch.tensor([0.5, 0.6, 0.5])).tolist() == pytest.approx([0.3, 0.25, 0.375])
        assert fn(p, torch.tensor([1.0, 0.1, 0.875])).tolist() == pytest.approx([0.0, 0.5, 0.125])


@pytest.mark.parametrize("top_k", [0, 350, 150])
def test_filter_keeps_ties_at_the_threshold(top_k):
    """Tied logits (6 values per row): with or without top-k (candidate threshold, or the radix
    search), the filter keeps exactly the tokens whose strictly-larger mass is <= top_p after
    top-k, every token tied with the last kept one included, also when top-k's own ties reach
    past its ``topk`` candidates (top_k 150: ~65 tokens per value)."""
    x = torch.randint(0, 6, (8, 400), generator=torch.Generator().manual_seed(5)).float()
    for top_p in (0.3, 0.6, 0.9):
        got = _kept(*filter_batched(x, [SamplingParams(top_p=top_p, top_k=top_k)] * 8))
        for i in range(8):
            xi = x[i] if not top_k else x[i].masked_fill(x[i] < torch.topk(x[i], top_k).values[-1], float("-inf"))
            p = xi.softmax(-1)
            assert torch.equal(got[i], p >= _threshold_by_rule(p, top_p))


def test_draws_follow_filtered_distribution():
    """20k exponential-race draws of a small peaked distribution (temperature, top-k, top-p,
    min-p), with greedy rows mixed in: frequencies within 0.02 of the filtered probabilities
    (the standard error is at most 0.0035); filtered-out tokens are never drawn."""
    torch.manual_seed(1234)
    logits = torch.tensor([4.0, 3.5, 3.0, 2.0, 1.0, 0.5, 0.0, -1.0, -3.0, -8.0])
    params = [SamplingParams(temperature=0.9, top_k=7, top_p=0.9, min_p=0.05), SamplingParams(temperature=0.0)]
    expected = _reference(logits, params[0]).softmax(-1)
    assert 0 < int((expected > 0).sum()) < 7  # top-p and min-p both cut something
    n = 20_000
    rows = [params[i % 2] for i in range(2 * n)]
    tok = draw_on_device(logits.expand(2 * n, -1), rows, list(range(0, 2 * n, 2)))
    assert (tok[1::2] == 0).all()
    freq = torch.bincount(tok[::2], minlength=len(logits)).float() / n
    assert (freq - expected).abs().max() < 0.02
    assert (freq[expected == 0] == 0).all()


def _penalized_reference(row: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int]) -> torch.Tensor:
    """Token by token, as the rules read: the logit bias, then repetition over prompt + output, then
    frequency and presence."""
    x = row.clone()
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return x


def test_penalties_match_the_rules():
    from kvmesh.engine.runner.logit_adjustment import adjust_logits

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 50, generator=gen) * 3
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(temperature=0.5),  # no penalty: row untouched
        SamplingParams(
            repetition_penalty=0.8, frequency_penalty=1.0, presence_penalty=2.0, logit_bias={49: 3.0, 0: -1.5}
        ),
        SamplingParams(logit_bias={4: -100, 10: 7.5}),
    ]  # bias only: no history needed
    hist = [([1, 2, 2, 40], [7, 7, 3]), ([5], [9, 9, 9, 11]), ([1], [2]), ([0, 49], [49, 49, 3]), None]
    got = adjust_logits(logits, params, hist)
    assert torch.equal(logits[2], got[2]) and not torch.equal(logits, got)  # input not modified in place
    for i in (0, 1, 3):
        torch.testing.assert_close(got[i], _penalized_reference(logits[i], params[i], *hist[i]))
    torch.testing.assert_close(got[4], _penalized_reference(logits[4], params[4], [], []))
    assert got[4][4] < logits[4][4] - 99 and adjust_logits(logits[4:], params[4:], None)[0][10] == got[4][10]


def test_penalties_change_the_greedy_token_and_keep_raw_logprobs():
    from kvmesh.engine.runner.sampler import Sampler

    row = torch.full((1, 10), -5.0)
    row[0, 4], row[0, 6] = 3.0, 2.5  # 4 is the argmax
    s = Sampler(0)
    plain = SamplingParams(temperature=0, logprobs=0)
    assert s.sample(row, [plain], [None])[0].token_id == 4
    pen = plain.with_(frequency_penalty=0.3)  # 4 generated twice: 3.0 - 0.6 = 2.4 < 2.5
    res = s.sample(row, [pen], [None], [([1, 2], [4, 4])])[0]
    assert res.token_id == 6
    assert res.logprob == pytest.approx(torch.log_softmax(row[0], -1)[6].item())  # raw distribution
    with pytest.raises(ValueError, match="histories"):
        s.sample(row, [pen], [None])
    # a logit bias alone needs no history: -100 on the argmax hands the greedy pick to the runner-up
    assert s.sample(row, [plain.with_(logit_bias={4: -100})], [None])[0].token_id == 6
    assert s.sample(row, [plain.with_(logit_bias={9: 100})], [None])[0].token_id == 9


def test_request_token_arrays_follow_the_lists():
    """The penalty histories the core hands the sampler: the prompt as an array, and the output
    extended incrementally; both must always equal the request's lists."""
    from kvmesh.engine.core.request import Request

    r = Request("r", [5, 6, 7], SamplingParams(presence_penalty=1.0), block_size=4, model_identity="m")
    assert r.prompt_array.tolist() == [5, 6, 7] and r.output_array().tolist() == []
    seen = []
    for step in range(40):  # grows past the first buffers, sometimes several tokens between calls
        for k in range(1 + step % 3):
            tok = 100 + step * 3 + k
            r.append_output_token(tok)
            seen.append(tok)
        if step % 4:
            assert r.output_array().tolist() == seen == r.output_token_ids
    assert r.output_array().tolist() == r.output_token_ids


def test_logit_adjustment_extended_by_drawn_tokens_equals_a_rebuild():
    """What a multi-step round does (build once, then `extend` with each step's tokens on the
    device) gives the logits the one-step path gets by rebuilding from the grown histories."""
    from kvmesh.engine.runner.logit_adjustment import LogitAdjustment, adjust_logits

    gen = torch.Generator().manual_seed(4)
    V = 40
    params = [
        SamplingParams(repetition_penalty=1.4, frequency_penalty=0.5, logit_bias={3: 2.0}),
        SamplingParams(),  # untouched row between adjusted ones
        SamplingParams(presence_penalty=1.2),  # no output yet: only `extend` gives it history
        SamplingParams(repetition_penalty=0.7),
    ]
    hist = [([1, 2], [5, 5]), None, ([7], []), ([0], [9])]
    a = LogitAdjustment.build(params, hist, V, torch.device("cpu"))
    grown = [(list(h[0]), list(h[1])) if h else None for h in hist]
    for _ in range(5):
        logits = torch.randn(4, V, generator=gen) * 3
        want = adjust_logits(logits, params, grown)
        torch.testing.assert_close(a.apply(logits), want)
        assert torch.equal(a.apply(logits)[1], logits[1])
        tok = want.argmax(-1)
        a.extend(tok)
        for i, h in enumerate(grown):
            if h:
                h[1].append(int(tok[i]))


def test_noise_stream_counts_draws():
    from kvmesh.engine.runner.sampler import NoiseStream

    s = NoiseStream(5)
    assert [s.take() for _ in range(3)] == [(5, 0), (5, 1), (5, 2)]
    assert NoiseStream(-1).take() == ((1 << 63) - 1, 0) and NoiseStream(1 << 64).take() == (0, 0)


def test_race_noise_is_exponential():
    """The counter-based noise (reference: what the kernels make) is Exp(1): mean, both tails
    (the series below 1/64 included: P(E < 1e-4) = 1e-4) and no correlation between a row's
    consecutive draws or between seeds. 6.4M values: the bounds are >= 4 standard errors."""
    from kvmesh.kernels import race_noise_reference

    seeds = torch.tensor([[s, n] for s in (1, 2, 3, 99) for n in range(16)], dtype=torch.int64)
    e = race_noise_reference(seeds, 100_000).double()
    assert (e > 0).all() and torch.isfinite(e).all()
    assert abs(float(e.mean()) - 1) < 0.002 and abs(float(e.var()) - 1) < 0.006
    for x in (1e-4, 0.01, 1.0, 5.0):
        frac = float((e < x).double().mean())
        expected = 1 - torch.exp(torch.tensor(-x, dtype=torch.float64)).item()
        assert abs(frac - expected) < 4 * (expected * (1 - expected) / e.numel()) ** 0.5 + 1e-9, (x, frac)
    c = torch.corrcoef(torch.stack([e[0], e[1], e[16]]))
    assert c[0, 1].abs() < 0.02 and c[0, 2].abs() < 0.02


def test_seeded_draws_do_not_depend_on_the_batch():
    """A seeded row draws from its seed and its draw count: the same token alone or beside other
    rows (also at another row index), a new token stream as the count advances."""
    from kvmesh.engine.runner.sampler import NoiseStream

    gen = torch.Generator().manual_seed(2)
    logits = _logits("flat", 3, gen, V=2000)
    p = SamplingParams(temperature=1.0, top_p=0.99, seed=7)
    s = NoiseStream(7)
    alone = [int(draw_on_device(logits[:1], [p], [0], generators=[s])[0]) for _ in range(20)]
    s = NoiseStream(7)
    mixed = [
        int(
            draw_on_device(
                logits[[1, 0, 2]],
                [SamplingParams(temperature=1.0), p, p.with_(seed=8)],
                [0, 1, 2],
                generators=[None, s, NoiseStream(8)],
            )[1]
        )
        for _ in range(20)
    ]
    assert alone == mixed and len(set(alone)) > 5
