"""Frozen router configuration (one object, built from the CLI or by tests)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.engine.config import ROLES, Role

POLICIES = ("kv-aware", "round-robin", "least-load")


@dataclass(frozen=True)
class ScoringWeights:
    """How a candidate pod is scored (higher wins); see `policy.score_pods`.

    ``hit``: weight of the fraction of the prompt the pod already holds.
    ``load``: weight of the pod's request load relative to the mean load.
    ``tokens``: weight of the uncached prompt tokens in flight to the pod relative to the mean.
    ``kv``: weight of the pod's KV usage (0..1), so a nearly full pod (which would evict) is avoided.
    ``balance_abs`` / ``balance_rel``: a pod whose load exceeds ``balance_rel * mean + balance_abs``
    is not eligible while another pod is; this bounds how far a hot prefix can pile up. For a pod
    whose matched prefix is hot (shared by two or more of its in-flight requests) the limit is
    ``max(balance_rel * mean, mean + balance_abs)`` (`policy.hot_limit`); ``hot_limit_scope``
    "all" gives every pod that limit and "off" none (the A/Bs in BENCHMARKS.md that chose "hot").
    ``share``: weight of the pod's share of recently routed requests relative to the mean (requests
    decay with ``share_halflife_s``). In-flight load only sees the present; with prefix affinity a
    pod's future arrivals follow the conversations it already holds, so placing new work where
    recent routings were fewest keeps the per-pod request count even without moving warm prefixes.
    ``evict``: weight of the pod's eviction pressure (blocks it reported removed, decayed with
    ``evict_halflife_s``) relative to the mean, applied to the part of the request no pod holds:
    new prefixes go where they will not push out conversations that are about to return, while a
    cached prefix is not moved by it. Zero while no pod evicts (a cache with room). Off by default:
    on the Mooncake replay under KV pressure it gained at most ~0.01 of hit ratio and raised the
    request imbalance (docs/router.md).
    ``private_guard``: a follow-up whose cached prefix (at least half its prompt) no other
    in-flight request on the pod shares keeps that pod eligible up to this multiple of the balance
    limit; 1 turns the exemption off. Hot shared prefixes (many concurrent requests) never get it.
    ``affinity``: weight of the fraction of *this* prompt the pod holds. The hit term measures a hit
    against a typical prompt, so a short follow-up (80 of its 95 tokens cached) is worth little there
    and one extra request in flight sends it elsewhere, recomputing most of it; this term keeps such
    follow-ups with their prefix when the pods are otherwise close.
    ``share_new``: extra share weight, scaled by the part of the prompt no pod holds: new
    conversations are placed by recent routings (pods holding many conversations, which bring their
    follow-ups, get fewer new ones) without pulling follow-ups off their prefix. Off by default: on
    the Mooncake replay 0.3 evened the request count (imbalance 1.28 vs 1.37 over 6 rounds) at the
    cost of TTFT p90 (1.27 vs 1.15 s), since new conversations then go by count, not by queue.
    Defaults of the three: docs/router.md, "Scoring" (6 interleaved rounds each, 2026-11-30).
    """

    hit: float = 1.0
    load: float = 0.2
    tokens: float = 0.2
    kv: float = 0.2
    balance_abs: float = 2.0
    balance_rel: float = 1.25
    share: float = 0.15
    share_halflife_s: float = 120.0
    evict: float = 0.0
    evict_halflife_s: float = 120.0
    share_new: float = 0.0
    private_guard: float = 2.0
    affinity: float = 0.2
    hot_limit_scope: str = "hot"  # hot | all | off

    def __post_init__(self) -> None:
        if self.hot_limit_scope not in ("hot", "all", "off"):
            raise ValueError(f"hot_limit_scope must be hot|all|off, got {self.hot_limit_scope!r}")


@dataclass(frozen=True)
class PodSpec:
    url: str  # http://host:port
    role: Role = "both"  # the engine's roles; `kvmesh router --worker` gives "both"
    events: str | None = None  # ZMQ PUB endpoint of the pod's KV events (None: approximate mode)
    replay: str | None = None  # ZMQ ROUTER replay endpoint

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"pod role must be one of {ROLES}, got {self.role!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"pod url must start with http:// or https://, got {self.url!r}")


def parse_pod_spec(text: str, role: str, events_port: int | None = None,
                   replay_port: int | None = None) -> PodSpec:
    """``URL[,events=tcp://...][,replay=tcp://...]``; without ``events=``, ``--kv-events-port`` gives tcp://HOST:PORT."""
    parts = text.split(",")
    url = parts[0].rstrip("/")
    opts = {}
    for p in parts[1:]:
        if "=" not in p:
            raise ValueError(f"bad pod option {p!r} in {text!r} (want key=value)")
        k, v = p.split("=", 1)
        if k not in ("events", "replay"):
            raise ValueError(f"unknown pod option {k!r} in {text!r}")
        opts[k] = v
    host = url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0]
    events = opts.get("events") or (f"tcp://{host}:{events_port}" if events_port else None)
    replay = opts.get("replay") or (f"tcp://{host}:{replay_port}" if replay_port else None)
    return PodSpec(url, role, events, replay)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8080
    model: str | None = None  # engine model path (tokenizer + identity); None: the embedded model
    served_model_name: str | None = None  # name in /v1/models (default: the model's name)
    block_size: int = 16  # must equal the pods' --block-size
    policy: str = "kv-aware"
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    pd_min_uncached: int = 256  # selective P/D: below this many uncached tokens on decode, skip prefill
    pods: tuple[PodSpec, ...] = ()
    discovery: str = "static"  # static | k8s
    k8s_namespace: str = "default"
    k8s_selectors: tuple[tuple[str, str], ...] = ()  # (role, label selector)
    k8s_port_name: str = "http"
    kv_events_port: int | None = None  # for discovered pods
    kv_replay_port: int | None = None
    health_interval: float = 2.0  # seconds between health checks / metrics scrapes
    health_timeouts_down: int = 3  # consecutive probe timeouts before a pod that still accepts connections is out
    connect_timeout: float = 2.0
    read_timeout: float = 600.0  # max gap between bytes from an upstream
    prefill_timeout: float = 300.0
    max_retries: int = 2  # other pods tried after a connect failure
    pending_ttl: float = 30.0  # predicted index entries for event-publishing pods
    approx_capacity: int = 1 << 20  # predicted blocks kept per pod without events
    log_level: str = "warning"
    # On SIGTERM: stop accepting, then let requests in flight (a prefill + decode round trip, a long
    # stream) finish for up to this long; uvicorn answers 500 for any still unanswered after it.
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.discovery not in ("static", "k8s"):
            raise ValueError("discovery must be static or k8s")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
