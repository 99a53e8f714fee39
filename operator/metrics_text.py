"""The few series the planner reads from a worker's ``/metrics``, and what they mean over an interval.

Why not prometheus_client's parser: the operator image carries only kopf, kubernetes and PyYAML;
the planner needs gauges, one counter and two histograms' buckets, which a line scan reads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "kvmesh:prompt_tokens_pending": "pending_prompt_tokens",
    "kvmesh:kv_held_requests": "held",
}
COMPUTED = "kvmesh:engine_computed_tokens_total"
ITL = "vllm:inter_token_latency_seconds_bucket"
TTFT = "vllm:time_to_first_token_seconds_bucket"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


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
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, close = line[:brace], line.rfind("}")
            labels, rest = line[brace + 1 : close], line[close + 1 :]
        else:
            name, labels, rest = line[:space], "", line[space:]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if name in GAUGES:
            key = GAUGES[name]
            out.gauges[key] = out.gauges.get(key, 0.0) + value
        elif name == COMPUTED:
            out.computed_tokens += value
        elif name in (ITL, TTFT):
            le = dict(_LABEL.findall(labels)).get("le")
            if le is None:
                continue
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
