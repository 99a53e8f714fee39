"""KV-event subscription: every pod's PUB stream into the `PrefixIndex`.

One thread polls the SUB sockets of all pods (a thread per pod would not scale
to hundreds of pods). Per pod it tracks the last sequence number applied:

* ``seq == last + 1``: apply.
* ``seq > last + 1``: a gap (slow subscriber, dropped messages, late join).
  Ask the pod's replay socket for ``last + 1`` onward and apply what comes back;
  if the replay cannot cover the gap (no replay socket, buffer rolled over,
  timeout), the pod's index entries can no longer be trusted: clear them and
  start over from the current message (a resync). Counted either way.
* ``seq <= last``: the pod restarted (its sequence starts at 0 again), so its
  cache is empty: clear it.

The first message from a pod triggers a replay from 0, so a router started
after its pods learns what they already hold (as far as the ring buffer goes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from kvmesh.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch

from .index import PrefixIndex

log = logging.getLogger("kvmesh.router.events")


@dataclass(frozen=True)
class _PodAdd:
    """A pod to subscribe to, queued by add_pod for the hub's thread."""

    pod: str
    model: str
    endpoint: str
    replay_endpoint: str | None


@dataclass
class _Sub:
    pod: str
    model: str
    endpoint: str
    replay_endpoint: str | None
    sock: zmq.Socket
    last_seq: int | None = None
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    restarts: int = 0


@dataclass
class EventStats:
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    restarts: int = 0
    decode_errors: int = 0
    per_pod: dict = field(default_factory=dict)


class EventHub:
    def __init__(
        self, index: PrefixIndex, replay_timeout: float = 2.0, on_event: Callable[[str, str], None] | None = None
    ) -> None:
        self.index = index
        self.replay_timeout_ms = int(replay_timeout * 1000)
        self.on_event = on_event  # (pod, kind) -> None, for metrics
        self.ctx = zmq.Context()
        self.stats = EventStats()
        self._subs: dict[zmq.Socket, _Sub] = {}
        self._by_pod: dict[str, _Sub] = {}
        self._lock = threading.Lock()
        self._pending: list[_PodAdd | str] = []  # a pod to add, or the name of one to remove
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-hub", daemon=True)
        self._thread.start()

    # ---- membership (any thread) --------------------------------------------
    def add_pod(self, pod: str, model: str, endpoint: str, replay_endpoint: str | None) -> None:
        with self._lock:
            self._pending.append(_PodAdd(pod, model, endpoint, replay_endpoint))

    def remove_pod(self, pod: str) -> None:
        with self._lock:
            self._pending.append(pod)

    def pod_seq(self, pod: str) -> int | None:
        s = self._by_pod.get(pod)
        return None if s is None else s.last_seq

    def close(self) -> None:
        self._stop.set()
        self._thread.join(3)
        self.ctx.term()

    # ---- the thread ---------------------------------------------------------
    def _apply_membership(self, poller: zmq.Poller) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for item in pending:
            if isinstance(item, _PodAdd):
                pod, model, endpoint, replay = item.pod, item.model, item.endpoint, item.replay_endpoint
                if pod in self._by_pod:
                    continue
                sock = self.ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 100_000)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                # a pod that binds (the default) is connected to; "*" means the pod connects to us
                (sock.bind if "*" in endpoint else sock.connect)(endpoint)
                sub = _Sub(pod, model, endpoint, replay, sock)
                self._subs[sock] = sub
                self._by_pod[pod] = sub
                poller.register(sock, zmq.POLLIN)
                self.index.mark_exact(pod)
            else:
                gone = self._by_pod.pop(item, None)
                if gone is not None:
                    poller.unregister(gone.sock)
                    del self._subs[gone.sock]
                    gone.sock.close(linger=0)
                    self.index.mark_exact(gone.pod, False)
                    self.index.clear_pod(gone.pod)

    def _run(self) -> None:
        poller = zmq.Poller()
        while not self._stop.is_set():
            self._apply_membership(poller)
            try:
                ready = dict(poller.poll(100)) if self._subs else {}
            except zmq.ZMQError:
                break
            if not self._subs:
                self._stop.wait(0.1)
                continue
            for sock in ready:
                sub = self._subs.get(sock)
                if sub is None:
                    continue
                for _ in range(1000):  # bounded drain per socket, fair across pods
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(sub, frames)
        for sub in list(self._by_pod.values()):
            sub.sock.close(linger=0)

    def _on_message(self, sub: _Sub, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.stats.decode_errors += 1
            return
        _, seq_b, payload = frames
        seq = int.from_bytes(seq_b, "big")
        last = sub.last_seq
        if last is not None and seq <= last:
            # sequence went back: the pod restarted with an empty cache
            sub.restarts += 1
            self.stats.restarts += 1
            self.index.clear_pod(sub.pod)
            sub.last_seq = last = None
        expected = 0 if last is None else last + 1
        if seq > expected:
            sub.gaps += 1
            self.stats.gaps += 1
            if not self._replay(sub, expected, seq) and last is not None:
                # we had state and lost part of the stream: what we hold for this pod is stale
                sub.resyncs += 1
                self.stats.resyncs += 1
                self.index.clear_pod(sub.pod)
        self._apply(sub, seq, payload)

    def _replay(self, sub: _Sub, start: int, upto: int) -> bool:
        """Fetch ``[start, upto)`` from the pod's replay socket; True if the whole range was applied."""
        if not sub.replay_endpoint:
            return False
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        got: list[tuple[int, bytes]] = []
        try:
            dealer.connect(sub.replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not dealer.poll(self.replay_timeout_ms):
                    log.warning("replay from %s timed out", sub.replay_endpoint)
                    return False
                frames = dealer.recv_multipart()
                if len(frames) != 3:
                    return False
                _, seq_b, payload = frames
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq < 0:
                    break
                if seq < upto:
                    got.append((seq, payload))
        finally:
            dealer.close(linger=0)
        complete = (
            bool(got)
            and got[0][0] == start
            and all(b[0] == a[0] + 1 for a, b in zip(got, got[1:]))
            and got[-1][0] == upto - 1
        )
        if not complete and sub.last_seq is not None:
            return False
        if not complete:
            # late join: the older part of the stream is gone; apply the contiguous tail we have
            tail: list[tuple[int, bytes]] = []
            for s, p in reversed(got):
                if tail and s != tail[-1][0] - 1:
                    break
                tail.append((s, p))
            got = list(reversed(tail)) if tail and tail[0][0] == upto - 1 else []
        for s, p in got:
            self._apply(sub, s, p)
        sub.replayed += len(got)
        self.stats.replayed += len(got)
        return complete

    def _apply(self, sub: _Sub, seq: int, payload: bytes) -> None:
        try:
            batch: KVEventBatch = decode_batch(payload)
        except msgspec.DecodeError:
            self.stats.decode_errors += 1
            sub.last_seq = seq
            return
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.index.stored(sub.pod, sub.model, ev.block_hashes)
                kind = "stored"
            elif isinstance(ev, BlockRemoved):
                self.index.removed(sub.pod, sub.model, ev.block_hashes)
                kind = "removed"
            elif isinstance(ev, AllBlocksCleared):
                self.index.clear_pod(sub.pod)
                kind = "cleared"
            else:
                continue
            if self.on_event is not None:
                self.on_event(sub.pod, kind)
        sub.last_seq = seq
        sub.batches += 1
        self.stats.batches += 1
