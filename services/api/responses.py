"""Answering a completions or chat request: one JSON body, or a stream of server-sent events.

Both endpoints answer the same way and differ only in their object names and in how a choice
looks (`Answer`): a stream waits for the first event before sending headers (so a rejection
still gets its status code), skips empty events, ends with an optional usage chunk and
``[DONE]``, and an engine error mid-stream becomes an error event. Whatever ends a request
(the end, an error, a client that left) closes its `Generation`, which aborts what still runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvmesh.services.errors import MIGRATED_HEADER, QUEUE_BUDGET_HEADER, APIError, error_body

from .serving import Event, Generation


@dataclass(frozen=True)
class Answer:
    """What differs between the completions and chat answers."""

    obj: str  # the whole answer's "object"
    chunk_obj: str  # a streamed chunk's "object"
    choices: Callable[[], list[dict]]  # the whole answer's choices, once the generation ended
    delta: Callable[[Event], dict]  # one streamed event as a choice
    lead: Callable[[], Iterable[dict]] = tuple  # choices streamed before the first token (echo, the role)
    # ``return_token_ids``: events that carry only token ids (no text yet: a partial character, text held
    # back for a stop string) are streamed too, so the client has every token id as it is generated
    tokens: bool = False
    top: Callable[[], dict] = dict  # top-level fields of the whole answer and of the first streamed chunk


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def answer(a: Answer, gen: Generation, raw: Request, model: str, stream: bool, include_usage: bool):
    """Start ``gen`` and answer with it: a JSON body (a dict), or an SSE `StreamingResponse`."""
    gen.migrated = raw.headers.get(MIGRATED_HEADER) == "1"
    gen.queue_budget_s = _seconds(raw.headers.get(QUEUE_BUDGET_HEADER))
    if gen.migrated:
        gen.metrics.observe_migrated()
    gen.start()
    created = int(time.time())
    rid = gen.stream.request_id

    def body(obj: str, choices: list[dict], **extra) -> dict:
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}

    if not stream:
        await _consume(gen, raw)
        out = body(a.obj, a.choices(), usage=gen.usage(), **a.top())
        if gen.kv_transfer_params_out is not None:  # a prefill answer: what a decode pod needs to pull its blocks
            out["kv_transfer_params"] = gen.kv_transfer_params_out
        return out
    first = await _first_event(gen, raw)

    async def events() -> AsyncIterator[str]:
        top = a.top()  # on the first chunk alone

        def chunk(choice: dict) -> str:
            nonlocal top
            out, top = body(a.chunk_obj, [choice], **top), {}
            return sse(out)

        for choice in a.lead():
            yield chunk(choice)
        async for ev in _chain(first, gen):
            if ev.text or ev.finish_reason or ev.logprobs or (a.tokens and ev.token_ids):
                yield chunk(a.delta(ev))
        if include_usage:
            yield sse(body(a.chunk_obj, [], usage=gen.usage()))

    return StreamingResponse(_framed(events(), gen), media_type="text/event-stream")


async def _framed(events: AsyncIterator[str], gen: Generation) -> AsyncIterator[str]:
    try:
        async for chunk in events:
            yield chunk
    except APIError as e:
        yield sse(error_body(e.status, e.message, e.param))
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


async def _consume(gen: Generation, raw: Request) -> None:
    """Run a non-streaming generation to the end; a client that disconnects aborts it."""
    try:
        async for _ in gen.events(raw.is_disconnected):
            pass
    finally:
        gen.close()


async def _first_event(gen: Generation, raw: Request) -> Event | None:
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


def _seconds(value: str | None) -> float | None:
    """A header's non-negative, finite number of seconds; None when absent or not one (ignored, never a 400:
    only the router sends it)."""
    if value is None:
        return None
    try:
        v = float(value)
    except ValueError:
        return None
    return v if 0.0 <= v < float("inf") else None
