"""Typed view of an InferenceService spec.

Why: render() should not poke at nested dicts with ad-hoc defaults. The API server applies the
CRD's `default:` values before the operator sees an object, but render() is also called by unit
tests on raw example files, so every field here falls back to the same default as the CRD
(tests/unit/test_operator_render.py checks the two agree).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh import __version__
from kvmesh.engine.args import EngineArgs

ROLES = ("prefill", "decode", "router")
WORKER_ROLES = ("prefill", "decode")  # the roles that run engines
# Exactly what `make images` builds (scripts/images.sh); the CRD's defaults name the same refs
# (tests/unit/test_operator_render.py checks both).
IMAGE_REPOSITORY = "ghcr.io/kvmesh"
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}/worker:{__version__}"
DEFAULT_ROUTER_IMAGE = f"{IMAGE_REPOSITORY}/router:{__version__}"
DEFAULT_REDIS_IMAGE = f"{IMAGE_REPOSITORY}/redis:{__version__}"


@dataclass(frozen=True)
class ModelSpec:
    source: str = "embedded"
    name: str | None = None
    path: str | None = None
    claim_name: str | None = None
    sub_path: str | None = None

    @staticmethod
    def parse(d: Mapping[str, Any]) -> ModelSpec:
        vol = d.get("volume") or {}
        return ModelSpec(
            source=d.get("source", "embedded"),
            name=d.get("name"),
            path=d.get("path"),
            claim_name=vol.get("claimName"),
            sub_path=vol.get("subPath"),
        )


@dataclass(frozen=True)
class ConnectorSpec:
    type: str = "nixl"
    redis_url: str | None = None
    redis_managed: bool = False
    redis_image: str = DEFAULT_REDIS_IMAGE
    redis_password_secret: str | None = None  # an external Redis's AUTH password: Secret name, key "password"
    redis_tls_ca_secret: str | None = None  # the CA of an external Redis's certificate: Secret name, key "ca.crt"

    @staticmethod
    def parse(d: Mapping[str, Any]) -> ConnectorSpec:
        r = d.get("redis") or {}
        return ConnectorSpec(
            type=d.get("type", "nixl"),
            redis_url=r.get("url"),
            redis_managed=bool(r.get("managed", False)),
            redis_image=r.get("image", DEFAULT_REDIS_IMAGE),
            redis_password_secret=r.get("passwordSecret") or None,
            redis_tls_ca_secret=r.get("tlsCaSecret") or None,
        )


@dataclass(frozen=True)
class RoleSpec:
    replicas: int = 1
    image: str | None = None
    gpus: int | None = None
    requests: Mapping[str, Any] = field(default_factory=dict)
    limits: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()

    @staticmethod
    def parse(d: Mapping[str, Any]) -> RoleSpec:
        res = d.get("resources") or {}
        return RoleSpec(
            replicas=int(d.get("replicas", 1)),
            image=d.get("image"),
            gpus=d.get("gpus"),
            requests=dict(res.get("requests") or {}),
            limits=dict(res.get("limits") or {}),
            node_selector=dict(d.get("nodeSelector") or {}),
            tolerations=tuple(dict(t) for t in d.get("tolerations") or ()),
        )


PROVIDERS = ("planner", "keda", "hpa")
PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class RoleScaling:
    """spec.autoscaling.{prefill,decode}: bounds, SLO target and stabilization windows of one role.

    Prefill has a TTFT target, decode an ITL target and a KV-cache usage target; the targets have
    no default (the CRD requires them when autoscaling is enabled), hence None here.
    """

    min_replicas: int = 1
    max_replicas: int = 4
    scale_up_stabilization_s: int = 0
    scale_down_stabilization_s: int = 300
    target_ttft_ms: int | None = None
    ttft_percentile: int = 90
    target_itl_ms: int | None = None
    itl_percentile: int = 90
    target_kv_usage: float | None = None


@dataclass(frozen=True)
class AutoscalingSpec:
    """spec.autoscaling. provider planner: the operator's own loop (operator/planner_loop.py) every
    interval_s; hpa: HorizontalPodAutoscalers on custom pod metrics (needs a metrics adapter);
    keda: KEDA ScaledObjects on the same signals."""

    enabled: bool = False
    provider: str = "planner"
    interval_s: int = 15
    # The planner's headroom and forecast (operator/planner.py says how they are used).
    target_utilization: float = 0.8
    forecast_window_s: int = 60
    scale_up_lead_s: int = 60
    prefill: RoleScaling = RoleScaling()
    decode: RoleScaling = RoleScaling(target_kv_usage=0.8)

    @staticmethod
    def parse(d: Mapping[str, Any]) -> AutoscalingSpec:
        p = d.get("prefill") or {}
        dc = d.get("decode") or {}

        def opt(v: Any, kind: type) -> Any:
            return None if v is None else kind(v)

        return AutoscalingSpec(
            enabled=bool(d.get("enabled", False)),
            provider=str(d.get("provider", "planner")),
            interval_s=int(d.get("intervalSeconds", 15)),
            target_utilization=float(d.get("targetUtilization", AutoscalingSpec.target_utilization)),
            forecast_window_s=int(d.get("forecastWindowSeconds", AutoscalingSpec.forecast_window_s)),
            scale_up_lead_s=int(d.get("scaleUpLeadSeconds", AutoscalingSpec.scale_up_lead_s)),
            prefill=RoleScaling(
                min_replicas=int(p.get("minReplicas", 1)),
                max_replicas=int(p.get("maxReplicas", 4)),
                scale_up_stabilization_s=int(p.get("scaleUpStabilizationSeconds", 0)),
                scale_down_stabilization_s=int(p.get("scaleDownStabilizationSeconds", 300)),
                target_ttft_ms=opt(p.get("targetTTFTMilliseconds"), int),
                ttft_percentile=int(p.get("ttftPercentile", 90)),
            ),
            decode=RoleScaling(
                min_replicas=int(dc.get("minReplicas", 1)),
                max_replicas=int(dc.get("maxReplicas", 4)),
                scale_up_stabilization_s=int(dc.get("scaleUpStabilizationSeconds", 0)),
                scale_down_stabilization_s=int(dc.get("scaleDownStabilizationSeconds", 300)),
                target_itl_ms=opt(dc.get("targetITLMilliseconds"), int),
                itl_percentile=int(dc.get("itlPercentile", 90)),
                target_kv_usage=float(dc.get("targetKVCacheUsage", 0.8)),
            ),
        )

    def role(self, name: str) -> RoleScaling:
        return {"prefill": self.prefill, "decode": self.decode}[name]

    @property
    def planner(self) -> bool:
        """The operator's planner owns the workers' replica counts."""
        return self.enabled and self.provider == "planner"


@dataclass(frozen=True)
class AuthSpec:
    """spec.auth: the user Secret (key keys.json) holding the tenant API keys the router accepts, and
    whether the router's /metrics (open to scrapers) names tenants (``metricsTenantLabels``; default:
    opaque labels)."""

    api_keys_secret: str | None = None
    metrics_tenant_labels: bool = False

    @staticmethod
    def parse(d: Mapping[str, Any]) -> AuthSpec:
        return AuthSpec(
            api_keys_secret=d.get("apiKeysSecret") or None,
            metrics_tenant_labels=bool(d.get("metricsTenantLabels", False)),
        )


@dataclass(frozen=True)
class TracingSpec:
    """spec.tracing: where every pod (router and workers) sends OpenTelemetry traces (an OTLP/HTTP
    endpoint; None: no traces) and the fraction of requests traced when the client sent no sampled
    ``traceparent`` (kvmesh/common/tracing.py reads both as the standard ``OTEL_*`` variables)."""

    endpoint: str | None = None
    sampling_ratio: float = 1.0

    @staticmethod
    def parse(d: Mapping[str, Any]) -> TracingSpec:
        return TracingSpec(endpoint=d.get("endpoint") or None, sampling_ratio=float(d.get("samplingRatio", 1.0)))


@dataclass(frozen=True)
class NetworkPolicySpec:
    """spec.networkPolicy: render the service's NetworkPolicies (on by default)."""

    enabled: bool = True

    @staticmethod
    def parse(d: Mapping[str, Any]) -> NetworkPolicySpec:
        return NetworkPolicySpec(enabled=bool(d.get("enabled", True)))


@dataclass(frozen=True)
class SimulateSpec:
    """spec.simulate: workers run `kvmesh serve --simulate` (real scheduler, cache, events, API and
    metrics; a latency model instead of the forward pass). For tests and load tests of routing and
    autoscaling, never for serving: the tokens are not a model's."""

    enabled: bool = False
    prefill_ms_per_token: float | None = None
    decode_base_ms: float | None = None
    decode_ms_per_sequence: float | None = None

    @staticmethod
    def parse(d: Mapping[str, Any]) -> SimulateSpec:
        def num(key: str) -> float | None:
            return None if d.get(key) is None else float(d[key])

        return SimulateSpec(
            enabled=bool(d.get("enabled", False)),
            prefill_ms_per_token=num("prefillMsPerToken"),
            decode_base_ms=num("decodeBaseMs"),
            decode_ms_per_sequence=num("decodeMsPerSequence"),
        )


@dataclass(frozen=True)
class LoRAAdapterSpec:
    """One entry of spec.loraAdapters: an adapter served under ``name``, its PEFT folder from exactly
    one source: ``path`` (a folder already in the worker pods, e.g. on the model's volume),
    ``volume`` (a PVC, ``subPath`` the folder inside it) or ``config_map`` (a ConfigMap whose keys are
    the folder's files). validate.py checks the exactly-one rule for specs that did not pass the CRD."""

    name: str
    path: str | None = None
    claim_name: str | None = None
    sub_path: str | None = None
    config_map: str | None = None

    @staticmethod
    def parse(d: Mapping[str, Any]) -> LoRAAdapterSpec:
        vol = d.get("volume")
        return LoRAAdapterSpec(
            name=str(d.get("name") or ""),
            path=d.get("path"),
            claim_name=vol.get("claimName") if vol is not None else None,
            sub_path=(vol or {}).get("subPath") or None,
            config_map=d.get("configMap"),
        )

    @property
    def sources(self) -> int:
        """How many sources the entry names (1 when valid)."""
        return sum(x is not None for x in (self.path, self.claim_name, self.config_map))


@dataclass(frozen=True)
class InferenceServiceSpec:
    image: str
    image_pull_policy: str
    model: ModelSpec
    engine: EngineArgs  # spec.engine: the settings the CRD exposes (engine/args.py); the rest stay CLI defaults
    connector: ConnectorSpec
    prefill: RoleSpec
    decode: RoleSpec
    router: RoleSpec
    autoscaling: AutoscalingSpec
    auth: AuthSpec = AuthSpec()
    network_policy: NetworkPolicySpec = NetworkPolicySpec()
    simulate: SimulateSpec = SimulateSpec()
    lora_adapters: tuple[LoRAAdapterSpec, ...] = ()
    tracing: TracingSpec = TracingSpec()

    @staticmethod
    def parse(spec: Mapping[str, Any]) -> InferenceServiceSpec:
        return InferenceServiceSpec(
            image=spec.get("image", DEFAULT_IMAGE),
            image_pull_policy=spec.get("imagePullPolicy", "IfNotPresent"),
            model=ModelSpec.parse(spec.get("model") or {}),
            engine=EngineArgs.from_crd(spec.get("engine") or {}),
            connector=ConnectorSpec.parse(spec.get("kvConnector") or {}),
            prefill=RoleSpec.parse(spec.get("prefill") or {}),
            decode=RoleSpec.parse(spec.get("decode") or {}),
            router=RoleSpec.parse(spec.get("router") or {}),
            autoscaling=AutoscalingSpec.parse(spec.get("autoscaling") or {}),
            auth=AuthSpec.parse(spec.get("auth") or {}),
            network_policy=NetworkPolicySpec.parse(spec.get("networkPolicy") or {}),
            simulate=SimulateSpec.parse(spec.get("simulate") or {}),
            lora_adapters=tuple(LoRAAdapterSpec.parse(a) for a in spec.get("loraAdapters") or ()),
            tracing=TracingSpec.parse(spec.get("tracing") or {}),
        )

    def role(self, name: str) -> RoleSpec:
        return {"prefill": self.prefill, "decode": self.decode, "router": self.router}[name]

    def gpus(self, name: str) -> int:
        """GPUs per pod of one role: its own ``gpus``, else one per tensor-parallel rank of the pod for a
        worker (``engine.tensorParallelSize`` over ``engine.tensorParallelNodes``) and none for the router.
        The CRD leaves ``gpus`` without a default because of this, so the rule lives here alone (render
        and validate read it)."""
        own = self.role(name).gpus
        if own is not None:
            return own
        return 0 if name == "router" else self.ranks_per_pod()

    def ranks_per_pod(self) -> int:
        """Tensor-parallel ranks in one worker pod: all of them, or a host's share when a replica spans
        ``engine.tensorParallelNodes`` pods (validate.py checks that it divides)."""
        return max(1, self.engine.tensor_parallel_size // max(1, self.engine.tp_nodes))


@dataclass(frozen=True)
class ObjectMeta:
    """The parts of the owner's metadata that render() needs (owner reference, names)."""

    name: str
    namespace: str
    uid: str
    generation: int = 0

    @staticmethod
    def parse(meta: Mapping[str, Any]) -> ObjectMeta:
        return ObjectMeta(
            name=meta["name"],
            namespace=meta.get("namespace") or "default",
            uid=meta.get("uid") or "",
            generation=int(meta.get("generation") or 0),
        )
