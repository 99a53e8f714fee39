"""What a prefill pod exports beyond every pod's metrics: the series the planner scales prefill on.

Every role exports them (a decode pod's stay at 0), so one dashboard and one scrape serve all pods;
they are declared here because they describe prefill work: the prompt backlog and the blocks held
for decode pods. services/api/metrics.py sets them from the engine's stats snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from kvmesh.common import metric_names as mn


@dataclass(frozen=True)
class PrefillGauges:
    held_requests: Gauge
    prompt_tokens_pending: Gauge

    @classmethod
    def register(cls, registry: CollectorRegistry, labels: list[str]) -> PrefillGauges:
        return cls(
            held_requests=Gauge(
                mn.KV_HELD_REQUESTS,
                "Finished requests whose KV blocks are held for a remote reader "
                "(prefill role, until pulled or the lease expires).",
                labels,
                registry=registry,
            ),
            prompt_tokens_pending=Gauge(
                mn.PROMPT_TOKENS_PENDING,
                "Prompt tokens of waiting and running requests not computed yet (prefix-cache hits and KV "
                "loaded by a connector excluded once looked up): the prefill backlog the planner scales on.",
                labels,
                registry=registry,
            ),
        )
