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

Batches come in either of vLLM's forms (kvmesh.common.kv_events: named-field maps, or v0.10's
positional arrays), told apart per message and counted per form. A pod's first blocks
(``parent_block_hash`` None) also tell which block-hash scheme it runs (kvmesh's or vLLM's,
`hashing.scheme_of_root_block`): the event carries the tokens and the extra keys that entered the
hash, so the router checks which scheme reproduces it and reports it (``on_scheme``), and hashes
prompts the same way (`Router.prefix_hash`).

The pods bind, the hub connects (to the endpoints of the static list or of the
EndpointSlices). With `CurveKeys` every SUB and replay socket is a CURVE client:
the pods admit only the routers' key. A socket monitor per pod tracks whether
the handshake succeeded, so a stream that never came up (wrong or missing
secret, nothing listening) shows as not connected instead of as a quiet pod;
only a connected pod counts as exact in the index (`PrefixIndex.mark_exact`),
the others keep the approximate mode's predicted entries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvmesh.common.hashing import scheme_of_root_block
from kvmesh.common.kv_events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch_form
from kvmesh.common.kv_events_auth import CurveKeys

from .index import PrefixIndex

log = logging.getLogger("kvmesh.router.events")

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED


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
    monitor: zmq.Socket
    last_seq: int | None = None
    connected: bool = False  # the (CURVE) handshake with the pod's PUB socket succeeded and it has not dropped
    handshake_failures: int = 0  # refused by the pod (wrong secret) or a security mismatch (one side plain)
    last_batch_at: float | None = None  # time.time() of the last batch applied
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    restarts: int = 0
    prefix_hash: str | None = None  # the block-hash scheme its root blocks showed (None: not seen yet)


@dataclass(frozen=True)
class PodStream:
    """A snapshot of one pod's stream for `/pods` and the metrics."""

    connected: bool
    batches: int
    handshake_failures: int
    last_batch_age_s: float | None


@dataclass
class EventStats:
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    restarts: int = 0
    decode_errors: int = 0
    per_pod: dict = field(default_factory=dict)
    forms: dict[str, int] = field(default_factory=dict)  # batches by wire form ("map", "array")


class EventHub:
    def __init__(
        self,
        index: PrefixIndex,
        replay_timeout: float = 2.0,
        on_event: Callable[[str, str], None] | None = None,
        keys: CurveKeys | None = None,
        on_batch: Callable[[str], None] | None = None,
        on_form: Callable[[str, str], None] | None = None,
        on_scheme: Callable[[str, str | None], None] | None = None,
    ) -> None:
        self.index = index
        self.replay_timeout_ms = int(replay_timeout * 1000)
        self.on_event = on_event  # (pod, kind) -> None, for metrics
        self.on_batch = on_batch  # (pod) -> None, once per batch received (live or replayed)
        self.on_form = on_form  # (pod, "map" | "array") -> None, once per batch decoded
        self.on_scheme = on_scheme  # (pod, "kvmesh" | "vllm" | None): a pod's hash scheme learned (or reset)
        self.keys = keys  # CURVE client keys; None: plain sockets (pods without a secret)
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

    def pod_prefix_hash(self, pod: str) -> str | None:
        s = self._by_pod.get(pod)
        return None if s is None else s.prefix_hash

    def pod_stream(self, pod: str) -> PodStream | None:
        s = self._by_pod.get(pod)
        if s is None:
            return None
        age = None if s.last_batch_at is None else max(0.0, time.time() - s.last_batch_at)
        return PodStream(s.connected, s.batches, s.handshake_failures, age)

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
                if self.keys is not None:
                    self.keys.make_client(sock)
                monitor = sock.get_monitor_socket(_MONITORED)
                try:
                    sock.connect(endpoint)  # pods bind their PUB socket; the router always connects
                except zmq.ZMQError as e:
                    log.error("pod %s: bad KV-event endpoint %r: %s", pod, endpoint, e)
                    sock.disable_monitor()
                    monitor.close(linger=0)
                    sock.close(linger=0)
                    continue
                sub = _Sub(pod, model, endpoint, replay, sock, monitor)
                self._subs[sock] = sub
                self._subs[monitor] = sub
                self._by_pod[pod] = sub
                poller.register(sock, zmq.POLLIN)
                poller.register(monitor, zmq.POLLIN)
            else:
                gone = self._by_pod.pop(item, None)
                if gone is not None:
                    for s in (gone.sock, gone.monitor):
                        poller.unregister(s)
                        del self._subs[s]
                    gone.sock.disable_monitor()
                    gone.monitor.close(linger=0)
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
                if sock is sub.monitor:
                    self._on_monitor(sub)
                    continue
                for _ in range(1000):  # bounded drain per socket, fair across pods
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(sub, frames)
        for sub in list(self._by_pod.values()):
            sub.sock.disable_monitor()
            sub.monitor.close(linger=0)
            sub.sock.close(linger=0)

    def _on_monitor(self, sub: _Sub) -> None:
        while True:
            try:
                ev = parse_monitor_message(sub.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if not sub.connected:
                    log.info("KV events of %s connected (%s)", sub.pod, "CURVE" if self.keys else "plain")
                sub.connected = True
                self.index.mark_exact(sub.pod)  # predicted entries now expire: the events take over
            elif ev == zmq.EVENT_DISCONNECTED:
                sub.connected = False
                self.index.mark_exact(sub.pod, False)  # until it is back, predictions are all we have
            elif ev & _HANDSHAKE_FAILED:
                sub.connected = False
                self.index.mark_exact(sub.pod, False)
                sub.handshake_failures += 1
                if sub.handshake_failures == 1:
                    log.error(
                        "KV events of %s: handshake refused (%s); the router and the pods need the same "
                        "KVMESH_KV_AUTH_KEY; routing to this pod uses the approximate index until it connects",
                        sub.pod,
                        "router has a secret" if self.keys else "router has no secret",
                    )

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
            self._set_scheme(sub, None)  # a restarted pod may run another scheme: learn it again
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
        if self.keys is not None:
            self.keys.make_client(dealer)
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

    def _set_scheme(self, sub: _Sub, scheme: str | None) -> None:
        if scheme == sub.prefix_hash:
            return
        sub.prefix_hash = scheme
        if scheme is not None:
            log.info("pod %s hashes blocks the %s way (from its KV events)", sub.pod, scheme)
        if self.on_scheme is not None:
            self.on_scheme(sub.pod, scheme)

    def _learn_scheme(self, sub: _Sub, ev: BlockStored) -> None:
        """A root block (no parent, no adapter) shows which scheme the pod hashes with."""
        if ev.parent_block_hash is not None or ev.lora_name is not None or not ev.block_hashes:
            return
        keys = ev.extra_keys[0] if ev.extra_keys else None
        scheme = scheme_of_root_block(ev.block_hashes[0], ev.token_ids[: ev.block_size], keys, sub.model)
        if scheme is not None:
            self._set_scheme(sub, scheme)

    def _apply(self, sub: _Sub, seq: int, payload: bytes) -> None:
        try:
            batch, form = decode_batch_form(payload)
        except (msgspec.DecodeError, IndexError):
            self.stats.decode_errors += 1
            sub.last_seq = seq
            return
        self.stats.forms[form] = self.stats.forms.get(form, 0) + 1
        if self.on_form is not None:
            self.on_form(sub.pod, form)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if sub.prefix_hash is None and ev.medium != MEDIUM_CPU:  # a host copy carries no tokens
                    self._learn_scheme(sub, ev)
                self.index.stored(sub.pod, sub.model, ev.block_hashes, ev.medium)
                kind = "stored"
            elif isinstance(ev, BlockRemoved):
                self.index.removed(sub.pod, sub.model, ev.block_hashes, ev.medium)
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
        sub.last_batch_at = time.time()
        self.stats.batches += 1
        if self.on_batch is not None:
            self.on_batch(sub.pod)
