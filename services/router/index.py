"""Global prefix index: which pod holds which block, per model.

Two sources feed it:

* **exact**: KV events from each pod (`events.EventSubscriber` applies
  BlockStored / BlockRemoved / AllBlocksCleared);
* **predicted**: the router's own routing decisions. A request routed to pod P
  will leave its prompt blocks on P once prefilled, long before the events
  arrive. Recording them right away is what stops a burst of requests with
  the same new prefix from all seeing "nobody has it" and spraying, and what
  lets the next turn of a conversation follow the first. For pods that
  publish events these entries expire after ``pending_ttl`` seconds (the events
  take over); for pods with no event stream (approximate mode) they are the
  only source and live in a per-pod LRU of ``approx_capacity`` blocks.

Lookup answers, for each pod, the number of consecutive blocks from the start
of the request that the pod holds: the chain means the first miss ends the
usable prefix, as in the engine's `find_longest_cache_hit`.

The index also keeps each pod's **eviction pressure**: the blocks it reported
removed (BlockRemoved), exponentially decayed. A pod with a full cache evicts
as fast as new blocks arrive, and what it evicts are the prefixes of
conversations that have not come back yet; the router places new prefixes away
from such pods (`policy.score_pods`). Only an event-fed router sees this: the
approximate mode cannot know what a pod dropped. A cleared pod (restart,
resync, removal) resets its count; that is not pressure.

**Tiers**: a pod with a host-memory KV tier (``--kv-offload-gb``) publishes its moves with ``medium``
"CPU" (BlockStored when a block is offloaded, BlockRemoved when its host copy is dropped). Those go
to a second map, the host residency, and `match_host` counts the blocks a pod holds there right
after its device prefix (the pod's own lookup order: device, then host). A disk tier under the host
(``--kv-offload-disk-gb``) publishes medium "DISK" the same way, kept in a third map: the chain after
the device prefix takes each block from the host, else from the disk, and `match_host` says how many
of each (`TierHits`; the policy scores a disk block below a host block). Device ("GPU", or no
medium) events are handled exactly as without tiers, and only they count as eviction pressure.

All methods are thread-safe (event threads write, the HTTP loop reads).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvmesh.common.kv_events import MEDIUM_CPU, MEDIUM_DISK


def _unhold(holders: dict[int, set[str]], h: int, pod: str) -> None:
    """``pod`` no longer holds block ``h``; a hash nobody holds leaves the map (device and host tiers alike)."""
    pods = holders.get(h)
    if pods is not None:
        pods.discard(pod)
        if not pods:
            del holders[h]


class TierHits(dict[str, int]):
    """`PrefixIndex.match_host`'s answer: per pod, the blocks after its device hit it would load from
    its host tier (the mapping, as without a disk tier), and in ``disk`` those it would load from its
    disk tier (the chain goes on through either; a block both hold counts for the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.disk: dict[str, int] = {}


class PrefixIndex:
    def __init__(
        self, pending_ttl: float = 10.0, approx_capacity: int = 1 << 16, evict_halflife: float = 120.0
    ) -> None:
        self.pending_ttl = pending_ttl
        self.approx_capacity = approx_capacity
        self.evict_halflife = evict_halflife
        self._evicted: dict[str, tuple[float, float]] = {}  # pod -> (decayed removed blocks, as of monotonic t)
        self._lock = threading.Lock()
        # model -> block hash -> set of pods (exact, from events)
        self._exact: dict[str, dict[int, set[str]]] = {}
        # pod -> set of (model, hash) it holds (exact), for AllBlocksCleared / pod removal
        self._by_pod: dict[str, set[tuple[str, int]]] = {}
        # pod -> OrderedDict[(model, hash)] -> expiry (monotonic; inf for approximate pods)
        self._predicted: dict[str, OrderedDict[tuple[str, int], float]] = {}
        self._event_pods: set[str] = set()  # pods whose events we receive (exact mode)
        # the host tier (medium CPU): model -> hash -> pods, and pod -> (model, hash)
        self._host: dict[str, dict[int, set[str]]] = {}
        self._host_by_pod: dict[str, set[tuple[str, int]]] = {}
        # the disk tier under it (medium DISK), the same way
        self._disk: dict[str, dict[int, set[str]]] = {}
        self._disk_by_pod: dict[str, set[tuple[str, int]]] = {}

    # ---- exact (events) -----------------------------------------------------
    def mark_exact(self, pod: str, exact: bool = True) -> None:
        with self._lock:
            if exact:
                self._event_pods.add(pod)
            else:
                self._event_pods.discard(pod)

    def is_exact(self, pod: str) -> bool:
        return pod in self._event_pods

    def stored(self, pod: str, model: str, hashes: Iterable[int], medium: str | None = None) -> None:
        """``medium``: the event's; "CPU" is the pod's host tier, "DISK" its disk tier, anything else its device."""
        if medium in (MEDIUM_CPU, MEDIUM_DISK):
            self._tier_stored(medium, pod, model, hashes)
            return
        with self._lock:
            m = self._exact.setdefault(model, {})
            mine = self._by_pod.setdefault(pod, set())
            pred = self._predicted.get(pod)
            for h in hashes:
                m.setdefault(h, set()).add(pod)
                mine.add((model, h))
                if pred is not None:
                    pred.pop((model, h), None)  # confirmed: the event entry takes over

    def removed(self, pod: str, model: str, hashes: Iterable[int], medium: str | None = None) -> None:
        if medium in (MEDIUM_CPU, MEDIUM_DISK):
            self._tier_removed(medium, pod, model, hashes)
            return
        hashes = list(hashes)
        now = time.monotonic()
        with self._lock:
            self._evicted[pod] = (self._decayed(pod, now) + len(hashes), now)
            m = self._exact.get(model, {})
            mine = self._by_pod.get(pod, set())
            pred = self._predicted.get(pod)
            for h in hashes:
                _unhold(m, h, pod)
                mine.discard((model, h))
                if pred is not None:
                    pred.pop((model, h), None)

    def clear_pod(self, pod: str) -> None:
        """Forget everything about ``pod`` (AllBlocksCleared, restart, resync, removal)."""
        with self._lock:
            for model, h in self._by_pod.pop(pod, set()):
                _unhold(self._exact.get(model, {}), h, pod)
            self._predicted.pop(pod, None)
            self._evicted.pop(pod, None)
            for held, by_pod in ((self._host, self._host_by_pod), (self._disk, self._disk_by_pod)):
                for model, h in by_pod.pop(pod, set()):
                    _unhold(held.get(model, {}), h, pod)

    # ---- the tiers under the device (medium CPU and DISK) ------------------------
    def _tier_maps(self, medium: str) -> tuple[dict[str, dict[int, set[str]]], dict[str, set[tuple[str, int]]]]:
        return (self._host, self._host_by_pod) if medium == MEDIUM_CPU else (self._disk, self._disk_by_pod)

    def _tier_stored(self, medium: str, pod: str, model: str, hashes: Iterable[int]) -> None:
        held, by_pod = self._tier_maps(medium)
        with self._lock:
            m = held.setdefault(model, {})
            mine = by_pod.setdefault(pod, set())
            for h in hashes:
                m.setdefault(h, set()).add(pod)
                mine.add((model, h))

    def _tier_removed(self, medium: str, pod: str, model: str, hashes: Iterable[int]) -> None:
        held, by_pod = self._tier_maps(medium)
        with self._lock:
            m = held.get(model, {})
            mine = by_pod.get(pod, set())
            for h in hashes:
                _unhold(m, h, pod)
                mine.discard((model, h))

    def match_host(self, model: str, hashes: Sequence[int], start: dict[str, int]) -> TierHits:
        """For each pod of ``start`` (pod -> its device hit in blocks), the consecutive blocks of
        ``hashes`` from there that the pod holds in its host tier, or in its disk tier (``.disk``):
        each block from the host if it has it, else from the disk, as the pod looks them up (0 for
        pods without tiers)."""
        out = TierHits()
        with self._lock:
            host = self._host.get(model) or {}
            disk = self._disk.get(model) or {}
            for pod, k in start.items():
                n_host = n_disk = 0
                if host or disk:
                    for h in hashes[k:]:
                        if pod in host.get(h, ()):
                            n_host += 1
                        elif pod in disk.get(h, ()):
                            n_disk += 1
                        else:
                            break
                out[pod] = n_host
                out.disk[pod] = n_disk
        return out

    def pod_tiers(self, pod: str, model: str) -> dict[str, set[int]]:
        """The hashes ``pod`` holds per tier, as its events told ("GPU": device, "CPU": host, "DISK": disk;
        the disk's only when it has one)."""
        with self._lock:
            out = {
                "GPU": {h for m, h in self._by_pod.get(pod, ()) if m == model},
                MEDIUM_CPU: {h for m, h in self._host_by_pod.get(pod, ()) if m == model},
            }
            if pod in self._disk_by_pod:
                out[MEDIUM_DISK] = {h for m, h in self._disk_by_pod[pod] if m == model}
            return out

    def _decayed(self, pod: str, now: float) -> float:
        v, t = self._evicted.get(pod, (0.0, now))
        if self.evict_halflife <= 0:
            return v
        return v * 0.5 ** ((now - t) / self.evict_halflife)

    def eviction_pressure(self, pods: Iterable[str]) -> dict[str, float]:
        """Blocks each pod evicted recently (decayed with ``evict_halflife`` seconds); 0 for pods without events."""
        now = time.monotonic()
        with self._lock:
            return {p: self._decayed(p, now) for p in pods}

    # ---- predicted (routing history) ----------------------------------------
    def record_routed(self, pod: str, model: str, hashes: Sequence[int]) -> None:
        now = time.monotonic()
        with self._lock:
            exp = now + self.pending_ttl if pod in self._event_pods else float("inf")
            pred = self._predicted.setdefault(pod, OrderedDict())
            exact = self._exact.get(model, {})
            for h in hashes:
                if pod in exact.get(h, ()):
                    continue
                key = (model, h)
                pred[key] = exp
                pred.move_to_end(key)
            while len(pred) > self.approx_capacity:
                pred.popitem(last=False)

    # ---- lookup -------------------------------------------------------------
    def match(self, model: str, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int]:
        """Consecutive leading blocks of ``hashes`` held by each pod (exact or predicted)."""
        now = time.monotonic()
        out: dict[str, int] = {}
        with self._lock:
            exact = self._exact.get(model, {})
            for pod in pods:
                pred = self._predicted.get(pod)
                n = 0
                for h in hashes:
                    if pod in exact.get(h, ()):
                        n += 1
                        continue
                    if pred is not None:
                        exp = pred.get((model, h))
                        if exp is not None and exp > now:
                            pred.move_to_end((model, h))
                            n += 1
                            continue
                    break
                out[pod] = n
        return out

    def match_exact(self, model: str, hashes: Sequence[int], pod: str) -> int:
        with self._lock:
            exact = self._exact.get(model, {})
            n = 0
            for h in hashes:
                if pod not in exact.get(h, ()):
                    break
                n += 1
            return n

    def size(self) -> dict[str, int]:
        """Block entries per model (exact), plus predicted entries under the key ``"predicted"``."""
        with self._lock:
            out = {m: len(v) for m, v in self._exact.items()}
            out["predicted"] = sum(len(p) for p in self._predicted.values())
            return out

    def pod_blocks(self, pod: str) -> int:
        with self._lock:
            return len(self._by_pod.get(pod, ()))

    def expire(self) -> None:
        """Drop expired predicted entries (called periodically)."""
        now = time.monotonic()
        with self._lock:
            for pred in self._predicted.values():
                dead = [k for k, e in pred.items() if e <= now]
                for k in dead:
                    del pred[k]
