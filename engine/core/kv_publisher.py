"""KV-event publisher: the engine's half of the global prefix index.

The engine loop must never wait on a subscriber, so `KVEventPublisher.publish`
only puts the step's events on a bounded queue; a daemon thread owns the ZMQ
sockets (they are not thread-safe), numbers the batches, sends them and keeps
the last ``buffer_steps`` of them in a ring buffer for replay.

Wire (vLLM's `ZmqEventPublisher`, layout pinned in `kv_events.py`):

* PUB: multipart ``(topic, seq as 8-byte big-endian, msgpack KVEventBatch)``;
  ``seq`` starts at 0 and grows by one per batch, so a subscriber sees a gap
  as a jump and a restart as a drop.
* ROUTER replay: a request ``(identity, b"", start_seq 8-byte big-endian)`` gets
  every buffered ``(identity, b"", seq, payload)`` with ``seq >= start_seq``,
  then ``(identity, b"", -1 as signed 8 bytes, b"")``. A subscriber uses a
  DEALER (or REQ-style envelope) to ask.

Both sockets are always bound: the pod owns its ports and subscribers (the
router, which learns pods from its static list or from EndpointSlices) connect.
With a `CurveKeys` (from the shared secret, see `kv_events_auth`) both are CURVE
servers whose ZAP handler admits only the router's key: the stream carries every
cached prompt's token ids. Without one they are plain and anyone who reaches the
port reads them, so the publisher warns.
When the queue is full (the thread is behind) batches are dropped and counted,
but they still consume sequence numbers: the resulting gap is one the replay
socket cannot fill, so a subscriber resyncs rather than trusting a stale index.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from kvmesh.common.kv_events_auth import CurveKeys, start_zap

log = logging.getLogger("kvmesh.engine.core.kv_publisher")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def make_topic(pod: str, model: str) -> str:
    """Topic naming the pod and the model, e.g. ``kv@pod-0@SmolLM2-135M``; '@' separates because names may hold '/'."""
    return f"kv@{pod}@{model}"


@dataclass(frozen=True)
class PublisherConfig:
    endpoint: str  # e.g. tcp://*:5557
    replay_endpoint: str | None = None  # e.g. tcp://*:5558 (None: no replay)
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the thread before we drop
    keys: CurveKeys | None = None  # CURVE: only the router reads (None: plain sockets, anyone who connects)


class KVEventPublisher:
    def __init__(self, cfg: PublisherConfig, ctx: zmq.Context | None = None) -> None:
        self.cfg = cfg
        # The ZAP handler is per context: with CURVE the publisher owns one, so no other socket shares it.
        self._own_ctx = ctx is None or cfg.keys is not None
        self.ctx: zmq.Context = zmq.Context() if ctx is None or self._own_ctx else ctx
        self._auth = None
        self.zap = None  # the RouterOnly check (its `refused` counts unknown subscribers)
        if cfg.keys is not None:
            self._auth, self.zap = start_zap(self.ctx, cfg.keys)
        else:
            log.warning(
                "KV events on %s are not authenticated: any process that reaches it reads every cached "
                "prompt's token ids; set KVMESH_KV_AUTH_KEY (or --kv-auth-key-file) on pods and router",
                cfg.endpoint,
            )
        self._q: queue.Queue[KVEventBatch | None] = queue.Queue(cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self.next_seq = 0
        self.dropped = 0
        self._lost = 0  # drops not yet turned into a sequence gap (read and reset by the thread)
        self.published = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            if self._auth is not None:
                self._auth.stop()
            if self._own_ctx:
                self.ctx.term()
            raise RuntimeError(f"KV event publisher failed to start: {self._error}") from self._error

    # ---- engine side (any thread, never blocks) -----------------------------
    def publish(self, events: Sequence[BlockStored | BlockRemoved | AllBlocksCleared], ts: float | None = None) -> bool:
        if not events:
            return True
        try:
            self._q.put_nowait(KVEventBatch(ts=time.time() if ts is None else ts, events=list(events)))
            return True
        except queue.Full:
            self.dropped += 1
            self._lost += 1
            return False

    def close(self, timeout: float = 2.0) -> None:
        """Flush what is queued (bounded by ``timeout``), then close the sockets."""
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx:
            self.ctx.term()

    # ---- the thread ---------------------------------------------------------
    def _open(self, kind: int, endpoint: str) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        if self.cfg.keys is not None:
            self.cfg.keys.make_server(s)
        try:
            s.bind(endpoint)
        except BaseException:
            s.close(linger=0)  # an open socket would keep the context's term() waiting
            raise
        return s

    def _run(self) -> None:
        pub = None
        try:
            pub = self._open(zmq.PUB, self.cfg.endpoint)
            replay = self._open(zmq.ROUTER, self.cfg.replay_endpoint) if self.cfg.replay_endpoint else None
        except BaseException as e:  # bad endpoint / port in use: reported to the constructor
            if pub is not None:
                pub.close(linger=0)
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        topic = self.cfg.topic.encode()
        try:
            while True:
                if replay is not None:
                    while replay.poll(0):
                        self._serve_replay(replay)
                try:
                    batch = self._q.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                payload = encode_batch(batch)
                if self._lost:  # dropped batches still consume sequence numbers: subscribers must see the gap
                    lost, self._lost = self._lost, 0
                    self.next_seq += lost
                seq = self.next_seq
                self.next_seq += 1
                self._buffer.append((seq, payload))
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self.published += 1
        except Exception:  # never take the engine down; subscribers will see the gap and resync
            log.exception("KV event publisher thread failed")
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid replay request with %d frames", len(frames))
            return
        ident, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((ident, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((ident, b"", END_SEQ, b""))
