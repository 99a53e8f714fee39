"""The few series the planner reads from a worker's ``/metrics``, and what they mean over an interval."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvmesh.common import metric_names as mn
from kvmesh.common.prometheus import samples

GAUGES = {
    mn.NUM_REQUESTS_RUNNING: "running",
    mn.NUM_REQUESTS_WAITING: "waiting",
    mn.KV_CACHE_USAGE: "kv_usage",
    mn.PROMPT_TOKENS_PENDING: "pending_prompt_tokens",
    mn.KV_HELD_REQUESTS: "held",
}
COMPUTED = mn.total(mn.ENGINE_COMPUTED_TOKENS)
ITL = mn.bucket(mn.INTER_TOKEN_LATENCY)
TTFT = mn.bucket(mn.TIME_TO_FIRST_TOKEN)


@dataclass
class Sample:
    """One scrape of one pod: gauges summed over label sets, the computed-token counter and the
    cumulative histogram buckets (upper bound -> count)."""

    gauges: dict[str, float] = field(default_factory=dict)
    computed_tokens: float = 0.0
    itl: dict[float, float] = field(default_factory=dict)
    ttft: dict[float, float] = field(default_factory=dict)

    def gauge(self, key: str) -> float:
        return self.gauges.get(key, 0.0)


def parse(text: str) -> Sample:
    out = Sample()
    for name, labels, value in samples(text, (*GAUGES, COMPUTED, ITL, TTFT)):
        if name in GAUGES:
            key = GAUGES[name]
            out.gauges[key] = out.gauges.get(key, 0.0) + value
        elif name == COMPUTED:
            out.computed_tokens += value
        elif name in (ITL, TTFT) and "le" in labels:
            le = labels["le"]
            bound = math.inf if le == "+Inf" else float(le)
            hist = out.itl if name == ITL else out.ttft
            hist[bound] = hist.get(bound, 0.0) + value
    return out


def quantile(now: dict[float, float], before: dict[float, float] | None, q: float) -> float | None:
    """The q-quantile of what a cumulative histogram observed between two scrapes (linear inside
    the bucket, like PromQL's histogram_quantile); None when nothing was observed."""
    bounds = sorted(now)
    if not bounds:
        return None
    before = before or {}
    counts = [max(0.0, now[b] - before.get(b, 0.0)) for b in bounds]
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b, c in zip(bounds, counts, strict=True):
        if c >= rank:
            if math.isinf(b):
                return prev_bound
            if c == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (c - prev_count)
        prev_bound, prev_count = b, c
    return prev_bound
