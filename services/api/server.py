"""The FastAPI app: OpenAI endpoints, tokenize/detokenize, health, version, metrics.

Shared by every role (all-in-one, prefill, decode): a role changes the engine's
configuration, never this file. `build_app` takes an already started
`EngineClient`, so tests can build the app around any engine.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from kvmesh import __version__
from kvmesh.services.auth import APIKeyMiddleware, KeyStore
from kvmesh.services.errors import (
    APIError,
    error_body,
    error_response,
    error_responses,
    validation_error_response,
)
from kvmesh.services.request_guard import RequestGuard

from .config import ServerConfig
from .engine_client import EngineClient
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .responses import Answer, answer
from .serving import Event, Serving
from .tools import ToolStream

log = logging.getLogger("kvmesh.api.server")

_ERRORS = error_responses(400, 404, 413, 503)


def build_app(cfg: ServerConfig, client: EngineClient, tokenizer, metrics: ServerMetrics) -> FastAPI:
    ready = client.ready
    assert ready is not None, "start the engine client before building the app"
    served = list(cfg.served_model_names) or [ready.model_name]
    serving = Serving(client, tokenizer, metrics, served, ready.max_model_len, tool_call_parser=cfg.tool_call_parser)
    app = FastAPI(title="kvmesh", version=__version__, docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.client = client
    app.state.draining = False

    # ---- errors -------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        return validation_error_response(list(e.errors()))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException):  # unknown path, wrong method, unparsable body
        return error_response(e.status_code, str(e.detail), None, dict(e.headers) if e.headers else None)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):  # a bug, never bad input
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}")

    # ---- auth (services/auth.py; /health and /metrics stay open) and request hygiene (outermost) --
    app.add_middleware(APIKeyMiddleware, store=KeyStore.from_config(cfg.api_keys, cfg.api_keys_file))
    app.add_middleware(RequestGuard, max_body_bytes=cfg.max_body_bytes, body_timeout=cfg.body_timeout)

    # ---- plain endpoints ----------------------------------------------------
    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "the engine is up (empty body)", "content": {}}, **error_responses(503)},
    )
    async def health():
        """Readiness: 503 while the engine is down or the server is draining (POST /drain), so the
        pod's EndpointSlice entry turns not ready and routers stop sending it new work."""
        if client.healthy and not app.state.draining:
            return Response(status_code=200)
        if client.healthy:
            return JSONResponse(error_body(503, "draining: finishing open requests"), status_code=503)
        return JSONResponse(
            error_body(503, f"engine is not available: {client.dead_reason or 'starting'}"), status_code=503
        )

    @app.get(
        "/live",
        response_class=Response,
        responses={200: {"description": "the engine is up, draining or not", "content": {}}, **error_responses(503)},
    )
    async def live():
        """Liveness: like /health but a draining server is alive (a drain must not get it restarted)."""
        if client.healthy:
            return Response(status_code=200)
        return JSONResponse(
            error_body(503, f"engine is not available: {client.dead_reason or 'starting'}"), status_code=503
        )

    def drain_state() -> dict:
        st, open_ = client.stats, len(client.streams)  # streams: requests this server still answers
        return {
            "draining": app.state.draining,
            "open_requests": open_,
            "running": st.num_running,
            "waiting": st.num_waiting,
            "held": st.num_held_requests,
            "idle": open_ + st.num_running + st.num_waiting + st.num_held_requests == 0,
        }

    @app.post("/drain")
    async def drain():
        """Stop being ready for new work (/health 503) and keep serving what is open: requests and
        streams in flight finish, a prefill pod keeps the blocks it holds for decode pods until they
        are pulled or their lease ends. Poll GET /drain until ``idle``; DELETE /drain undoes it.
        Requests that still arrive are answered. Needs an API key like every other endpoint."""
        if not app.state.draining:
            log.info("draining: /health now answers 503")
        app.state.draining = True
        return drain_state()

    @app.get("/drain")
    async def drain_status():
        return drain_state()

    @app.delete("/drain")
    async def undrain():
        app.state.draining = False
        return drain_state()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"content": {"text/plain": {}}}})
    async def prom_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": now,
                    "owned_by": "kvmesh",
                    "root": ready.model_name,
                    "parent": None,
                    "max_model_len": ready.max_model_len,
                    # extra fields, as vLLM's: the weights' and the KV cache's number formats
                    "quantization": ready.quantization or None,
                    "kv_cache_dtype": ready.kv_cache_dtype,
                }
                for name in served
            ],
        }

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = serving.chat_prompt(req.messages, req.add_generation_prompt)
        else:
            ids = serving.encode(req.prompt, req.add_special_tokens)  # type: ignore[arg-type]
        return {"tokens": ids, "count": len(ids), "max_model_len": ready.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        bad = [t for t in req.tokens if not (0 <= t < serving.vocab_size)]
        if bad:
            raise APIError(400, f"token ids out of range [0, {serving.vocab_size}): {bad[:5]}", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget the engine's cached prefixes (vLLM's endpoint of the same name). 409 while requests
        run: their blocks are in use. The KV event stream carries AllBlocksCleared to routers."""
        if not client.healthy:
            raise APIError(503, f"engine is not available: {client.dead_reason or 'starting'}")
        if not await client.reset_prefix_cache():
            raise APIError(409, "requests are running; the prefix cache can be reset only when the engine is idle")
        return {"reset": True}

    # ---- completions --------------------------------------------------------
    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(req: CompletionRequest, raw: Request):
        model, gen = serving.prepare_completion(req)
        k = req.logprobs or 0
        offsets: dict[int, int] = {}  # streamed text so far per choice (the logprobs' text_offset)

        def echoed(p) -> str:
            return p.text if p.text is not None else tokenizer.decode(p.token_ids)

        def lead() -> list[dict]:
            if not req.echo:
                return []
            out = []
            for idx, _, p in gen.outputs():
                text = echoed(p)
                offsets[idx] = len(text)
                out.append({"index": idx, "text": text, "logprobs": None, "finish_reason": None})
            return out

        def delta(ev: Event) -> dict:
            off = offsets.get(ev.choice, 0)
            offsets[ev.choice] = off + len(ev.text)
            lp = serving.legacy_logprobs(ev.logprobs, off, k) if req.logprobs is not None and ev.logprobs else None
            return {
                "index": ev.choice,
                "text": ev.text,
                "logprobs": lp,
                "finish_reason": ev.finish_reason,
                "stop_reason": ev.stop_reason,
            }

        def choices() -> list[dict]:
            out = []
            for idx, o, p in gen.outputs():
                prefix = echoed(p) if req.echo else ""
                lp = None
                if req.logprobs is not None and o.logprobs is not None:
                    lp = serving.legacy_logprobs(o.logprobs, len(prefix), k)
                out.append(
                    {
                        "index": idx,
                        "text": prefix + o.text,
                        "logprobs": lp,
                        "finish_reason": o.finish_reason,
                        "stop_reason": o.stop_reason,
                    }
                )
            return out

        return await answer(
            Answer("text_completion", "text_completion", choices, delta, lead),
            gen,
            raw,
            model,
            req.stream,
            _include_usage(req),
        )

    # ---- chat ---------------------------------------------------------------
    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat(req: ChatCompletionRequest, raw: Request):
        model, gen = serving.prepare_chat(req)
        k = req.top_logprobs or 0
        tool_streams = {i: ToolStream(gen.tools) for i in range(req.n)} if gen.tools else None  # tools.py

        def lead() -> list[dict]:
            return [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(req.n)
            ]

        def delta(ev: Event) -> dict:
            lp = serving.chat_logprobs(ev.logprobs, k) if req.logprobs and ev.logprobs else None
            d, finish = ({"content": ev.text} if ev.text else {}), ev.finish_reason
            if tool_streams is not None:
                d, finish = tool_streams[ev.choice].delta(ev.text, ev.finish_reason)
            return {
                "index": ev.choice,
                "delta": d,
                "logprobs": lp,
                "finish_reason": finish,
                "stop_reason": ev.stop_reason,
            }

        def choices() -> list[dict]:
            out = []
            for idx, o, _ in gen.outputs():
                msg, finish = {"role": "assistant", "content": o.text}, o.finish_reason
                if gen.tools is not None:
                    msg, finish = gen.tools.message(o.text, o.finish_reason)
                lp = serving.chat_logprobs(o.logprobs, k) if req.logprobs and o.logprobs is not None else None
                out.append(
                    {
                        "index": idx,
                        "message": msg,
                        "logprobs": lp,
                        "finish_reason": finish,
                        "stop_reason": o.stop_reason,
                    }
                )
            return out

        return await answer(
            Answer("chat.completion", "chat.completion.chunk", choices, delta, lead),
            gen,
            raw,
            model,
            req.stream,
            _include_usage(req),
        )

    return app


def _include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
