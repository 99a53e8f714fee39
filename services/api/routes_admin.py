"""Operating the server: health and liveness probes, draining, version, Prometheus metrics, and
resetting the engine's prefix cache. Draining and the reset act on the whole pod, so they take the
admin key (`ADMIN_PATHS`, services/auth.py), never a client's: a client key that may POST /drain lets
any client take the pod out of service."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from kvmesh import __version__
from kvmesh.services.errors import APIError, error_response, error_responses

from .app_state import ServerState, server_state

log = logging.getLogger("kvmesh.api.server")

routes = APIRouter()
ADMIN_PATHS = frozenset({"/drain", "/reset_prefix_cache"})  # APIKeyMiddleware's admin_paths (every method)


@routes.get(
    "/health",
    response_class=Response,
    responses={200: {"description": "the engine is up (empty body)", "content": {}}, **error_responses(503)},
)
async def health(request: Request):
    """Readiness: 503 while the engine is down or the server is draining (POST /drain), so the
    pod's EndpointSlice entry turns not ready and routers stop sending it new work."""
    st = server_state(request)
    if st.client.healthy and not st.draining:
        return Response(status_code=200)
    if st.client.healthy:
        return error_response(503, "draining: finishing open requests")
    return error_response(503, st.unavailable())


@routes.get(
    "/live",
    response_class=Response,
    responses={200: {"description": "the engine is up, draining or not", "content": {}}, **error_responses(503)},
)
async def live(request: Request):
    """Liveness: like /health but a draining server is alive (a drain must not get it restarted)."""
    st = server_state(request)
    if st.client.healthy:
        return Response(status_code=200)
    return error_response(503, st.unavailable())


def drain_state(st: ServerState) -> dict:
    client = st.client
    stats, open_ = client.stats, len(client.streams)  # streams: requests this server still answers
    return {
        "draining": st.draining,
        "open_requests": open_,
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "held": stats.num_held_requests,
        "idle": open_ + stats.num_running + stats.num_waiting + stats.num_held_requests == 0,
    }


@routes.post("/drain")
async def drain(request: Request):
    """Stop being ready for new work (/health 503) and keep serving what is open: requests and
    streams in flight finish, a prefill pod keeps the blocks it holds for decode pods until they
    are pulled or their lease ends. Poll GET /drain until ``idle``; DELETE /drain undoes it.
    Requests that still arrive are answered. Takes the admin key (GET and DELETE too)."""
    st = server_state(request)
    if not st.draining:
        log.info("draining: /health now answers 503")
    st.draining = True
    return drain_state(st)


@routes.get("/drain")
async def drain_status(request: Request):
    return drain_state(server_state(request))


@routes.delete("/drain")
async def undrain(request: Request):
    st = server_state(request)
    st.draining = False
    return drain_state(st)


@routes.get("/version")
async def version():
    return {"version": __version__}


@routes.get("/metrics", response_class=PlainTextResponse, responses={200: {"content": {"text/plain": {}}}})
async def prom_metrics(request: Request):
    return Response(server_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@routes.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request):
    """Forget the engine's cached prefixes (vLLM's endpoint of the same name). 409 while requests
    run: their blocks are in use. The KV event stream carries AllBlocksCleared to routers."""
    st = server_state(request)
    if not st.client.healthy:
        raise APIError(503, st.unavailable())
    if not await st.client.reset_prefix_cache():
        raise APIError(409, "requests are running; the prefix cache can be reset only when the engine is idle")
    return {"reset": True}
