"""The uvicorn configuration every kvmesh HTTP server runs with (API server, router, test servers),
and the one limit uvicorn lacks: a deadline for a request's headers.

`RequestGuard` bounds the headers' size and the body's size and arrival time, but an app sees a
request only once its headers are complete, so nothing there bounds the time headers take: a
client that sends one header line every few seconds, or connects and sends nothing, holds its
connection for ever. A few thousand such clients (slowloris) hold every
file descriptor of the process. `header_deadline_protocol` gives every request ``header_timeout``
seconds from its first byte (or from the connection's start, for the first request) to complete its
headers; past that a request that has begun gets a 408 in the OpenAI error schema and the
connection is closed, an idle connection is just closed. Between requests of a kept-alive
connection uvicorn's own keep-alive timeout applies.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import Any

log = logging.getLogger("kvmesh.http")

DEFAULT_HEADER_TIMEOUT = 10.0


def _timeout_response() -> bytes:
    """The raw 408 written before closing (no app has seen the request): services/errors.py's body."""
    from kvmesh.services.errors import error_body  # fastapi: only where a server runs

    body = json.dumps(error_body(408, "request headers did not arrive in time")).encode()
    head = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    return head + body


@functools.cache
def header_deadline_protocol(header_timeout: float) -> type:
    """httptools' protocol with a deadline of ``header_timeout`` s for each request's headers (see the
    module docstring). Built on first use: importing this module must not need uvicorn (the operator's
    image has none, and the config modules declare the default from here)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_timer: asyncio.TimerHandle | None = None
            self._request_begun = False
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self._request_begun:
                log.info("closing a connection whose request headers took over %.0f s", header_timeout)
                self.transport.write(_timeout_response())
            self.transport.close()

        def on_message_begin(self) -> None:
            self._request_begun = True
            self._arm()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._disarm()
            self._request_begun = False
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol


def server_config(app: Any, host: str, port: int, header_timeout: float = DEFAULT_HEADER_TIMEOUT, **kw: Any):
    """``uvicorn.Config`` for ``app`` with the header deadline (``kw``: any other uvicorn option)."""
    import uvicorn

    if header_timeout <= 0:
        raise ValueError("header_timeout must be > 0")
    http = header_deadline_protocol(float(header_timeout))
    return uvicorn.Config(app, host=host, port=port, http=http, lifespan="off", **kw)


def include_routes(app: Any, *routers: Any) -> None:
    """Add each `fastapi.APIRouter`'s routes to ``app``, in order, as ``app.include_router`` would
    without its per-request cost: FastAPI (0.16x) dispatches an included router through a wrapper
    that matches the path again, about 15 µs a request (measured), where these routes are plain
    ``APIRoute`` objects the app can serve as they are. (They see no ``app.dependency_overrides``;
    nothing here uses those.)"""
    for r in routers:
        app.router.routes.extend(r.routes)
