"""Semantic checks that the CRD schema and its CEL rules cannot express (or that we keep out of
CEL on purpose because they depend on the engine's rules, not the API's).

A spec that fails here was accepted by the API server, so the operator cannot reject it; it
reports `Degraded=True, reason=InvalidSpec` and renders nothing, leaving existing children as
they were (a typo must not tear down a serving deployment).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from .spec import InferenceServiceSpec


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
    url = spec.connector.redis_url
    if spec.connector.type == "redis" and url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            out.append(f"kvConnector.redis.url {url!r} is not a redis:// or rediss:// URL with a host")
    if spec.autoscaling.enabled:
        for role in ("prefill", "decode"):
            if spec.role(role).replicas == 0:
                out.append(f"{role}.replicas is 0 but autoscaling is enabled for it")
    return out
