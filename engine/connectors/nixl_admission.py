"""Decode side admission: is the prefill engine that ``kv_transfer_params`` name there, and can it serve them?

The answer comes from a "meta" handshake with the side channel the params name, cached per address so a
burst of requests costs one round trip; ``NixlConnector.prepare_kv_transfer_params`` runs it on a helper
thread so the step loop never waits on a remote engine.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable

from kvmesh.engine.connectors.common import BlockLayout
from kvmesh.engine.connectors.nixl_side_channel import PROTOCOL_VERSION

# (time fetched, meta dict or None, error text or None)
Entry = tuple[float, dict | None, str | None]


def meta_problem(meta: dict, params: dict, model_identity: str | None, layout: BlockLayout | None) -> str | None:
    """Why ``params`` cannot be served by the engine that answered ``meta``; None if they can."""
    if meta.get("engine_id") != params["remote_engine_id"]:
        return f"unknown remote engine: that side channel belongs to engine {meta.get('engine_id')!r}"
    if meta.get("version") != PROTOCOL_VERSION:
        return f"it speaks transfer protocol {meta.get('version')}, this engine {PROTOCOL_VERSION}"
    if model_identity is not None and meta.get("model_identity") != model_identity:
        return "it serves another model"
    if layout is not None and str(meta.get("layout")).split("|")[1:2] != [layout.shape_signature()]:
        return f"its KV layout {meta.get('layout')} differs from this engine's {layout.signature()}"
    # Another KV dtype or FP8 scales alone is no reason to refuse the request: its blocks are refused
    # at pull time (counted as kv_layout) and the prompt recomputed.
    bs = layout.block_size if layout is not None else None
    if bs is not None and params.get("remote_block_size", bs) != bs:
        return f"remote_block_size {params['remote_block_size']} is not the block size {bs}"
    n = meta.get("num_blocks")
    if not isinstance(n, int):
        return "its handshake does not say how many KV blocks it has"
    bad = [b for b in params["remote_block_ids"] if b >= n]
    if bad:
        return f"remote_block_ids out of range: {bad[:5]} (its KV pool has {n} blocks, ids 0..{n - 1})"
    return None


class PeerMetaCache:
    """What each side channel answered to a "meta" handshake: LRU-bounded, one handshake in flight per address.

    ``ask(host, port, msg)`` is the side-channel round trip; ``problem(meta, params)`` says why a cached
    answer does not settle the params (``meta_problem`` with this engine's model and layout).
    """

    SIZE = 256
    FRESH_S = 2.0  # a handshake younger than this is not repeated to re-check a mismatch

    def __init__(
        self, ask: Callable[[str, int, dict], dict], problem: Callable[[dict, dict], str | None], stats: dict[str, int]
    ) -> None:
        self._ask = ask
        self._problem = problem
        self._stats = stats
        self._entries: collections.OrderedDict[tuple[str, int], Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: dict[tuple[str, int], concurrent.futures.Future] = {}
        self._closed = False

    def fetch(self, host: str, port: int) -> Entry:
        """One "meta" handshake (any thread); the answer, or why there is none, goes into the cache."""
        self._stats["handshakes"] += 1
        entry: Entry
        try:
            reply = self._ask(host, port, {"op": "meta"})
            if not reply.get("ok") or not isinstance(reply.get("meta"), dict):
                entry = (time.monotonic(), None, f"answered the handshake with an error: {reply.get('error')}")
            else:
                entry = (time.monotonic(), reply["meta"], None)
        except Exception as e:
            entry = (time.monotonic(), None, f"did not answer the side-channel handshake ({e})")
        with self._lock:
            self._entries[(host, port)] = entry
            self._entries.move_to_end((host, port))
            while len(self._entries) > self.SIZE:
                self._entries.popitem(last=False)
        return entry

    def usable(self, addr: tuple[str, int], params: dict) -> Entry | None:
        """The cached answer for ``addr`` if it settles ``params``; None if a handshake must be (re)done.

        A fresh answer (younger than ``FRESH_S``) always settles; an older one only if it agrees with the
        params: an old failure is retried (the prefill may be up now), an old disagreement re-asked (the
        prefill may have restarted with another id or pool)."""
        with self._lock:
            entry = self._entries.get(addr)
            if entry is not None:
                self._entries.move_to_end(addr)
        if entry is None:
            return None
        if time.monotonic() - entry[0] < self.FRESH_S:
            return entry
        if entry[1] is not None and self._problem(entry[1], params) is None:
            return entry
        return None

    def prefetch(self, addr: tuple[str, int]) -> concurrent.futures.Future | None:
        """Start (or join) the handshake with ``addr`` on a helper thread; None once closed."""
        with self._lock:
            fut = self._inflight.get(addr)
            if fut is not None and not fut.done():
                return fut  # a burst of requests to a new prefill shares one handshake
            if self._closed:
                return None
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvmesh-nixl-hello")
            fut = self._inflight[addr] = self._pool.submit(self.fetch, *addr)
            if len(self._inflight) > self.SIZE:
                for a in [a for a, f in self._inflight.items() if f.done()]:
                    del self._inflight[a]
        return fut

    def mark_closed(self) -> None:
        """No new handshakes from now on (``prefetch`` answers None)."""
        with self._lock:
            self._closed = True

    def close(self) -> None:
        """Wait for handshakes under way (each bounded by the handshake timeout)."""
        self.mark_closed()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
