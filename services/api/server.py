"""The FastAPI app: OpenAI endpoints, tokenize/detokenize, health, version, metrics.

Shared by every role (all-in-one, prefill, decode): a role changes the engine's
configuration, never this file. `build_app` takes an already started
`EngineClient`, so tests can build the app around any engine. The routes live in one
module per concern and share the `ServerState` (app_state.py):

* routes_openai.py: ``/v1/completions``, ``/v1/chat/completions``
* routes_models.py: ``/v1/models``, ``/tokenize``, ``/detokenize``
* routes_lora.py: ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``
* routes_admin.py: ``/health``, ``/live``, ``/drain``, ``/version``, ``/metrics``, ``/reset_prefix_cache``
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from kvmesh import __version__
from kvmesh.common import tracing
from kvmesh.services.auth import APIKeyMiddleware, KeyStore, admin_key_source
from kvmesh.services.errors import (
    APIError,
    api_error_response,
    error_response,
    http_error_response,
    validation_error_response,
)
from kvmesh.services.http_server import include_routes
from kvmesh.services.request_guard import RequestGuard

from . import routes_admin, routes_lora, routes_models, routes_openai
from .app_state import ServerState
from .config import ServerConfig
from .engine_client import EngineClient
from .metrics import ServerMetrics
from .serving import Serving

log = logging.getLogger("kvmesh.api.server")


def build_app(cfg: ServerConfig, client: EngineClient, tokenizer, metrics: ServerMetrics) -> FastAPI:
    ready = client.ready
    assert ready is not None, "start the engine client before building the app"
    served = list(cfg.served_model_names) or [ready.model_name]
    serving = Serving(
        client,
        tokenizer,
        metrics,
        served,
        ready.max_model_len,
        tool_call_parser=cfg.tool_call_parser,
        max_request_tokens=cfg.max_request_tokens,
    )
    app = FastAPI(title="kvmesh", version=__version__, docs_url=None, redoc_url=None)
    app.state.server = ServerState(client, serving, tokenizer, metrics, ready, served)

    # ---- errors (services/errors.py) ----------------------------------------
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)

    # ---- auth (services/auth.py; /health and /metrics stay open, /drain and /reset_prefix_cache take
    # the admin key) and request hygiene (outermost) --------------------------------------------------
    app.add_middleware(
        APIKeyMiddleware,
        store=KeyStore.from_config(cfg.api_keys, cfg.api_keys_file),
        admin=admin_key_source(cfg.admin_key, cfg.admin_key_file),
        admin_paths=routes_admin.ADMIN_PATHS | routes_lora.ADMIN_PATHS,
    )
    app.add_middleware(RequestGuard, max_body_bytes=cfg.max_body_bytes, body_timeout=cfg.body_timeout)

    include_routes(app, routes_admin.routes, routes_models.routes, routes_openai.routes, routes_lora.routes)
    # OTEL_* (kvmesh/common/tracing.py); outermost: the span covers every answer, streamed ones to the end
    if tracing.setup(f"kvmesh-{ready.role}"):
        tracing.instrument(app, ("/v1/completions", "/v1/chat/completions"), ready.role)
    return app


async def _api_error(_: Request, e: Exception):
    assert isinstance(e, APIError)
    return api_error_response(e)


async def _validation_error(_: Request, e: Exception):
    assert isinstance(e, RequestValidationError)
    return validation_error_response(list(e.errors()))


async def _http_error(_: Request, e: Exception):  # unknown path, wrong method, unparsable body
    assert isinstance(e, HTTPException)
    return http_error_response(e)


async def _unexpected(_: Request, e: Exception):  # a bug, never bad input
    log.exception("unhandled error")
    return error_response(500, f"internal error: {type(e).__name__}")
