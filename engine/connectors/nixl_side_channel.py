"""The NIXL connector's side channel: msgpack requests over ZMQ between a decode and a prefill engine.

A prefill engine answers on a ROUTER socket from one daemon thread; a decode engine asks with one
short-lived REQ socket per round trip, bounded by a timeout. Messages (each a msgpack map):

* ``{"op": "meta"}`` -> ``{"ok": true, "meta": {...}}``: the agent metadata and KV layout
  (``PROTOCOL_VERSION``, engine id, agent name and metadata, pool address, block count and bytes,
  layout signature, memory type, device, model identity);
* ``{"op": "claim", "transfer_id", "block_ids", "timeout_s"}`` -> ``{"ok": true, "meta": {...}}``:
  the reader takes a held transfer and its lease is extended to cover the read;
* ``{"op": "release", "transfer_id"}`` -> ``{"ok": true}``: the reader needs the blocks no more;
* any failure -> ``{"ok": false, "error": "..."}``.

A finished READ is announced with a NIXL notification ``DONE_PREFIX + transfer id``, not on this channel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec
import zmq

PROTOCOL_VERSION = 1
DONE_PREFIX = b"kvmesh/done/"
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


class SideChannelServer:
    """The prefill side's ROUTER socket and the thread that answers it with ``handler(message) -> reply``."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, handler: Callable[[dict], dict]) -> None:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if port:
            sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = sock.bind_to_random_port(f"tcp://{host}")
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(sock,), name="kvmesh-nixl-side", daemon=True)
        self._thread.start()

    def _serve(self, sock: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                try:
                    reply = self._handler(_dec.decode(frames[-1]))
                except Exception as e:  # a malformed message gets an error, never kills the thread
                    reply = {"ok": False, "error": f"bad request: {e}"}
                sock.send_multipart([frames[0], b"", _enc.encode(reply)])
        finally:
            sock.close(0)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)


def request(ctx: zmq.Context, host: str, port: int, msg: dict, timeout_s: float) -> dict:
    """One bounded REQ/REP round trip with the side channel at ``host:port`` (any thread)."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(_enc.encode(msg))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from the side channel tcp://{host}:{port} within {timeout_s:.1f}s")
        return _dec.decode(sock.recv())
    finally:
        sock.close(0)
