"""Greedy verification on the device (engine/spec/rejection.py `verify_greedy_rows`,
`verify_greedy_device`): the same tokens and kept counts as the host's `verify`, row by row, on random
logits full of ties, for every kept length 0..k, rows of fewer drafts padded beside rows of more; a
logit bias and logprobs as the host gives them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh import SamplingParams
from kvmesh.engine.spec.rejection import (
    SENTINEL,
    verified_on_device,
    verify,
    verify_greedy_device,
    verify_greedy_rows,
)

pytestmark = pytest.mark.unit

V = 7
GREEDY = SamplingParams(temperature=0.0)


def _rows(rng: np.random.Generator, ks: list[int], kept: list[int]) -> tuple[torch.Tensor, list[int], list[list[int]]]:
    """Logits for rows of ``1 + ks[r]`` positions (small integers: many tied maxima), after two rows
    of no verifying row's (a step's plain rows), and drafts that equal the first argmax for
    ``kept[r]`` positions, then differ from it (a tied maximum that is not the first one, where there
    is such)."""
    extra = 2
    widths = [k + 1 for k in ks]
    logits = torch.from_numpy(rng.integers(0, 3, size=(extra + sum(widths), V)).astype(np.float32))
    starts = list(extra + np.cumsum([0] + widths[:-1]))
    drafts = []
    for s, k, a in zip(starts, ks, kept):
        d = []
        for i in range(k):
            row = logits[s + i]
            first = int(row.argmax())
            if i < a:
                d.append(first)
            elif i == a:
                tied = [t for t in range(V) if row[t] == row.max() and t != first]
                d.append(tied[0] if tied else (first + 1) % V)
            else:
                d.append(int(rng.integers(V)))
        drafts.append(d)
    return logits, [int(s) for s in starts], drafts


@pytest.mark.parametrize("seed", range(6))
def test_device_rows_are_the_hosts_for_every_kept_length(seed):
    rng = np.random.default_rng(seed)
    K = 4
    ks = [k for k in range(1, K + 1) for _ in range(k + 1)]  # every row length, each kept length 0..k
    kept = [a for k in range(1, K + 1) for a in range(k + 1)]
    logits, starts, drafts = _rows(rng, ks, kept)
    got = verify_greedy_rows(logits, starts, [GREEDY] * len(ks), drafts)
    g = torch.Generator().manual_seed(0)
    for s, d, a, (toks, n) in zip(starts, drafts, kept, got):
        want, m = verify(logits[s : s + len(d) + 1], GREEDY, d, None, None, g)
        assert n == m == a
        assert [r.token_id for r in toks] == [r.token_id for r in want]


def test_the_device_function_has_fixed_shapes_and_stops_at_the_padding():
    logits = torch.zeros(3, V)
    logits[0, 2] = logits[1, 4] = logits[2, 5] = 1.0
    # row 0: drafts [2, 4] (both kept, bonus 5); row 1: one draft, 2 (kept, then 4), padded: its index
    # repeats its last position and its padded draft never matches
    index = torch.tensor([[0, 1, 2], [0, 1, 1]])
    drafts = torch.tensor([[2, 4], [2, SENTINEL]])
    out = verify_greedy_device(logits, index, drafts)
    assert out.shape == (2, 4) and out.dtype == torch.int64
    assert out.tolist() == [[2, 4, 5, 2], [2, 4, 4, 1]]
    # a first draft that differs keeps none, whatever follows it
    assert verify_greedy_device(logits, index, torch.tensor([[3, 4], [SENTINEL, SENTINEL]]))[:, -1].tolist() == [0, 0]


def test_logit_bias_and_logprobs_are_the_hosts():
    rng = np.random.default_rng(7)
    ks, kept = [3, 2, 3, 1], [3, 0, 1, 1]
    logits, starts, drafts = _rows(rng, ks, kept)
    logits = logits + torch.from_numpy(rng.standard_normal(logits.shape).astype(np.float32)) * 0.01
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 5.0}, logprobs=2),
        SamplingParams(temperature=0.0, logprobs=0),
        GREEDY,
        SamplingParams(temperature=0.0, logit_bias={1: -100.0, 6: 0.5}),
    ]
    assert all(verified_on_device(p, None) for p in params)
    got = verify_greedy_rows(logits, starts, params, drafts)
    g = torch.Generator().manual_seed(0)
    for s, d, p, (toks, n) in zip(starts, drafts, params, got):
        want, m = verify(logits[s : s + len(d) + 1], p, d, None, None, g)
        assert n == m
        assert [r.token_id for r in toks] == [r.token_id for r in want]
        for a, b in zip(toks, want):
            assert (a.logprob is None) == (b.logprob is None)
            if b.logprob is not None:
                assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
                assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def test_rows_with_host_work_per_position_keep_the_host_path():
    assert verified_on_device(GREEDY, None)
    assert not verified_on_device(SamplingParams(temperature=0.7), None)  # rejection sampling
    assert not verified_on_device(SamplingParams(temperature=0.0, frequency_penalty=0.5), None)
    assert not verified_on_device(SamplingParams(temperature=0.0, repetition_penalty=1.1), None)
    assert not verified_on_device(GREEDY, object())  # a structured output's grammar
