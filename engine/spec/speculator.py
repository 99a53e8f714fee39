"""What the scheduler asks of speculative decoding: drafts per decoding request, and the counters.

`plan` runs while the scheduler walks its running requests, before their slots are allocated: the
n-gram proposer returns its drafts there (their number is the slots to allocate); a draft model
only reserves ``k`` (its tokens need those slots: its own KV lives in the same block ids) and
`fill` runs it over every speculating row once the step's blocks are known.

A structured output's drafts are masked by its grammar: they are cut at the first one the grammar
refuses (or after the one that completes it), the matcher walked over them and rolled back, and the
verification masks each of the ``1 + k`` positions with the grammar's state after the drafts before it
(`rejection.grammar_masked`). Rows that do not speculate (one token per step): prefill chunks, rows with
no room left (``max_tokens``, the context, the step's token budget) and grammars that failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.engine.spec.config import NGRAM, SpeculativeConfig
from kvmesh.engine.spec.ngram import NgramProposer
from kvmesh.engine.spec.rejection import grammar_prefix

if TYPE_CHECKING:
    from kvmesh.engine.core.request import Request
    from kvmesh.engine.core.sched_output import ScheduledRequest
    from kvmesh.engine.spec.draft import DraftModel


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.ngram = (
            NgramProposer(self.k, config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method == NGRAM
            else None
        )
        self.draft = draft
        assert (self.ngram is None) != (draft is None), "one proposer: n-gram lookup or a draft model"
        # vllm:spec_decode_* counters (services/api/metrics.py)
        self.num_drafts = 0  # rows verified with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        # where verifying rows were verified (engine/core/engine_core.py `_verify`): greedy rows with no
        # per-position host work on the device, the others on the host with their logits copied there
        self.num_rows_verified_on_device = 0
        self.num_rows_verified_on_host = 0

    @staticmethod
    def eligible(req: Request) -> bool:
        g = req.grammar
        return g is None or not g.terminated

    def plan(self, req: Request, room: int) -> list[int]:
        """Drafts for a decoding request (at most ``room``); a draft model's are placeholders that
        `fill` replaces. [] : it runs one token this step."""
        k = min(self.k, room)
        if k < 1 or not self.eligible(req):
            return []
        if self.ngram is not None:
            return self.ngram.propose(req.all_token_ids, k)
        return [-1] * k

    def fill(
        self,
        entries: list[ScheduledRequest],
        drafts: dict[str, list[int]],
        copies: list[tuple[int, int]],
        requests: dict[str, Request],
    ) -> None:
        """Put each speculating row's drafts in its entry (a copy of its tokens that ends with them);
        a draft model proposes them now, over the step's block tables (``copies``: the step's
        copy-on-write copies, which its own KV needs as well)."""
        rows = [s for s in entries if s.request_id in drafts]
        probs: list = [None] * len(rows)
        if self.draft is not None:
            toks, probs = self.draft.propose(rows, [len(drafts[s.request_id]) for s in rows], copies, requests)
            for s, t in zip(rows, toks):
                drafts[s.request_id] = t
        for s, q in zip(rows, probs):
            d = drafts[s.request_id]
            if s.grammar is not None:
                cut = grammar_prefix(s.grammar, d)
                s.num_tokens -= len(d) - cut  # the blocks taken for the rest go back after the step
                d = d[:cut]
                if q is not None:
                    q = q[:cut] if cut else None
                if not cut:
                    continue
            s.spec_token_ids = d
            s.all_token_ids = s.all_token_ids + d
            s.draft_probs = q

    def record(self, req: Request, entry: ScheduledRequest, accepted: int) -> None:
        """Count a verified row: its drafts and how many of them were kept (a prefix)."""
        if self.draft is not None:
            self.draft.verified(req, entry, accepted)
        self.num_drafts += 1
        self.num_draft_tokens += len(entry.spec_token_ids)
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
