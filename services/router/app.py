"""The router process: its OpenAI-compatible HTTP app in front of a `Router`, and `serve`.

``/v1/completions`` and ``/v1/chat/completions`` go through `Router.handle`; ``/v1/models``
asks a decode-capable pod; ``/health`` is 200 while one is up; ``/pods`` is a debug view of the
pod table. Errors are OpenAI-schema bodies from `kvmesh.services.errors`, the same the pods send.

Request bodies are validated with the API server's own models (`kvmesh.services.api.protocol`),
so a bad request gets the same 400 whether the router or a pod refuses it, and the router's
``/openapi.json`` declares them; the body forwarded is the client's, unknown fields included.
`RequestGuard` bounds what a request may hold the router for (headers, body size and read time)
and cancels a request whose client left, which closes its upstream connection.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException

from kvmesh.services.api.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.services.auth import APIKeyMiddleware, request_key
from kvmesh.services.errors import APIError, bad_request, error_response, error_responses, validation_error_response
from kvmesh.services.http_server import server_config
from kvmesh.services.request_guard import RequestGuard

from .admission import ClientGone
from .config import RouterConfig
from .router import DECODE_ROLES, NO_DECODE_POD, Router
from .upstream import UpstreamError

log = logging.getLogger("kvmesh.router")

_json = msgspec.json.Decoder()


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


_ERRORS = error_responses(400, 404, 413, 502, 503, 504)
_PLAIN = {"content": {"text/plain": {"schema": {"type": "string"}}}}


def build_app(router: Router) -> FastAPI:
    cfg = router.cfg
    app = FastAPI(title="kvmesh router")
    # every path but /health, /live and /metrics needs a key once keys are configured (services/auth.py)
    app.add_middleware(APIKeyMiddleware, store=router.keys)
    app.add_middleware(RequestGuard, max_body_bytes=cfg.max_body_bytes, body_timeout=cfg.body_timeout)  # outermost

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        router.metrics.requests.labels(_endpoint(request.url.path), "400").inc()
        return validation_error_response(list(e.errors()))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException):  # unknown path, wrong method, unparsable body
        return error_response(e.status_code, str(e.detail), None, dict(e.headers) if e.headers else None)

    async def _proxy(path: str, request: Request) -> Response:
        status = 500
        try:
            try:
                body = _json.decode(await request.body())
            except msgspec.DecodeError:
                raise bad_request("request body is not JSON") from None
            if not isinstance(body, dict):
                raise bad_request("request body must be a JSON object")

            async def gone() -> None:  # the body is read: the next message is the client's disconnect
                while (await request.receive())["type"] != "http.disconnect":
                    pass

            resp = await router.handle(
                path, body, request_key(request.scope), request.headers.get("x-kvmesh-priority"), gone
            )
            status = resp.status_code
            return resp
        except ClientGone:
            status = 499  # nginx's "client closed request": nobody reads this answer
            return Response(status_code=status)
        except APIError as e:
            status = e.status
            return error_response(e.status, e.message, e.param, e.headers)
        finally:
            router.metrics.requests.labels(path, str(status)).inc()

    # The parsed model is only the check (and the schema); the client's own body is what goes on.
    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(checked: CompletionRequest, request: Request):
        return await _proxy("/v1/completions", request)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat(checked: ChatCompletionRequest, request: Request):
        return await _proxy("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models():
        for pod in router.candidates(DECODE_ROLES):
            try:
                status, content = await router.upstream.get(pod.url + "/v1/models", router.cfg.connect_timeout)
                if status == 200:
                    return Response(content, media_type="application/json")
            except UpstreamError:
                continue
        return {
            "object": "list",
            "data": [{"id": router.model, "object": "model", "created": int(time.time()), "owned_by": "kvmesh"}],
        }

    @app.get("/live", response_class=Response, responses={200: {"description": "the loop answers", "content": {}}})
    async def live():
        """Liveness: the router's loop answers. Unlike /health it does not depend on the pods, so
        workers that are still loading or down never get a healthy router restarted."""
        return Response(status_code=200)

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "a pod can decode (empty body)", "content": {}}, **error_responses(503)},
    )
    async def health():
        """Readiness: 200 only while a pod can decode, so a Service sends no traffic before then."""
        if router.candidates(DECODE_ROLES):
            return Response(status_code=200)
        return error_response(503, NO_DECODE_POD)

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: _PLAIN})
    async def metrics():
        router.refresh_event_metrics()
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/pods")
    async def pods():
        """Debug view: each pod's state as the router sees it."""
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

    return app


def _endpoint(path: str) -> str:
    """The ``endpoint`` label of a path: only the two proxied ones, so no client can grow the label set."""
    return path if path in ("/v1/completions", "/v1/chat/completions") else "other"


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
