"""The NIXL connector's side channel: MAC'd msgpack requests over ZMQ between a decode and a prefill engine.

A prefill engine answers on a ROUTER socket from one daemon thread; a decode engine asks with one
short-lived REQ socket per round trip, bounded by a timeout. Requests (each a msgpack map, plus the
``ts`` and ``nonce`` fields every request carries):

* ``{"op": "meta"}`` -> ``{"ok": true, "meta": {...}}``: the agent metadata and KV layout
  (``PROTOCOL_VERSION``, engine id, agent name and metadata, pool address, block count and bytes,
  layout signature, memory type, device, model identity);
* ``{"op": "claim", "transfer_id", "block_ids", "timeout_s"}`` -> ``{"ok": true, "meta": {...},
  "block_hashes": [...]}``: the reader takes a held transfer (naming exactly the blocks held for it),
  its lease is extended to cover the read (never past twice the lease), and it learns the chained
  hashes of the held blocks, which it compares with its own before reading;
* ``{"op": "release", "transfer_id"}`` -> ``{"ok": true}``: the reader needs the blocks no more;
* any failure -> ``{"ok": false, "error": "..."}``.

Authentication: every frame is ``msgpack([payload, mac])`` where ``payload`` is the message's msgpack
bytes and ``mac`` is HMAC-SHA256 over a label, the direction and ``payload``, keyed by the shared
secret (``KVMESH_KV_AUTH_KEY``). A request carries a wall-clock ``ts`` and a random ``nonce``: the
server refuses one outside ``MAX_SKEW_S`` or whose nonce it has seen (no replay); a reply carries
``re`` = the request's nonce, so a captured reply cannot answer another request. A message without a
valid MAC gets an unsigned error and nothing else; a reply without one is refused by the asker.

A finished READ is announced with a NIXL notification ``DONE_PREFIX + transfer id``, not on this channel.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

log = logging.getLogger("kvmesh.connector.nixl")

PROTOCOL_VERSION = 2
DONE_PREFIX = b"kvmesh/done/"
MAX_SKEW_S = 60.0  # a request older (or newer) than this by the server's clock is refused
_LABEL = b"kvmesh-nixl-side-channel/v2\x00"
REQUEST, REPLY = b"req\x00", b"rep\x00"
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


class AuthError(RuntimeError):
    """A message without a valid MAC, stale, replayed, or a reply to another request."""


class Signer:
    """Seals and opens side-channel frames with the shared secret."""

    def __init__(self, key: bytes) -> None:
        if not key:
            raise ValueError("the side channel needs a non-empty key")
        self._key = bytes(key)

    def _mac(self, direction: bytes, payload: bytes) -> bytes:
        return hmac.new(self._key, _LABEL + direction + payload, hashlib.sha256).digest()

    def seal(self, direction: bytes, body: dict) -> bytes:
        payload = _enc.encode(body)
        return _enc.encode([payload, self._mac(direction, payload)])

    def open(self, direction: bytes, frame: bytes) -> dict:
        """The message in ``frame`` if its MAC is valid; AuthError otherwise."""
        try:
            outer = _dec.decode(frame)
        except Exception:
            raise AuthError("not a sealed message") from None
        if isinstance(outer, dict):  # an unsigned message: a peer without (or with another) secret
            err = str(outer.get("error", ""))[:200]
            raise AuthError("unsigned message" + (f" ({err})" if err else ""))
        if not (isinstance(outer, list) and len(outer) == 2 and all(isinstance(x, bytes) for x in outer)):
            raise AuthError("not a sealed message")
        payload, mac = outer
        if not hmac.compare_digest(mac, self._mac(direction, payload)):
            raise AuthError("wrong MAC (do both engines share the same KV auth key?)")
        body = _dec.decode(payload)
        if not isinstance(body, dict):
            raise AuthError("sealed payload is not a map")
        return body


class ReplayGuard:
    """Nonces seen within the last ``2 * MAX_SKEW_S``: a request is accepted once, and only while fresh."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}
        self._next_prune = 0.0

    def check(self, body: dict, now: float) -> str | None:
        """Why ``body`` must be refused (stale, replayed, malformed); None if fresh. Records its nonce."""
        ts, nonce = body.get("ts"), body.get("nonce")
        if not isinstance(ts, float | int) or isinstance(ts, bool) or not isinstance(nonce, str) or len(nonce) < 16:
            return "no timestamp or nonce"
        if not abs(now - ts) <= MAX_SKEW_S:
            return f"stale request (timestamp {now - ts:+.1f}s off; are the clocks in sync?)"
        if now >= self._next_prune:
            self._seen = {n: t for n, t in self._seen.items() if now - t <= 2 * MAX_SKEW_S}
            self._next_prune = now + 1.0
        if nonce in self._seen:
            return "replayed request"
        self._seen[nonce] = now
        return None


class SideChannelServer:
    """The prefill side's ROUTER socket and the thread that answers it with ``handler(message) -> reply``.

    Only requests with a valid MAC, fresh and never seen before, reach ``handler``; every other one is
    answered with an unsigned error and reported to ``on_reject(reason)``."""

    def __init__(
        self,
        ctx: zmq.Context,
        host: str,
        port: int,
        handler: Callable[[dict], dict],
        signer: Signer,
        on_reject: Callable[[str], None],
    ) -> None:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if port:
            sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = sock.bind_to_random_port(f"tcp://{host}")
        self._handler = handler
        self._signer = signer
        self._on_reject = on_reject
        self._replay = ReplayGuard()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(sock,), name="kvmesh-nixl-side", daemon=True)
        self._thread.start()

    def answer(self, frame: bytes) -> bytes:
        """The reply frame to one request frame."""
        try:
            msg = self._signer.open(REQUEST, frame)
        except AuthError as e:
            self._on_reject(str(e))
            return _enc.encode({"ok": False, "error": "unauthenticated: the request has no valid MAC"})
        problem = self._replay.check(msg, time.time())
        if problem is not None:
            self._on_reject(problem)
            return _enc.encode({"ok": False, "error": f"refused: {problem}"})
        try:
            reply = self._handler(msg)
        except Exception as e:  # a malformed message gets an error, never kills the thread
            reply = {"ok": False, "error": f"bad request: {e}"}
        return self._signer.seal(REPLY, {**reply, "re": msg["nonce"]})

    def _serve(self, sock: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                try:
                    out = self.answer(frames[-1])
                except Exception as e:  # never kill the thread
                    out = _enc.encode({"ok": False, "error": f"bad request: {e}"})
                sock.send_multipart([frames[0], b"", out])
        finally:
            sock.close(0)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)


def seal_request(signer: Signer, msg: dict) -> tuple[bytes, str]:
    """A request frame (``msg`` + a fresh ``ts`` and ``nonce``) and its nonce."""
    nonce = secrets.token_hex(16)
    return signer.seal(REQUEST, {**msg, "ts": time.time(), "nonce": nonce}), nonce


def request(ctx: zmq.Context, host: str, port: int, msg: dict, timeout_s: float, signer: Signer) -> dict:
    """One bounded, authenticated REQ/REP round trip with the side channel at ``host:port`` (any thread).

    Raises AuthError when the reply has no valid MAC or answers another request."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        frame, nonce = seal_request(signer, msg)
        sock.send(frame)
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from the side channel tcp://{host}:{port} within {timeout_s:.1f}s")
        reply = signer.open(REPLY, sock.recv())
        if reply.get("re") != nonce:
            raise AuthError("the reply answers another request (replayed)")
        return reply
    finally:
        sock.close(0)
