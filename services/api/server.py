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
from fastapi.responses import JSONResponse, Response

from kvmesh import __version__
from kvmesh.services.auth import APIKeyMiddleware, KeyStore
from kvmesh.services.errors import APIError, error_body, error_response

from .config import ServerConfig
from .engine_client import EngineClient
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .responses import Answer, answer
from .serving import Event, Serving
from .tools import ToolStream

log = logging.getLogger("kvmesh.api.server")


class BodyLimitMiddleware:
    """Reject bodies over ``limit`` bytes with 413 before the app parses them.

    Buffers the body (JSON bodies are small), then replays it; later
    ``receive`` calls go to the server, so disconnect detection still works.
    """

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        too_big = False
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    too_big = int(v) > self.limit
                except ValueError:
                    pass
        body = bytearray()
        if not too_big:
            while True:
                msg = await receive()
                if msg["type"] != "http.request":
                    return  # client went away while sending
                body += msg.get("body", b"")
                if len(body) > self.limit:
                    too_big = True
                    break
                if not msg.get("more_body", False):
                    break
        if too_big:
            resp = error_response(413, f"request body exceeds the limit of {self.limit} bytes")
            return await resp(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def build_app(cfg: ServerConfig, client: EngineClient, tokenizer, metrics: ServerMetrics) -> FastAPI:
    ready = client.ready
    assert ready is not None, "start the engine client before building the app"
    served = list(cfg.served_model_names) or [ready.model_name]
    serving = Serving(client, tokenizer, metrics, served, ready.max_model_len, tool_call_parser=cfg.tool_call_parser)
    app = FastAPI(title="kvmesh", version=__version__, docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.client = client

    # ---- errors -------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(
            f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body')}: {er.get('msg')}" for er in errs[:3]
        )
        return error_response(400, msg or "invalid request", loc[0] if loc else None)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):  # a bug, never bad input
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}")

    # ---- auth (services/auth.py; /health and /metrics stay open) -------------
    app.add_middleware(APIKeyMiddleware, store=KeyStore.from_config(cfg.api_keys, cfg.api_keys_file))
    app.add_middleware(BodyLimitMiddleware, limit=cfg.max_body_bytes)

    # ---- plain endpoints ----------------------------------------------------
    @app.get("/health")
    async def health():
        if client.healthy:
            return Response(status_code=200)
        return JSONResponse(
            error_body(503, f"engine is not available: {client.dead_reason or 'starting'}"), status_code=503
        )

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
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
    @app.post("/v1/completions")
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
    @app.post("/v1/chat/completions")
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
