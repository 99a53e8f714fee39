"""Semantic checks that the CRD schema and its CEL rules cannot express (or that we keep out of
CEL on purpose because they depend on the engine's rules, not the API's).

A spec that fails here was accepted by the API server, so the operator cannot reject it; it
reports `Degraded=True, reason=InvalidSpec` and renders nothing, leaving existing children as
they were (a typo must not tear down a serving deployment).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from .spec import PROVIDERS, InferenceServiceSpec


def problems(spec: InferenceServiceSpec) -> list[str]:
    """Return human-readable problems; an empty list means the spec can be rendered."""
    out: list[str] = []
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
