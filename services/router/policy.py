"""Pod state and the routing decision.

The router's view of a pod combines what it knows exactly (requests and
uncached prompt tokens it has in flight to the pod) with what it scrapes from
the pod's /metrics (running and waiting requests, KV usage; these also count
traffic from other routers but lag by up to one scrape interval).

Scoring (`score_pods`), per eligible pod::

    hit * hit_tokens / prompt_len
      - load * L / (mean L + 1)
      - tokens * inflight_tokens / (mean inflight_tokens + prompt_len)
      - kv * kv_usage

with ``L = max(router in-flight requests, scraped running + waiting)``.
Because the load terms are relative to the mean, a pod may run ahead of the
others by an amount proportional to how much of the prompt it would save, no
more. On top of that the balance guard removes pods whose load exceeds
``balance_rel * mean + balance_abs`` while others are below: a prefix that
every request shares (the Mooncake trace's block 0) saves little relative to
the prompt and so never pulls traffic, and a prefix that is most of the prompt
(a long shared system prompt) pulls until the guard trips, after which the
router's own routing history makes the second pod hold it too and load
decides between the two.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .config import PodSpec, ScoringWeights


@dataclass
class Pod:
    spec: PodSpec
    healthy: bool = True
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    inflight_requests: int = 0
    inflight_tokens: int = 0
    routed: int = 0
    failures: int = 0
    probe_timeouts: int = 0  # consecutive health-probe timeouts (a busy pod is slow, not dead)
    last_error: str = ""

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def load(self) -> float:
        return max(float(self.inflight_requests), self.running + self.waiting)


@dataclass(frozen=True)
class Decision:
    pod: Pod
    hit_blocks: int
    hit_tokens: int  # predicted cached tokens (capped like the engine: the last token is recomputed)
    reason: str  # kv_hit | load | round_robin | only


def predicted_cached_tokens(hit_blocks: int, prompt_len: int, block_size: int) -> int:
    """What the engine will report as cached: full blocks within ``prompt_len - 1`` tokens."""
    return min(hit_blocks, max(prompt_len - 1, 0) // block_size) * block_size


_rr = itertools.count()


def round_robin(pods: list[Pod]) -> Pod:
    return pods[next(_rr) % len(pods)]


def score_pods(pods: list[Pod], hits: dict[str, int], prompt_len: int, block_size: int,
               w: ScoringWeights) -> Decision:
    """Pick the best pod among ``pods`` (all healthy, non-empty)."""
    if len(pods) == 1:
        p = pods[0]
        hb = hits.get(p.url, 0)
        return Decision(p, hb, predicted_cached_tokens(hb, prompt_len, block_size), "only")
    n = len(pods)
    mean_load = sum(p.load for p in pods) / n
    mean_tok = sum(p.inflight_tokens for p in pods) / n
    limit = w.balance_rel * mean_load + w.balance_abs
    eligible = [p for p in pods if p.load <= limit] or pods
    plen = max(prompt_len, 1)
    best: tuple | None = None
    start = next(_rr)  # rotate ties so equal pods share work
    for i in range(len(eligible)):
        p = eligible[(start + i) % len(eligible)]
        hb = hits.get(p.url, 0)
        ht = predicted_cached_tokens(hb, prompt_len, block_size)
        s = (w.hit * ht / plen
             - w.load * p.load / (mean_load + 1.0)
             - w.tokens * p.inflight_tokens / (mean_tok + plen)
             - w.kv * p.kv_usage)
        key = (s, -p.load)
        if best is None or key > best[0]:
            best = (key, p, hb, ht)
    assert best is not None
    _, p, hb, ht = best
    top_hit = max((hits.get(q.url, 0) for q in pods), default=0)
    reason = "kv_hit" if hb > 0 and hb == top_hit else "load"
    return Decision(p, hb, ht, reason)


def least_load(pods: list[Pod]) -> Pod:
    start = next(_rr)
    order = [pods[(start + i) % len(pods)] for i in range(len(pods))]
    return min(order, key=lambda p: (p.load, p.inflight_tokens))
