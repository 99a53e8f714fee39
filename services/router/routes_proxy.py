"""The OpenAI endpoints the router proxies: ``/v1/completions`` and ``/v1/chat/completions`` through
`Router.handle`, and ``/v1/models`` from a decode-capable pod.

Request bodies are validated with the API server's own models (`kvmesh.services.api.protocol`), so
a bad request gets the same 400 whether the router or a pod refuses it, and the router's
``/openapi.json`` declares them; the body forwarded is the client's, unknown fields included. The
answer names the pod that served it (``x-kvmesh-pod``) only to the admin key (services/auth.py).
"""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvmesh.services.api.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.services.auth import is_admin, request_key
from kvmesh.services.errors import APIError, api_error_response, bad_request, error_responses

from .admission import ClientGone
from .app_state import current_router
from .router import DECODE_ROLES, POD_HEADER
from .upstream import UpstreamError

PROXIED = ("/v1/completions", "/v1/chat/completions")

_json = msgspec.json.Decoder()
_ERRORS = error_responses(400, 404, 413, 502, 503, 504)

routes = APIRouter()


def endpoint_label(path: str) -> str:
    """The ``endpoint`` label of a path: only the proxied ones, so no client can grow the label set."""
    return path if path in PROXIED else "other"


async def _proxy(path: str, request: Request) -> Response:
    router = current_router(request)
    status = 500
    try:
        try:
            raw = await request.body()
            body = _json.decode(raw)
        except msgspec.DecodeError:
            raise bad_request("request body is not JSON") from None
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")

        async def gone() -> None:  # the body is read: the next message is the client's disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass

        resp = await router.handle(
            path, body, request_key(request.scope), request.headers.get("x-kvmesh-priority"), gone, len(raw)
        )
        if not is_admin(request.scope):  # which pod answered is the topology's, not a client's business
            del resp.headers[POD_HEADER]
        status = resp.status_code
        return resp
    except ClientGone:
        status = 499  # nginx's "client closed request": nobody reads this answer
        return Response(status_code=status)
    except APIError as e:
        status = e.status
        return api_error_response(e)
    finally:
        router.metrics.requests.labels(path, str(status)).inc()


# The parsed model is only the check (and the schema); the client's own body is what goes on.
@routes.post("/v1/completions", responses=_ERRORS)
async def completions(checked: CompletionRequest, request: Request):
    return await _proxy("/v1/completions", request)


@routes.post("/v1/chat/completions", responses=_ERRORS)
async def chat(checked: ChatCompletionRequest, request: Request):
    return await _proxy("/v1/chat/completions", request)


@routes.get("/v1/models")
async def models(request: Request):
    """Every model the decode-capable pods serve: the base model and each pod's LoRA adapters (a
    union: pods may hold different adapters), each listed once."""
    router = current_router(request)
    seen: dict[str, dict] = {}
    for pod in router.candidates(DECODE_ROLES):
        try:
            status, content = await router.upstream.get(pod.url + "/v1/models", router.cfg.connect_timeout)
        except UpstreamError:
            continue
        if status != 200:
            continue
        try:
            data = _json.decode(content).get("data") or []
        except (msgspec.DecodeError, AttributeError):
            continue
        for m in data:
            if isinstance(m, dict) and isinstance(m.get("id"), str):
                seen.setdefault(m["id"], m)
    if not seen:
        seen[router.model] = {"id": router.model, "object": "model", "created": int(time.time()), "owned_by": "kvmesh"}
    return {"object": "list", "data": list(seen.values())}
