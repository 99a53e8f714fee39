"""The router's probes and metrics: ``/live``, ``/health``, ``/metrics`` (open to any scraper: tenants
appear by name only with --metrics-tenant-labels, metrics.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from kvmesh.services.errors import error_response, error_responses

from .app_state import current_router
from .router import DECODE_ROLES, NO_DECODE_POD

_PLAIN = {"content": {"text/plain": {"schema": {"type": "string"}}}}

routes = APIRouter()


@routes.get("/live", response_class=Response, responses={200: {"description": "the loop answers", "content": {}}})
async def live():
    """Liveness: the router's loop answers. Unlike /health it does not depend on the pods, so
    workers that are still loading or down never get a healthy router restarted."""
    return Response(status_code=200)


@routes.get(
    "/health",
    response_class=Response,
    responses={200: {"description": "a pod can decode (empty body)", "content": {}}, **error_responses(503)},
)
async def health(request: Request):
    """Readiness: 200 only while a pod can decode, so a Service sends no traffic before then."""
    router = current_router(request)
    if router.candidates(DECODE_ROLES):
        return Response(status_code=200)
    return error_response(503, NO_DECODE_POD)


@routes.get("/metrics", response_class=PlainTextResponse, responses={200: _PLAIN})
async def metrics(request: Request):
    router = current_router(request)
    router.refresh_event_metrics()
    body = router.metrics.render(tenant_names=router.cfg.metrics_tenant_labels)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
