"""Semantic checks that the CRD schema and its CEL rules cannot express (or that we keep out of
CEL on purpose because they depend on the engine's rules, not the API's).

A spec that fails here was accepted by the API server, so the operator cannot reject it; it
reports `Degraded=True, reason=InvalidSpec` and renders nothing, leaving existing children as
they were (a typo must not tear down a serving deployment).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from .spec import PROVIDERS, InferenceServiceSpec

# spec.loraAdapters[].name: a model name clients send, and a DNS label (lower case, digits, '-', '.', '_'
# inside); the CRD's pattern says the same.
LORA_NAME = re.compile(r"^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$")
LORA_NAME_MAX = 63
# ConfigMap and PVC names (DNS subdomains), as the CRD's patterns
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def problems(spec: InferenceServiceSpec, name: str | None = None) -> list[str]:
    """Return human-readable problems; an empty list means the spec can be rendered. ``name``: the
    object's name (the served model name when ``model.name`` is unset), for the adapters' names."""
    out: list[str] = []
    out += lora_problems(spec, name)
    e = spec.engine
    if e.max_num_batched_tokens < e.max_num_seqs:
        out.append(
            f"engine.maxNumBatchedTokens ({e.max_num_batched_tokens}) must be >= "
            f"engine.maxNumSeqs ({e.max_num_seqs}): every running sequence needs a token per step"
        )
    if e.max_num_batched_tokens % e.block_size:
        out.append(
            f"engine.maxNumBatchedTokens ({e.max_num_batched_tokens}) must be a multiple of "
            f"engine.blockSize ({e.block_size})"
        )
    if e.kv_offload_disk_gb > 0 and e.kv_offload_gb <= 0:
        out.append(
            f"engine.kvOffloadDiskGb ({e.kv_offload_disk_gb}) needs engine.kvOffloadGb > 0: the disk KV tier "
            "holds what the host-memory tier evicts"
        )
    tp, nodes = e.tensor_parallel_size, e.tp_nodes
    if tp % nodes:
        out.append(
            f"engine.tensorParallelNodes ({nodes}) must divide engine.tensorParallelSize ({tp}): every pod of "
            "a replica runs the same number of ranks"
        )
    per_pod = spec.ranks_per_pod()
    for role in ("prefill", "decode"):
        gpus = spec.gpus(role)
        if gpus and gpus != per_pod:  # the CRD's CEL rule says the same; repeated for specs rendered without it
            want = f"engine.tensorParallelSize ({tp})"
            if nodes > 1:
                want = f"{want} / engine.tensorParallelNodes ({nodes}) = {per_pod}"
            out.append(
                f"{role}.gpus ({gpus}) must equal {want}: one rank per GPU "
                f"(leave {role}.gpus unset to take it, or 0 for CPU ranks)"
            )
    url = spec.connector.redis_url
    c = spec.connector
    if url is None and (c.redis_password_secret or c.redis_tls_ca_secret):
        out.append(
            "kvConnector.redis.passwordSecret and tlsCaSecret go with url (a managed Redis has its own password)"
        )
    if spec.connector.type == "redis" and url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            out.append(f"kvConnector.redis.url {url!r} is not a redis:// or rediss:// URL with a host")
    a = spec.autoscaling
    if a.enabled:
        for role in ("prefill", "decode"):
            if spec.role(role).replicas == 0:
                out.append(f"{role}.replicas is 0 but autoscaling is enabled for it")
            s = a.role(role)
            if s.min_replicas > s.max_replicas:
                out.append(
                    f"autoscaling.{role}.minReplicas ({s.min_replicas}) must be <= maxReplicas ({s.max_replicas})"
                )
        # The CRD's CEL rules say the same; repeated here for specs rendered without the API server.
        if a.prefill.target_ttft_ms is None:
            out.append("autoscaling.prefill.targetTTFTMilliseconds is required when autoscaling is enabled")
        if a.decode.target_itl_ms is None:
            out.append("autoscaling.decode.targetITLMilliseconds is required when autoscaling is enabled")
        if a.provider not in PROVIDERS:
            out.append(f"autoscaling.provider {a.provider!r} is not one of {', '.join(PROVIDERS)}")
        if a.provider == "planner":
            for role in ("prefill", "decode"):
                s = a.role(role)
                if s.scale_down_stabilization_s and s.scale_down_stabilization_s < a.interval_s:
                    out.append(
                        f"autoscaling.{role}.scaleDownStabilizationSeconds ({s.scale_down_stabilization_s}) is "
                        f"shorter than intervalSeconds ({a.interval_s}): the window would hold one decision"
                    )
            if not 0.1 <= a.target_utilization <= 1.0:
                out.append(f"autoscaling.targetUtilization ({a.target_utilization}) must be within [0.1, 1]")
    return out


def _dot_dot(path: str) -> bool:
    return ".." in path.split("/")


def lora_problems(spec: InferenceServiceSpec, name: str | None = None) -> list[str]:
    """spec.loraAdapters: unique names that are not the base model's, exactly one source each, folders
    that stay inside their source."""
    out: list[str] = []
    served = spec.model.name or name  # the base model's name on the API, when known
    seen: set[str] = set()
    for i, a in enumerate(spec.lora_adapters):
        where = f"loraAdapters[{i}]" + (f" ({a.name})" if a.name else "")
        if not a.name or len(a.name) > LORA_NAME_MAX or not LORA_NAME.match(a.name):
            out.append(
                f"{where}: name must be 1-{LORA_NAME_MAX} lower-case letters, digits, '-', '.' or '_', "
                "starting and ending with a letter or digit"
            )
        elif a.name in seen:
            out.append(f"{where}: name {a.name!r} is used by another adapter")
        elif a.name == served:
            out.append(f"{where}: name {a.name!r} is the base model's served name; give the adapter another name")
        seen.add(a.name)
        if a.sources != 1:
            out.append(f"{where}: set exactly one of path, volume or configMap (found {a.sources})")
        if a.path is not None and (not a.path.startswith("/") or _dot_dot(a.path)):
            out.append(f"{where}: path {a.path!r} must be an absolute path without '..'")
        if a.claim_name is not None and not DNS_SUBDOMAIN.match(a.claim_name):
            out.append(f"{where}: volume.claimName {a.claim_name!r} is not a PersistentVolumeClaim name")
        if a.sub_path is not None and (a.sub_path.startswith("/") or _dot_dot(a.sub_path)):
            out.append(f"{where}: volume.subPath {a.sub_path!r} must be a relative path without '..'")
        if a.config_map is not None and (len(a.config_map) > 253 or not DNS_SUBDOMAIN.match(a.config_map)):
            out.append(f"{where}: configMap {a.config_map!r} is not a ConfigMap name")
    return out
