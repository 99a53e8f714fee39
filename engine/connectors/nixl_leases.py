"""Prefill side: finished requests' blocks held for one remote reader each, under a lease.

Shared between the engine thread (``hold``, ``collect``) and the side-channel thread (``answer``) under
one lock. A hold ends when the reader's READ notification arrives, when the reader releases it over the
side channel, or when its lease runs out (a claim extends the lease to cover the read, never past twice
the lease). Only authenticated messages reach ``answer`` (the side channel checks their MAC); a claim must
still name a held transfer and exactly its blocks.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

from kvmesh.engine.connectors.nixl_side_channel import DONE_PREFIX

log = logging.getLogger("kvmesh.connector.nixl")


@dataclass
class Held:
    """A finished request's blocks kept for one remote reader."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[str]  # hex chained hashes of ``block_ids``: what the reader compares with its own
    deadline: float
    max_deadline: float  # no claim extends the lease past this (twice the lease after the hold)
    claimed: bool = False
    since: float = field(default_factory=time.monotonic)


class HeldBlocks:
    """Transfer id -> held blocks, and the request ids released since the last ``collect``."""

    def __init__(self, stats: dict[str, int]) -> None:
        self._stats = stats
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._released: list[str] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def hold(
        self, transfer_id: str, request_id: str, block_ids: list[int], block_hashes: list[str], lease_s: float
    ) -> None:
        now = time.monotonic()
        with self._lock:
            self._held[transfer_id] = Held(
                request_id, list(block_ids), list(block_hashes), now + lease_s, now + 2 * lease_s, since=now
            )

    def answer(self, msg: dict, meta: dict | None) -> dict:
        """The side-channel reply to an authenticated ``claim`` or ``release`` (side-channel thread).

        A claim names the transfer id and exactly the blocks held for it, with a finite, non-negative
        ``timeout_s``; the extension it buys never goes past ``max_deadline``. Refusals are counted
        (``claims_refused``) and logged."""
        op = msg.get("op")
        xid = msg.get("transfer_id")
        with self._lock:
            reply = self._answer(op, xid, msg, meta)
        if not reply["ok"]:
            self._stats["claims_refused"] += 1
            log.warning("side channel: %s of transfer %.12r refused: %s", op, xid, reply["error"])
        return reply

    def _answer(self, op: object, xid: object, msg: dict, meta: dict | None) -> dict:
        if op not in ("claim", "release"):
            return {"ok": False, "error": f"unknown op {op!r}"}
        if not isinstance(xid, str) or (held := self._held.get(xid)) is None:
            return {"ok": False, "error": "unknown or expired transfer"}
        if op == "release":
            del self._held[xid]
            self._released.append(held.request_id)
            return {"ok": True}
        if msg.get("block_ids") != held.block_ids:
            return {"ok": False, "error": "block ids are not those held for this transfer"}
        t = msg.get("timeout_s")
        if not isinstance(t, float | int) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            return {"ok": False, "error": f"timeout_s must be a finite number >= 0, got {t!r}"}
        held.claimed = True
        held.deadline = max(held.deadline, min(time.monotonic() + t + 5.0, held.max_deadline))
        return {"ok": True, "meta": meta, "block_hashes": held.block_hashes}

    def collect(self, notifs: dict[str, list[bytes]], done_sending: set[str]) -> None:
        """Add to ``done_sending`` every request whose hold ended: read (notified), released or expired."""
        now = time.monotonic()
        with self._lock:
            for msgs in notifs.values():
                for m in msgs:
                    if m.startswith(DONE_PREFIX):
                        held = self._held.pop(m[len(DONE_PREFIX) :].decode(errors="replace"), None)
                        if held is not None:
                            done_sending.add(held.request_id)
                            self._stats["sends_done"] += 1
            for rid in self._released:
                done_sending.add(rid)
                self._stats["sends_released"] += 1
            self._released.clear()
            for xid, held in list(self._held.items()):
                if now >= held.deadline:
                    del self._held[xid]
                    done_sending.add(held.request_id)
                    self._stats["leases_expired"] += 1
                    log.warning(
                        "lease of request %s expired after %.1fs (%s); freeing %d blocks",
                        held.request_id,
                        now - held.since,
                        "its reader did not finish" if held.claimed else "no reader came",
                        len(held.block_ids),
                    )
