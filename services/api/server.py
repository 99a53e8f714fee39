"""The FastAPI app: OpenAI endpoints, tokenize/detokenize, health, version, metrics.

Shared by every role (all-in-one, prefill, decode): a role changes the engine's
configuration, never this file. `build_app` takes an already started
`EngineClient`, so tests can build the app around any engine.
"""
from __future__ import annotations

import hmac
import json
import logging
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmesh import __version__

from .config import ServerConfig
from .engine_client import EngineClient
from kvmesh.services.errors import APIError, error_body, error_response
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving import Event, Generation, Serving

log = logging.getLogger("kvmesh.api.server")

OPEN_PATHS = ("/health", "/metrics")  # reachable without the API key (probes, scrapers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


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
    serving = Serving(client, tokenizer, metrics, served, ready.max_model_len)
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
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body')}: {er.get('msg')}"
                        for er in errs[:3])
        return error_response(400, msg or "invalid request", loc[0] if loc else None)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):  # a bug, never bad input
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}")

    # ---- auth ---------------------------------------------------------------
    if cfg.api_key:
        expected = f"Bearer {cfg.api_key}".encode()

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if request.url.path in OPEN_PATHS:
                return await call_next(request)
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                return error_response(401, "invalid or missing API key (Authorization: Bearer ...)")
            return await call_next(request)

    app.add_middleware(BodyLimitMiddleware, limit=cfg.max_body_bytes)

    # ---- plain endpoints ----------------------------------------------------
    @app.get("/health")
    async def health():
        if client.healthy:
            return Response(status_code=200)
        return JSONResponse(error_body(503, f"engine is not available: {client.dead_reason or 'starting'}"),
                            status_code=503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prom_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "kvmesh", "root": ready.model_name,
             "parent": None, "max_model_len": ready.max_model_len} for name in served]}

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
        gen.start()
        created = int(time.time())
        rid = gen.stream.request_id
        k = req.logprobs or 0

        def chunk_choice(ev: Event, text: str, offset: int) -> dict:
            lp = serving.legacy_logprobs(ev.logprobs, offset, k) if req.logprobs is not None and ev.logprobs else None
            return {"index": ev.choice, "text": text, "logprobs": lp, "finish_reason": ev.finish_reason,
                    "stop_reason": ev.stop_reason}

        if req.stream:
            first = await _first_event(gen, raw)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def events() -> AsyncIterator[str]:
                offsets: dict[int, int] = {}
                if req.echo:
                    for idx, _, p in gen.outputs():
                        text = p.text if p.text is not None else tokenizer.decode(p.token_ids)
                        offsets[idx] = len(text)
                        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                    "choices": [{"index": idx, "text": text, "logprobs": None,
                                                 "finish_reason": None}]})
                async for ev in _chain(first, gen):
                    if not ev.text and not ev.finish_reason and not ev.logprobs:
                        continue
                    off = offsets.get(ev.choice, 0)
                    offsets[ev.choice] = off + len(ev.text)
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [chunk_choice(ev, ev.text, off)]})
                if include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": gen.usage()})

            return _stream_response(events(), gen)

        await _consume(gen, raw)
        choices = []
        for idx, out, p in gen.outputs():
            prefix = ""
            if req.echo:
                prefix = p.text if p.text is not None else tokenizer.decode(p.token_ids)
            lp = None
            if req.logprobs is not None and out.logprobs is not None:
                lp = serving.legacy_logprobs(out.logprobs, len(prefix), k)
            choices.append({"index": idx, "text": prefix + out.text, "logprobs": lp,
                            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": gen.usage()}
        return _with_transfer_params(body, gen)

    # ---- chat ---------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        model, gen = serving.prepare_chat(req)
        gen.start()
        created = int(time.time())
        rid = gen.stream.request_id
        k = req.top_logprobs or 0

        if req.stream:
            first = await _first_event(gen, raw)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(choices: list[dict]) -> str:
                return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": choices})

            async def events() -> AsyncIterator[str]:
                for i in range(req.n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                async for ev in _chain(first, gen):
                    if not ev.text and not ev.finish_reason and not ev.logprobs:
                        continue
                    lp = serving.chat_logprobs(ev.logprobs, k) if req.logprobs and ev.logprobs else None
                    delta = {"content": ev.text} if ev.text else {}
                    yield chunk([{"index": ev.choice, "delta": delta, "logprobs": lp,
                                  "finish_reason": ev.finish_reason, "stop_reason": ev.stop_reason}])
                if include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": model, "choices": [], "usage": gen.usage()})

            return _stream_response(events(), gen)

        await _consume(gen, raw)
        choices = []
        for idx, out, _ in gen.outputs():
            lp = serving.chat_logprobs(out.logprobs, k) if req.logprobs and out.logprobs is not None else None
            choices.append({"index": idx, "message": {"role": "assistant", "content": out.text},
                            "logprobs": lp, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": gen.usage()}
        return _with_transfer_params(body, gen)

    return app


def _stream_response(events: AsyncIterator[str], gen: Generation) -> StreamingResponse:
    """SSE framing shared by both endpoints: an engine error becomes an error event, the
    generation is always closed (aborting it if the client left), and the stream ends with [DONE]."""

    async def framed() -> AsyncIterator[str]:
        try:
            async for chunk in events:
                yield chunk
        except APIError as e:
            yield _sse(error_body(e.status, e.message, e.param))
        finally:
            gen.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(framed(), media_type="text/event-stream")


def _with_transfer_params(body: dict, gen: Generation) -> dict:
    """A prefill answer carries the params a decode pod needs to pull its blocks."""
    if gen.kv_transfer_params_out is not None:
        body["kv_transfer_params"] = gen.kv_transfer_params_out
    return body


async def _consume(gen: Generation, raw: Request) -> None:
    """Run a non-streaming generation to the end; a client that disconnects aborts it."""
    try:
        async for _ in gen.events(raw.is_disconnected):
            pass
    finally:
        gen.close()


async def _first_event(gen: Generation, raw: Request) -> Event | None:
    """Wait for the first event before sending headers, so a rejection still gets its status code."""
    try:
        async for ev in gen.events(raw.is_disconnected):
            return ev
    except BaseException:
        gen.close()
        raise
    gen.close()  # finished without events or client gone
    return None


async def _chain(first: Event | None, gen: Generation) -> AsyncIterator[Event]:
    if first is None:
        return
    yield first
    async for ev in gen.events():
        yield ev
