"""The router's Prometheus metrics (``kvmesh:`` prefix), in a registry of its own so
tests can run several routers in one process.

Tenant names stay out of ``/metrics`` unless the operator opts in (``--metrics-tenant-labels``): the
endpoint is open to any scraper, and a tenant's name and traffic are its own. Without the opt-in a
tenant's ``tenant`` label is `tenant_label` of its name: stable (the same tenant has the same label
on every router and after every restart) and distinct per tenant, so per-tenant rates, alerts and
dashboards work unchanged, and an SRE who knows a name finds its series
(``printf %s NAME | sha256sum | cut -c1-8``); an aggregate would lose the one tenant that is being
refused. The registry itself keeps the names (tests and the process read them); only the rendering
maps them.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

# The failures the router retries on another pod (upstream.UpstreamError with gone=True, a pod's
# engine-unavailable 503 and its shedding 503), the `reason` label values of kvmesh:router_retries_total.
ENGINE_UNAVAILABLE = "EngineUnavailable"  # the pod answered 503 with services/errors.py's ENGINE_UNAVAILABLE_HEADER
OVERLOADED = "Overloaded"  # the pod shed the request: 503 with services/errors.py's OVERLOADED_HEADER
RETRY_REASONS = ("ConnectTimeout", "ConnectError", "RemoteProtocolError", "ReadError", ENGINE_UNAVAILABLE, OVERLOADED)

# why a request's pod was given up mid-answer (services/router/migration.py): reset or closed mid-body,
# a stream ended without [DONE], the pod's error event (its engine died), no byte within the read timeout
MIGRATION_REASONS = ("disconnect", "eof", "engine_error", "timeout")

TENANT = "tenant"  # the label that carries a tenant's name


def tenant_label(tenant: str) -> str:
    """A tenant's opaque label in /metrics: ``t-`` and the first 8 hex digits of its name's sha256."""
    return "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:8]


class _TenantsHidden:
    """A registry's view whose ``tenant`` label values are `tenant_label`s (what `generate_latest` reads)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator:
        for family in self._registry.collect():
            if any(TENANT in smp.labels for smp in family.samples):
                family = copy.copy(family)
                family.samples = [
                    smp._replace(labels={**smp.labels, TENANT: tenant_label(smp.labels[TENANT])})
                    if TENANT in smp.labels
                    else smp
                    for smp in family.samples
                ]
            yield family


_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOK = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvmesh:router_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.decisions = Counter(
            "kvmesh:router_routing_decisions",
            "routing decisions by pod, role and reason",
            ["pod", "role", "reason"],
            registry=r,
        )
        self.pd = Counter(
            "kvmesh:router_pd_decisions",
            "P/D path taken: decode_only (selective), "
            "prefill_decode, fallback_* (prefill failed, decode recomputed), or prefill_client_error (the "
            "prefill pod refused the request as the client's error: answered, not retried)",
            ["path"],
            registry=r,
        )
        self.prompt_tokens = Counter("kvmesh:router_prompt_tokens", "prompt tokens routed", registry=r)
        self.predicted_hit = Counter(
            "kvmesh:router_predicted_hit_tokens",
            "prompt tokens the index predicted cached on the chosen pod",
            registry=r,
        )
        self.reported_hit = Counter(
            "kvmesh:router_reported_cached_tokens",
            "cached tokens reported by pods in usage (same requests as drift)",
            registry=r,
        )
        self.drift = Histogram(
            "kvmesh:router_index_drift_tokens",
            "predicted minus reported cached tokens, absolute, per request",
            buckets=_TOK,
            registry=r,
        )
        # Two counters, not one signed sum: a Prometheus counter only goes up (a negative inc raises).
        self.over_predicted = Counter(
            "kvmesh:router_index_overpredicted_tokens",
            "predicted cached tokens the pod did not have (sum over requests)",
            registry=r,
        )
        self.under_predicted = Counter(
            "kvmesh:router_index_underpredicted_tokens",
            "cached tokens the pod had beyond the prediction (sum over requests)",
            registry=r,
        )
        self.index_blocks = Gauge(
            "kvmesh:router_index_blocks", "block entries in the global prefix index", ["model"], registry=r
        )
        self.upstream_latency = Histogram(
            "kvmesh:router_upstream_latency_seconds",
            "time to the upstream response headers (TTFB) by phase",
            ["phase"],
            buckets=_LAT,
            registry=r,
        )
        self.upstream_total = Histogram(
            "kvmesh:router_upstream_duration_seconds",
            "full upstream request duration by phase",
            ["phase"],
            buckets=_LAT,
            registry=r,
        )
        self.retries = Counter("kvmesh:router_retries", "requests retried on another pod", ["reason"], registry=r)
        self.shed_holds = Counter(
            "kvmesh:router_shed_holds",
            "times a request every pod shed was held for the soonest Retry-After and tried again (--shed-hold-s)",
            registry=r,
        )
        for reason in RETRY_REASONS:  # at 0 from the start: the dashboard's retry panel shows 0, not "no data"
            self.retries.labels(reason)
        self.migrations = Counter(
            "kvmesh:router_migrations",
            "requests moved to another pod after theirs failed mid-answer (a stream continues where it broke)",
            ["reason"],
            registry=r,
        )
        for reason in MIGRATION_REASONS:
            self.migrations.labels(reason)
        self.lora_loads = Counter(
            "kvmesh:router_lora_loads", "LoRA adapters the router loaded onto a pod (none had it)", ["pod"], registry=r
        )
        self.pod_healthy = Gauge(
            "kvmesh:router_pod_healthy", "1 if the pod passes health checks", ["pod", "role"], registry=r
        )
        self.pod_inflight = Gauge(
            "kvmesh:router_pod_inflight_requests", "requests in flight per pod", ["pod"], registry=r
        )
        self.pod_evict_pressure = Gauge(
            "kvmesh:router_pod_eviction_pressure_blocks",
            "blocks the pod reported evicted, exponentially decayed (scoring input)",
            ["pod"],
            registry=r,
        )
        self.kv_events = Counter("kvmesh:router_kv_events", "KV events applied", ["pod", "kind"], registry=r)
        self.kv_event_batches = Counter(
            "kvmesh:router_kv_event_batches", "KV-event batches received (live or replayed)", ["pod"], registry=r
        )
        self.kv_event_forms = Counter(
            "kvmesh:router_kv_event_batches_by_form",
            "KV-event batches decoded, by wire form: map (vLLM's named fields) or array (vLLM v0.10's positions)",
            ["pod", "form"],
            registry=r,
        )
        self.prefix_hash_mixed = Gauge(
            "kvmesh:router_prefix_hash_mixed",
            "1 while the pods' KV events show more than one block-hash scheme (kvmesh and vllm): prompts are "
            "hashed the kvmesh way and the other pods get no prefix hits until they agree",
            registry=r,
        )
        self.kv_events_connected = Gauge(
            "kvmesh:router_kv_events_connected",
            "1 while the pod's KV-event stream is connected (handshake done); 0: the pod is routed on predictions",
            ["pod"],
            registry=r,
        )
        self.kv_event_handshake_failures = Gauge(
            "kvmesh:router_kv_event_handshake_failures",
            "KV-event handshakes the pod refused (secret mismatch, one side without a secret)",
            ["pod"],
            registry=r,
        )
        self.kv_gaps = Gauge("kvmesh:router_kv_event_gaps", "sequence gaps seen (all pods)", registry=r)
        self.kv_replayed = Gauge("kvmesh:router_kv_event_replayed_batches", "batches recovered by replay", registry=r)
        self.kv_resyncs = Gauge("kvmesh:router_kv_event_resyncs", "pods cleared after an unrecoverable gap", registry=r)

        # admission control (admission.py); tenant labels are the configured tenants ("default" for plain keys)
        self.queue_depth = Gauge(
            "kvmesh:router_queue_depth", "requests waiting for an upstream slot, by priority", ["priority"], registry=r
        )
        self.rejected = Counter(
            "kvmesh:router_rejected_requests",
            "requests refused or dropped before routing, by reason (rpm, tpm, queue_full, queue_timeout, "
            "client_gone, no_pod) and tenant",
            ["reason", "tenant"],
            registry=r,
        )
        self.admitted = Counter(
            "kvmesh:router_admitted_requests", "requests admitted upstream, by tenant", ["tenant"], registry=r
        )
        self.active = Gauge("kvmesh:router_active_requests", "admitted requests not yet finished", registry=r)

    def per_pod(self) -> list[MetricWrapperBase]:
        """Every metric with a ``pod`` label."""
        return [
            m
            for m in vars(self).values()
            if isinstance(m, MetricWrapperBase) and "pod" in m._labelnames  # noqa: SLF001 (no public accessor)
        ]

    def forget_pod(self, pod: str) -> None:
        """Drop every series of a pod that left discovery (all label values under ``pod``)."""
        for m in self.per_pod():
            m.remove_by_labels({"pod": pod})

    def render(self, tenant_names: bool = False) -> bytes:
        """The text exposition; tenants by name only with ``tenant_names`` (module docstring)."""
        return generate_latest(self.registry if tenant_names else _TenantsHidden(self.registry))
