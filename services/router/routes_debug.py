"""``/pods``: a debug view of the pod table, each pod as the router sees it. It names the pods' addresses,
load and event state, so it takes the admin key (services/auth.py), never a client's."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .app_state import current_router
from .router import Router

routes = APIRouter()
ADMIN_PATHS = frozenset({"/pods"})  # APIKeyMiddleware's admin_paths for this module's routes


@routes.get("/pods")
async def pods(request: Request):
    """Debug view: each pod's state as the router sees it."""
    router = current_router(request)
    return {
        "pods": [
            {
                "url": p.url,
                "role": p.spec.role,
                "healthy": p.healthy,
                "running": p.running,
                "waiting": p.waiting,
                "kv_usage": p.kv_usage,
                "inflight_requests": p.inflight_requests,
                "inflight_tokens": p.inflight_tokens,
                "routed": p.routed,
                "failures": p.failures,
                "exact": router.index.is_exact(p.url),
                "indexed_blocks": router.index.pod_blocks(p.url),
                "eviction_pressure": router.index.eviction_pressure([p.url])[p.url],
                "event_seq": router.hub.pod_seq(p.url),
                "events": _stream(router, p.url),
                "last_error": p.last_error,
                "lora": {
                    "registered": sorted(p.lora.registered),
                    "active": sorted(p.lora.active),
                    "max_loras": p.lora.max_loras,
                },
            }
            for p in router.pods.values()
        ],
        "index": router.index.size(),
        "events": {
            "batches": router.hub.stats.batches,
            "gaps": router.hub.stats.gaps,
            "replayed": router.hub.stats.replayed,
            "resyncs": router.hub.stats.resyncs,
            "restarts": router.hub.stats.restarts,
        },
    }


def _stream(router: Router, url: str) -> dict | None:
    """The pod's KV-event stream as the router sees it (None: the pod publishes none, approximate mode)."""
    st = router.hub.pod_stream(url)
    if st is None:
        return None
    age = None if st.last_batch_age_s is None else round(st.last_batch_age_s, 3)
    return {
        "connected": st.connected,
        "batches": st.batches,
        "handshake_failures": st.handshake_failures,
        "last_batch_age_s": age,
    }
