"""What every request must pass before an app sees it, at the API server and at the router alike.

`RequestGuard` is an ASGI middleware that answers in the OpenAI error schema
(`kvmesh.services.errors`) when a request is one a server must not hold on to:

- too many or too large headers: 431 (uvicorn's httptools parser has no limit of its own);
- a body with a content type other than JSON: 400; a body over ``max_body_bytes``: 413;
- a body that trickles in for longer than ``body_timeout`` seconds: 408 (a slow client
  holds a connection and a buffer, never the server);
- a body that is not JSON, not UTF-8, or nested deeper than `MAX_JSON_DEPTH`: 400, before
  any JSON parser recurses into it.

An exception the app did not handle becomes a 500 in the same schema (logged with its traceback).

It also cancels the app when the client disconnects before its response is complete, so a
non-streaming request whose client left stops at once: at the API server the cancelled
handler aborts its engine requests (their blocks are freed), at the router it closes the
upstream connection, which the pod sees as its own client leaving. A response already
streaming sees the disconnect the usual way (``receive`` returns ``http.disconnect``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from kvmesh.common.heap import TRIM_BODY_BYTES, trim_heap

from .errors import error_response

log = logging.getLogger("kvmesh.request_guard")

MAX_JSON_DEPTH = 32  # a chat body nests ~5 deep (body, messages, message, content part, url)
MAX_HEADERS = 100
MAX_HEADER_BYTES = 32 << 10  # names and values together (nginx's default is 4 x 8 KiB)
BODY_METHODS = ("POST", "PUT", "PATCH")

_json = msgspec.json.Decoder()


def json_depth_error(body: bytes) -> str | None:
    """Why ``body`` is not a JSON value we accept (invalid, not UTF-8, too deep), or None."""
    try:
        value = _json.decode(body)
    except msgspec.DecodeError as e:
        return f"request body is not valid JSON: {e}"
    except RecursionError:
        return f"request body is nested deeper than {MAX_JSON_DEPTH} levels"
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return None  # cannot be too deep: skip the walk (the common case)
    level = [value]  # the containers at ``depth``
    for depth in range(1, MAX_JSON_DEPTH + 1):
        nxt: list = []
        for v in level:
            if isinstance(v, dict):
                nxt.extend(x for x in v.values() if isinstance(x, (dict, list)))
            elif isinstance(v, list):
                nxt.extend(x for x in v if isinstance(x, (dict, list)))
        if not nxt:
            return None
        if depth == MAX_JSON_DEPTH:
            break  # a container below the deepest allowed level
        level = nxt
    return f"request body is nested deeper than {MAX_JSON_DEPTH} levels"


class RequestGuard:
    """ASGI middleware: header limits, JSON bodies only, size and read-time limits, cancel on disconnect.

    Buffers the body (JSON bodies are small), checks it, then replays it to the app."""

    def __init__(self, app, max_body_bytes: int, body_timeout: float) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers", [])
        if len(headers) > MAX_HEADERS or sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES:
            resp = error_response(431, f"at most {MAX_HEADERS} headers of {MAX_HEADER_BYTES} bytes in all")
            return await resp(scope, receive, send)
        body = b""
        if scope["method"] in BODY_METHODS:
            problem, body = await self._read_body(scope, receive)
            if problem is not None:
                if problem[0] == 0:
                    return  # the client went away while sending
                resp = error_response(*problem)
                return await resp(scope, receive, send)
        large = len(body) >= TRIM_BODY_BYTES
        try:
            return await self._run(scope, receive, send, body)
        finally:
            if large:  # its parsed prompt and token ids are garbage now: give the pages back (kvmesh/common/heap.py)
                del body
                await asyncio.to_thread(trim_heap)

    async def _read_body(self, scope, receive) -> tuple[tuple[int, str] | None, bytes]:
        ctype, length = b"", None
        for k, v in scope.get("headers", []):
            if k == b"content-type":
                ctype = v
            elif k == b"content-length":
                length = v
        media = ctype.split(b";", 1)[0].strip().lower()
        if media and media != b"application/json" and not media.endswith(b"+json"):
            return (400, f"Content-Type must be application/json, got {ctype.decode('latin-1')!r}"), b""
        try:
            if length is not None and int(length) > self.limit:
                return (413, f"request body exceeds the limit of {self.limit} bytes"), b""
        except ValueError:
            return (400, "invalid Content-Length"), b""
        body = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    msg = await receive()
                    if msg["type"] != "http.request":
                        return (0, ""), b""
                    body += msg.get("body", b"")
                    if len(body) > self.limit:
                        return (413, f"request body exceeds the limit of {self.limit} bytes"), b""
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            return (408, f"the request body did not arrive within {self.body_timeout:g} s"), b""
        if body:
            problem = json_depth_error(bytes(body))
            if problem is not None:
                return (400, problem), b""
        return None, bytes(body)

    async def _run(self, scope, receive, send, body: bytes) -> None:
        gone = asyncio.Event()
        replayed = False
        started = complete = False

        async def app_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def app_send(msg):
            nonlocal complete, started
            started = True
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                complete = True
            await send(msg)

        app = asyncio.ensure_future(self.app(scope, app_receive, app_send))

        async def watch():
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone.set()
                    if not complete:
                        app.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await app
        except asyncio.CancelledError:
            if not gone.is_set():  # cancelled from outside (shutdown), not by a client that left
                raise
        except Exception as e:  # a bug, never bad input: still an answer in the OpenAI schema
            log.exception("unhandled error")
            if not started:
                await error_response(500, f"internal error: {type(e).__name__}")(scope, receive, send)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
