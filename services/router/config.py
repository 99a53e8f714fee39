"""Frozen router configuration (one object, built from the CLI or by tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.common.fields import cli
from kvmesh.common.roles import ROLES, Role
from kvmesh.services.api.protocol import DEFAULT_MAX_REQUEST_TOKENS
from kvmesh.services.http_server import DEFAULT_HEADER_TIMEOUT

POLICIES = ("kv-aware", "round-robin", "least-load")
HOT_LIMIT_SCOPES = ("hot", "all", "off")
DISCOVERY = ("static", "k8s")


@dataclass(frozen=True)
class ScoringWeights:
    """How a candidate pod is scored (higher wins; `policy.score_pods`); each weight's flag and help
    are on its field.

    Why the defaults: the hit term leads and the load, token and KV terms are a fifth of it each, so
    a cached prefix keeps its requests until its pod is clearly busier than the others, and the
    balance guard (``balance_rel * mean + balance_abs``, stricter for hot prefixes) bounds how far
    a shared prefix piles up. ``share`` places new work where recent routings were fewest (a pod's
    future arrivals follow the conversations it holds), ``affinity`` keeps a short follow-up with
    its prefix and ``private_guard`` lets it past the guard: each raised the Mooncake replay's hit
    ratio or TTFT p90. ``evict`` and ``share_new`` are off: the first added at most a hundredth of
    hit ratio under KV pressure and raised the imbalance, the second evened the request count at
    the cost of TTFT p90. ``host_hit`` is the saved prefill less the copy back: a host block is
    worth most of a device block, and at 0.5 the load terms moved conversations away from the pod
    whose host tier held them. The A/Bs: docs/router.md, "Scoring"; current figures: BENCHMARKS.md.
    """

    hit: float = field(
        default=1.0,
        metadata=cli(
            "weight of the fraction of the prompt the pod holds, against a typical prompt's length", flag="--weight-hit"
        ),
    )
    load: float = field(
        default=0.2, metadata=cli("weight of the pod's request load relative to the mean", flag="--weight-load")
    )
    tokens: float = field(
        default=0.2,
        metadata=cli(
            "weight of the uncached prompt tokens in flight to the pod relative to the mean", flag="--weight-tokens"
        ),
    )
    kv: float = field(
        default=0.2,
        metadata=cli(
            "weight of the pod's KV usage (0..1), so a nearly full pod (which would evict) is avoided",
            flag="--weight-kv",
        ),
    )
    host_hit: float = field(
        default=0.85,
        metadata=cli(
            "value of a prefix block a pod holds in its host-memory KV tier (after its device's hit: loaded "
            "back, not recomputed) as a share of a device block's value, in every term that values a held "
            "prefix; 0.85: a host load costs ~0.15 of recomputing (0.0049 against 0.035 ms per token), and "
            "on the Mooncake replay with a host tier (make bench-router-tier) it gave the highest hit ratio "
            "of 0.5, 0.85 and 1.0",
            flag="--weight-host-hit",
        ),
    )
    disk_hit: float = field(
        default=0.25,
        metadata=cli(
            "value of a prefix block a pod would load from its local-disk KV tier (after its device and host "
            "hits) as a share of a device block's value: below --weight-host-hit, a disk read being slower "
            "than a host copy; 0.25 is a first value, to be measured",
            flag="--weight-disk-hit",
        ),
    )
    lora: float = field(
        default=0.2,
        metadata=cli(
            "bonus of a pod whose device already holds the request's LoRA adapter (it serves it without "
            "copying the adapter in, or evicting another), in the load term's units",
            flag="--weight-lora",
        ),
    )
    balance_abs: float = field(
        default=2.0,
        metadata=cli("a pod whose load exceeds balance_rel * mean + balance_abs is not eligible while another is"),
    )
    balance_rel: float = field(default=1.25, metadata=cli("see --balance-abs"))
    share: float = field(
        default=0.15, metadata=cli("weight of the pod's share of recently routed requests", flag="--weight-share")
    )
    share_halflife_s: float = field(
        default=120.0,
        metadata=cli("seconds over which a routed request's share decays by half", flag="--share-halflife"),
    )
    evict: float = field(
        default=0.0,
        metadata=cli(
            "weight of the pod's eviction pressure (from KV events) for the uncached part of a request",
            flag="--weight-evict",
        ),
    )
    evict_halflife_s: float = field(
        default=120.0,
        metadata=cli("seconds over which a reported eviction's weight decays by half", flag="--evict-halflife"),
    )
    share_new: float = field(
        default=0.0,
        metadata=cli("extra share weight, scaled by the part of the prompt no pod holds", flag="--weight-share-new"),
    )
    private_guard: float = field(
        default=2.0,
        metadata=cli(
            "a follow-up whose cached prefix no other in-flight request shares may go to its pod "
            "up to this multiple of the balance limit (1: off)"
        ),
    )
    affinity: float = field(
        default=0.2,
        metadata=cli("weight of the fraction of the request's own prompt that the pod holds", flag="--weight-affinity"),
    )
    hot_limit_scope: str = field(
        default="hot",
        metadata=cli(
            "which pods get the stricter balance limit max(rel * mean, mean + abs): those whose "
            "matched prefix other in-flight requests share (hot), every pod, or none",
            choices=list(HOT_LIMIT_SCOPES),
        ),
    )

    def __post_init__(self) -> None:
        if self.hot_limit_scope not in HOT_LIMIT_SCOPES:
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


def parse_pod_spec(text: str, role: Role, events_port: int | None = None, replay_port: int | None = None) -> PodSpec:
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
    """Fields with `cli` metadata are `kvmesh router` flags (services/router/entry.py); the pods and
    selectors come from flags of their own, the rest are fixed."""

    host: str = field(default="0.0.0.0", metadata=cli())
    port: int = field(default=8080, metadata=cli())
    model: str | None = field(
        default=None, metadata=cli("the pods' model (tokenizer + hash identity); default: embedded")
    )
    served_model_name: str | None = field(default=None, metadata=cli())  # name in /v1/models (None: the model's)
    block_size: int = field(default=16, metadata=cli("must equal the pods' --block-size"))
    kv_events_port: int | None = field(
        default=None, metadata=cli("pods publish KV events on tcp://HOST:PORT (for pods without events=)")
    )
    kv_replay_port: int | None = field(default=None, metadata=cli())
    kv_auth_key_file: str | None = field(
        default=None,
        metadata=cli(
            "file holding the KV-path secret the pods share: the KV-event streams are then read over CURVE "
            "(default: $KVMESH_KV_AUTH_KEY; neither: plain streams)"
        ),
    )
    policy: str = field(default="kv-aware", metadata=cli(choices=list(POLICIES)))
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    pd_min_uncached: int = field(
        default=256,
        metadata=cli("selective P/D: skip the prefill pod when decode would compute fewer tokens than this"),
    )
    pods: tuple[PodSpec, ...] = ()
    discovery: str = field(default="static", metadata=cli(choices=list(DISCOVERY)))
    k8s_namespace: str = field(default="default", metadata=cli(flag="--namespace"))
    k8s_selectors: tuple[tuple[Role, str], ...] = ()  # (role, label selector)
    k8s_port_name: str = field(
        default="http", metadata=cli("EndpointSlice port name of the pods' HTTP port", flag="--port-name")
    )
    health_interval: float = field(default=2.0, metadata=cli())  # seconds between health checks / scrapes
    health_timeouts_down: int = 3  # consecutive probe timeouts before a pod that still accepts connections is out
    connect_timeout: float = field(default=2.0, metadata=cli())
    read_timeout: float = field(default=600.0, metadata=cli())  # max gap between bytes from an upstream
    prefill_timeout: float = 300.0
    max_retries: int = field(default=2, metadata=cli())  # other pods tried after a connect failure
    shed_hold_s: float = field(
        default=10.0,
        metadata=cli(
            "seconds the router may hold a request every decode-capable pod shed (503 with Retry-After), "
            "trying again after the soonest Retry-After, before it answers 503 itself (0: answer at once)"
        ),
    )
    # requests (streams included) moved to another pod after theirs failed mid-answer (migration.py)
    migration_limit: int = field(
        default=3, metadata=cli("migrations per request after its pod failed mid-answer (0: none)")
    )
    lora_modules: tuple[str, ...] = field(
        default=(),
        metadata=cli(
            "NAME=PATH: a LoRA adapter folder on the pods' file system, loaded onto a chosen pod when a request "
            "names the adapter and no pod has it (repeatable)",
            action="append",
        ),
    )
    pending_ttl: float = 30.0  # predicted index entries for event-publishing pods
    # Predicted blocks kept per pod without events (~180 bytes each): about a large pod's KV cache
    # (64 Ki blocks of 16 tokens = 1 Mi tokens); the pod itself cannot hold more, so more is only memory.
    approx_capacity: int = field(
        default=1 << 16, metadata=cli("predicted blocks kept per pod that publishes no KV events (an LRU)")
    )
    log_level: str = field(default="warning", metadata=cli())
    # ---- keys and admission (docs/router.md, "Keys, tenants and limits") ----
    api_keys: tuple[str, ...] = field(
        default=(),
        metadata=cli(
            'accept this API key (tenant "default"; repeatable; default: $KVMESH_API_KEY, comma-separated)',
            flag="--api-key",
            action="append",
        ),
    )
    api_keys_file: str | None = field(
        default=None,
        metadata=cli(
            "JSON list of {key, tenant, priority, rpm, tpm}, re-read when it changes (default: $KVMESH_API_KEYS_FILE)"
        ),
    )
    upstream_api_key_file: str | None = field(
        default=None,
        metadata=cli(
            "file holding the key the router sends to its pods, re-read when it changes "
            "(default: $KVMESH_UPSTREAM_API_KEY)"
        ),
    )
    admin_key: str | None = field(
        default=None,
        repr=False,  # a secret: never in a logged config
        metadata=cli(
            "the admin credential, distinct from clients' keys: /pods and the x-kvmesh-pod header take it "
            "(default: $KVMESH_ADMIN_KEY; none while keys are configured: /pods is refused)"
        ),
    )
    admin_key_file: str | None = field(
        default=None, metadata=cli("file holding the admin key, re-read when it changes (instead of --admin-key)")
    )
    metrics_tenant_labels: bool = field(
        default=False,
        metadata=cli(
            "name tenants in /metrics (open to any scraper); default: each tenant's label is t- and the "
            "first 8 hex digits of the sha256 of its name",
            action="store_true",
        ),
    )
    max_concurrent_requests: int = field(
        default=0,
        metadata=cli("requests sent upstream at once; more wait in the admission queue (0: no limit)"),
    )
    queue_size: int = field(default=1024, metadata=cli("requests that may wait for a slot; more get 429"))
    queue_timeout: float = field(
        default=60.0, metadata=cli("seconds a request may wait for a slot before it gets 429 (0: no limit)")
    )
    # Shedding (admission.py, docs/router.md "Overload"): on by default.
    max_queue_wait_s: float = field(
        default=30.0,
        metadata=cli(
            "bound on a request's estimated wait in the admission queue (queue ahead / measured finish "
            "rate); past it 429 when the tenant's own queued requests cause it, else 503, each with "
            "Retry-After from the queue (0: only --queue-size bounds it)"
        ),
    )
    max_request_tokens: int = field(
        default=DEFAULT_MAX_REQUEST_TOKENS,
        metadata=cli(
            "tokens one request may ask to generate over all its sequences (prompts x n x max_tokens; an "
            "unset max_tokens counts as the context left); more is a 400. Never below the context length "
            "(0: no limit); the pods' --max-request-tokens has the same default"
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=cli(
            "the pods' context length, for the budget of a request without max_tokens (the context left); "
            "default: the model's, what the pods use unless given --max-model-len"
        ),
    )
    max_body_bytes: int = field(default=8 << 20, metadata=cli("larger request bodies get 413"))
    body_timeout: float = field(
        default=30.0, metadata=cli("seconds for a request body to arrive in full; a slower client gets 408")
    )
    header_timeout: float = field(
        default=DEFAULT_HEADER_TIMEOUT,
        metadata=cli(
            "seconds for a request's headers to arrive; a slower client gets 408, an idle connection is closed"
        ),
    )
    # uvicorn answers 500 for any request still unanswered after it.
    shutdown_timeout: float = field(
        default=30.0,
        metadata=cli(
            "on SIGTERM, seconds to let requests in flight finish before exiting (keep it below the pod's grace period)"
        ),
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.discovery not in DISCOVERY:
            raise ValueError("discovery must be static or k8s")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.shed_hold_s < 0:
            raise ValueError("shed_hold_s must be >= 0")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.migration_limit < 0:
            raise ValueError("migration_limit must be >= 0")
        if self.max_concurrent_requests < 0 or self.queue_size < 0 or self.queue_timeout < 0:
            raise ValueError("max_concurrent_requests, queue_size and queue_timeout must be >= 0")
        if self.max_queue_wait_s < 0 or self.max_request_tokens < 0:
            raise ValueError("max_queue_wait_s and max_request_tokens must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.approx_capacity < 1:
            raise ValueError("approx_capacity must be >= 1")
        if self.max_body_bytes < 1024 or self.body_timeout <= 0 or self.header_timeout <= 0:
            raise ValueError("max_body_bytes must be >= 1024, body_timeout and header_timeout > 0")


def lora_paths(modules: tuple[str, ...]) -> dict[str, str]:
    """``NAME=PATH`` entries (``--lora-modules``) as ``{name: path}``; a malformed one is an error."""
    out = {}
    for m in modules:
        name, sep, path = m.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {m!r}")
        out[name] = path
    return out
