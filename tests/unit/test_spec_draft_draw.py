"""A draft model's per-step draws (engine/spec/draft.py `DraftModel._draw`): greedy rows take the argmax
where the logits are, random rows draw on the host with their own generators in row order, as one row at
a time did: the same drafts and distributions, seeded or not, whatever rows are beside them."""

from __future__ import annotations

import pytest
import torch

from kvmesh import SamplingParams
from kvmesh.engine.core.sched_output import ScheduledRequest
from kvmesh.engine.runner.sampling_filter import filter_row
from kvmesh.engine.spec.draft import DraftModel

pytestmark = pytest.mark.unit


def test_draws_are_those_of_one_row_at_a_time():
    V = 11
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.8),
    ]
    rows = [ScheduledRequest(f"r{i}", [1, 2], 1, 1, p) for i, p in enumerate(params)]
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    logits[0, 4] = logits[0, 7] = logits[0].max() + 1  # a tie: the first maximum wins
    active = [0, 1, 3]  # row 2 has all its drafts already

    def gens():
        shared = torch.Generator().manual_seed(9)  # unseeded rows share one generator, in row order
        return [None, shared, None, shared]

    drafts: list[list[int]] = [[], [], [], []]
    qs: list[list[torch.Tensor]] = [[], [], [], []]
    DraftModel._draw(logits, active, rows, gens(), drafts, qs)
    want_d: list[list[int]] = [[], [], [], []]
    want_q: list[list[torch.Tensor]] = [[], [], [], []]
    g = gens()
    for n, i in enumerate(active):
        gen = g[i]
        if gen is None:
            want_d[i].append(int(logits[n].argmax()))
            continue
        q = filter_row(logits[n], params[i]).softmax(-1)
        want_d[i].append(int(torch.multinomial(q, 1, generator=gen)))
        want_q[i].append(q)
    assert drafts == want_d and drafts[0] == [4] and drafts[2] == []
    assert all(len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(qs, want_q))
