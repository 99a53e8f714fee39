"""The router process: its OpenAI-compatible HTTP app in front of a `Router`, and `serve`.

The routes live in one module per concern and read the `Router` through app_state.py:

* routes_proxy.py: ``/v1/completions`` and ``/v1/chat/completions`` through `Router.handle`
  (bodies validated with the API server's models), ``/v1/models`` from a decode-capable pod
* routes_health.py: ``/live``, ``/health`` (200 while a pod can decode), ``/metrics``
* routes_debug.py: ``/pods``, a debug view of the pod table (the admin key's alone)

Errors are OpenAI-schema bodies from `kvmesh.services.errors`, the same the pods send.
`RequestGuard` bounds what a request may hold the router for (headers, body size and read time)
and cancels a request whose client left, which closes its upstream connection.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from kvmesh.common import tracing
from kvmesh.services.auth import APIKeyMiddleware
from kvmesh.services.errors import http_error_response, validation_error_response
from kvmesh.services.http_server import include_routes, server_config
from kvmesh.services.request_guard import RequestGuard

from . import routes_debug, routes_health, routes_proxy
from .config import RouterConfig
from .router import Router
from .routes_proxy import endpoint_label

log = logging.getLogger("kvmesh.router")


def build_app(router: Router) -> FastAPI:
    cfg = router.cfg
    app = FastAPI(title="kvmesh router")
    app.state.router = router  # the routes' state (app_state.py)
    # every path but /health, /live and /metrics needs a key once keys are configured, /pods the admin
    # key (services/auth.py)
    app.add_middleware(APIKeyMiddleware, store=router.keys, admin=router.admin, admin_paths=routes_debug.ADMIN_PATHS)
    app.add_middleware(RequestGuard, max_body_bytes=cfg.max_body_bytes, body_timeout=cfg.body_timeout)  # outermost
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    include_routes(app, routes_proxy.routes, routes_health.routes, routes_debug.routes)
    if tracing.setup("kvmesh-router"):  # OTEL_* (kvmesh/common/tracing.py); outermost: covers every answer
        tracing.instrument(app, routes_proxy.PROXIED, "router")
    return app


async def _validation_error(request: Request, e: Exception):
    assert isinstance(e, RequestValidationError)
    router: Router = request.app.state.router
    router.metrics.requests.labels(endpoint_label(request.url.path), "400").inc()
    return validation_error_response(list(e.errors()))


async def _http_error(_: Request, e: Exception):  # unknown path, wrong method, unparsable body
    assert isinstance(e, HTTPException)
    return http_error_response(e)


async def serve(cfg: RouterConfig, ready: asyncio.Event | None = None) -> int:
    import uvicorn

    router = Router(cfg)
    await router.start()
    app = build_app(router)
    server = uvicorn.Server(
        server_config(
            app,
            cfg.host,
            cfg.port,
            header_timeout=cfg.header_timeout,
            log_level=cfg.log_level,
            # uvicorn annotates an int but only hands it to asyncio.wait_for, which takes seconds as a float
            timeout_graceful_shutdown=cfg.shutdown_timeout,
        )
    )
    log.info(
        "router on http://%s:%d, policy %s, %d pods, %s event loop",
        cfg.host,
        cfg.port,
        cfg.policy,
        len(router.pods),
        type(asyncio.get_running_loop()).__module__.split(".")[0],
    )
    try:
        await server.serve()
    finally:
        await router.close()
    return 0
