"""The OpenAI generation endpoints: ``/v1/completions`` and ``/v1/chat/completions``.

`Serving` turns a request into engine requests; each endpoint says how its choices, stream deltas
and leading chunks look, and `answer` sends them whole or as server-sent events.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvmesh.services.errors import error_responses

from .app_state import server_state
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import Answer, answer
from .serving import Event
from .tools import ToolStream

_ERRORS = error_responses(400, 404, 413, 503)

routes = APIRouter()


@routes.post("/v1/completions", responses=_ERRORS)
async def completions(req: CompletionRequest, raw: Request):
    st = server_state(raw)
    serving, tokenizer = st.serving, st.tokenizer
    model, gen = serving.prepare_completion(req)
    k = req.logprobs or 0
    offsets: dict[int, int] = {}  # streamed text so far per choice (the logprobs' text_offset)
    ids = bool(req.return_token_ids)
    prompt_ids = {idx: p.token_ids for idx, _, p in gen.outputs()} if ids else {}

    def with_ids(choice: dict, token_ids: list[int]) -> dict:
        """vLLM's ``return_token_ids`` fields of a completions choice: ``prompt_token_ids`` once (its
        first chunk), ``token_ids`` always."""
        if ids:
            prompt = prompt_ids.pop(choice["index"], None)
            if prompt is not None:
                choice["prompt_token_ids"] = prompt
            choice["token_ids"] = token_ids
        return choice

    def echoed(p) -> str:
        return p.text if p.text is not None else tokenizer.decode(p.token_ids)

    def lead() -> list[dict]:
        if not req.echo:
            return []
        out = []
        for idx, _, p in gen.outputs():
            text = echoed(p)
            offsets[idx] = len(text)
            out.append(with_ids({"index": idx, "text": text, "logprobs": None, "finish_reason": None}, []))
        return out

    def delta(ev: Event) -> dict:
        off = offsets.get(ev.choice, 0)
        offsets[ev.choice] = off + len(ev.text)
        lp = serving.legacy_logprobs(ev.logprobs, off, k) if req.logprobs is not None and ev.logprobs else None
        choice = {
            "index": ev.choice,
            "text": ev.text,
            "logprobs": lp,
            "finish_reason": ev.finish_reason,
            "stop_reason": ev.stop_reason,
        }
        return with_ids(choice, ev.token_ids)

    def choices() -> list[dict]:
        out = []
        for idx, o, p in gen.outputs():
            prefix = echoed(p) if req.echo else ""
            lp = None
            if req.logprobs is not None and o.logprobs is not None:
                lp = serving.legacy_logprobs(o.logprobs, len(prefix), k)
            choice = {
                "index": idx,
                "text": prefix + o.text,
                "logprobs": lp,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            }
            out.append(with_ids(choice, list(o.token_ids)))
        return out

    return await answer(
        Answer("text_completion", "text_completion", choices, delta, lead, tokens=ids),
        gen,
        raw,
        model,
        req.stream,
        _include_usage(req),
    )


@routes.post("/v1/chat/completions", responses=_ERRORS)
async def chat(req: ChatCompletionRequest, raw: Request):
    st = server_state(raw)
    serving = st.serving
    model, gen = serving.prepare_chat(req)
    k = req.top_logprobs or 0
    tool_streams = {i: ToolStream(gen.tools) for i in range(req.n)} if gen.tools else None  # tools.py
    ids = bool(req.return_token_ids)

    def top() -> dict:  # vLLM's chat answer carries the prompt's ids at the top level
        return {"prompt_token_ids": next(p.token_ids for _, _, p in gen.outputs())} if ids else {}

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
        choice = {
            "index": ev.choice,
            "delta": d,
            "logprobs": lp,
            "finish_reason": finish,
            "stop_reason": ev.stop_reason,
        }
        if ids:
            choice["token_ids"] = ev.token_ids
        return choice

    def choices() -> list[dict]:
        out = []
        for idx, o, _ in gen.outputs():
            msg, finish = {"role": "assistant", "content": o.text}, o.finish_reason
            if gen.tools is not None:
                msg, finish = gen.tools.message(o.text, o.finish_reason)
            lp = serving.chat_logprobs(o.logprobs, k) if req.logprobs and o.logprobs is not None else None
            choice = {
                "index": idx,
                "message": msg,
                "logprobs": lp,
                "finish_reason": finish,
                "stop_reason": o.stop_reason,
            }
            if ids:
                choice["token_ids"] = list(o.token_ids)
            out.append(choice)
        return out

    return await answer(
        Answer("chat.completion", "chat.completion.chunk", choices, delta, lead, tokens=ids, top=top),
        gen,
        raw,
        model,
        req.stream,
        _include_usage(req),
    )


def _include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
