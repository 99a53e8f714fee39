"""The router's one HTTP client to its pods (requests, health probes, ``/metrics`` scrapes, ``/v1/models``).

Every call carries the router's own key (``--upstream-api-key-file`` / ``$KVMESH_UPSTREAM_API_KEY``)
as ``Authorization: Bearer``, never a client's.

An aiohttp session whose failures all come out as `UpstreamError`, named so that the caller can
tell a pod that is gone (retry elsewhere, mark it down) from one that is slow.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import aiohttp
import msgspec

from kvmesh.common import tracing

_JSON_HEADERS = {"Content-Type": "application/json"}


class UpstreamError(Exception):
    """A pod exchange failed. ``reason`` names the failure (the ``retries`` metric label); ``gone`` means
    the pod refused, reset or closed the connection (it is down), ``timeout`` that it was too slow."""

    def __init__(self, reason: str, detail: str, gone: bool = False, timeout: bool = False) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.gone, self.timeout = reason, gone, timeout


def _upstream_error(e: Exception) -> UpstreamError:
    # reason names are those of the earlier httpx client, so dashboards keep their series
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return UpstreamError("ConnectTimeout", str(e), gone=True, timeout=True)
    if isinstance(e, aiohttp.ClientConnectorError):
        return UpstreamError("ConnectError", str(e), gone=True)
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamError("ReadTimeout", str(e) or type(e).__name__, timeout=True)
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientResponseError)):  # closed early, or garbled
        return UpstreamError("RemoteProtocolError", str(e), gone=True)
    if isinstance(e, aiohttp.ClientOSError):
        return UpstreamError("ReadError", str(e), gone=True)
    return UpstreamError(type(e).__name__, str(e))  # e.g. a truncated body (ClientPayloadError)


class UpstreamResponse:
    """A pod's response with headers read and the body still on the wire; `release` it exactly once
    (a body not read to the end closes its connection rather than returning it to the pool)."""

    __slots__ = ("_r", "status", "headers")

    def __init__(self, r: aiohttp.ClientResponse) -> None:
        self._r, self.status, self.headers = r, r.status, r.headers

    async def read(self) -> bytes:
        try:
            return await self._r.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _upstream_error(e) from e

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (de-chunked, not re-framed)."""
        try:
            async for chunk in self._r.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _upstream_error(e) from e

    def release(self) -> None:
        self._r.release()


class Upstream:
    """The router's one HTTP client to its pods: an aiohttp session with a keep-alive pool per pod.

    aiohttp takes an idle connection off a per-pod stack; httpx/httpcore (used before) polled every
    idle pooled connection's socket on each request, ~16% of the router's CPU under load. Timeouts:
    ``connect_timeout`` to open a connection, ``read_timeout`` between response bytes (per request
    overridable); `get` (probes, scrapes) has one overall limit."""

    KEEPALIVE_S = 4.0  # below uvicorn's 5 s idle close (vLLM, kvmesh serve): a reused connection is still open

    def __init__(
        self, connect_timeout: float, read_timeout: float, api_key: Callable[[], str | None] | None = None
    ) -> None:
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self._api_key = api_key  # the router's credential towards its pods (read per call: it rotates)
        self.session: aiohttp.ClientSession | None = None
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=4096, limit_per_host=0, keepalive_timeout=self.KEEPALIVE_S)
        self.session = aiohttp.ClientSession(
            connector=conn, cookie_jar=aiohttp.DummyCookieJar(), timeout=self._stream_timeout(self.read_timeout)
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def _headers(self, base: dict[str, str] | None = None) -> dict[str, str] | None:
        key = self._api_key() if self._api_key is not None else None
        if key is None:
            return base
        return {**(base or {}), "Authorization": f"Bearer {key}"}

    def _stream_timeout(self, read: float) -> aiohttp.ClientTimeout:
        t = self._timeouts.get(read)
        if t is None:  # ``connect`` bounds the wait for a pool slot plus the connect (httpx's pool timeout)
            t = self._timeouts[read] = aiohttp.ClientTimeout(
                total=None, connect=30.0, sock_connect=self.connect_timeout, sock_read=read
            )
        return t

    async def post(
        self,
        url: str,
        body: dict,
        read_timeout: float | None = None,
        bearer: str | None = None,
        extra: dict[str, str] | None = None,
    ) -> UpstreamResponse:
        """POST ``body`` as JSON; returns once the response headers are in. ``bearer``: a credential to
        send instead of the router's own key (the admin key, for an administrative endpoint); ``extra``:
        headers of the router's own to add (never a client's)."""
        assert self.session is not None
        headers = self._headers(_JSON_HEADERS)
        if bearer is not None:
            headers = {**_JSON_HEADERS, "Authorization": f"Bearer {bearer}"}
        if extra:
            headers = {**(headers or {}), **extra}
        headers = tracing.inject(headers or {})  # the current span's traceparent (off: unchanged)
        try:
            r = await self.session.post(
                url,
                data=msgspec.json.encode(body),
                headers=headers,
                timeout=self._stream_timeout(read_timeout or self.read_timeout),
            )
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _upstream_error(e) from e
        return UpstreamResponse(r)

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        """GET the whole response within ``timeout`` seconds: (status, body)."""
        assert self.session is not None
        try:
            async with self.session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout), headers=self._headers()
            ) as r:
                return r.status, await r.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _upstream_error(e) from e
