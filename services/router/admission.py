"""Admission control: per-tenant rate limits, then a bounded, prioritized, fair queue for upstream slots.

A request passes, in order:

1. its tenant's token buckets: requests per minute (one per request) and tokens per minute (prompt
   tokens + ``max_tokens`` at admission, corrected to the reported usage when the answer ends). A
   tenant over either gets 429 with ``Retry-After`` (the seconds until its bucket holds enough) at
   once, never a place in the queue, so it cannot crowd out the others;
2. a slot: at most ``max_concurrent`` requests go upstream at once (0: no limit). When none is free
   the request waits in a queue of at most ``queue_size`` (beyond: 429). The queue serves the highest
   priority first and, within a priority, the tenant admitted least recently (round robin over the
   tenants that wait, not FIFO): a tenant with a thousand queued requests delays another tenant's
   next request by at most one admission per slot.
3. the queue is bounded by its estimated wait too (``max_queue_wait``; 0: off): the requests that
   would be admitted before this one (higher priorities, and at its own priority the round robin's
   turns: each other waiting tenant gets one per turn of this tenant), divided by the measured rate
   at which admitted requests finish (an EWMA, services/api/overload.py). Past the bound: 429 when
   the tenant's own queued requests are what makes it long (one request of it alone would fit),
   503 when the service is saturated (it would not), each with ``Retry-After`` the seconds until the
   queue should have drained below the bound. Until a finish rate is measured only the count bounds
   the queue.

A waiter holds a `Ticket` (a few slots) and a future, nothing of its request, so a deep queue costs
little memory; one whose client goes away, or that waits longer than ``queue_timeout``, leaves the
queue and gives its bucket tokens back.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable

from kvmesh.services.api.overload import RateMeter, retry_after
from kvmesh.services.api.protocol import check_request_tokens
from kvmesh.services.errors import APIError

from .metrics import RouterMetrics


class ClientGone(Exception):
    """The client disconnected while its request waited in the queue."""


class TokenBucket:
    """``per_minute`` units, refilled continuously; a full bucket allows a minute's worth at once."""

    __slots__ = ("capacity", "rate", "level", "t")

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.t = now

    def set_limit(self, per_minute: int) -> None:
        if per_minute != self.capacity:  # a rotated keys file changed the limit
            self.capacity, self.rate = float(per_minute), per_minute / 60.0
            self.level = min(self.level, self.capacity)

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
        self.t = now

    def wait_s(self, cost: float) -> float:
        """Seconds until ``cost`` units are there (0: now); call `refill` first."""
        return 0.0 if self.level >= cost else (cost - self.level) / self.rate

    def take(self, n: float) -> None:
        self.level -= n  # may go below 0 when usage exceeded the estimate: the debt delays the next request

    def give(self, n: float) -> None:
        self.level = min(self.capacity, self.level + n)


class Ticket:
    """One admitted or waiting request: what settling it needs, nothing of the request itself."""

    __slots__ = ("tenant", "priority", "tokens", "future", "admitted", "settled", "_adm")

    def __init__(self, adm: Admission, tenant: str, priority: int, tokens: int) -> None:
        self._adm, self.tenant, self.priority, self.tokens = adm, tenant, priority, tokens
        self.future: asyncio.Future | None = None
        self.admitted = False
        self.settled = False

    def settle(self, used_tokens: int | None = None) -> None:
        """The request is over: free its slot and, given its reported usage, correct the tenant's
        token bucket from the estimate to what it used. Idempotent."""
        if self.settled:
            return
        self.settled = True
        self._adm._settle(self, used_tokens)


class _Tenant:
    __slots__ = ("rpm", "tpm", "last_admitted")

    def __init__(self) -> None:
        self.rpm: TokenBucket | None = None
        self.tpm: TokenBucket | None = None
        self.last_admitted = 0  # admission sequence number (round robin: least recent first)


class Admission:
    def __init__(
        self,
        max_concurrent: int,
        queue_size: int,
        queue_timeout: float,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
        max_queue_wait: float = 0.0,
    ) -> None:
        self.max_concurrent, self.queue_size, self.queue_timeout = max_concurrent, queue_size, queue_timeout
        self.max_queue_wait = max_queue_wait
        self.metrics, self._clock = metrics, clock
        self.finishes = RateMeter(clock)  # admitted requests finished per second, while any is active
        self.active = 0  # requests holding a slot
        self.waiting = 0
        self._levels: dict[int, dict[str, deque[Ticket]]] = {}  # priority -> tenant -> its waiters, oldest first
        self._tenants: dict[str, _Tenant] = {}
        self._seq = 0

    # ---- rate limits --------------------------------------------------------
    def _tenant(self, name: str, rpm: int | None, tpm: int | None, now: float) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            t = self._tenants[name] = _Tenant()
        for attr, limit in (("rpm", rpm), ("tpm", tpm)):
            b = getattr(t, attr)
            if limit is None:
                setattr(t, attr, None)
            elif b is None:
                setattr(t, attr, TokenBucket(limit, now))
            else:
                b.set_limit(limit)
                b.refill(now)
        return t

    def _reject(self, reason: str, tenant: str, message: str, retry_after_s: float, status: int = 429) -> APIError:
        self.metrics.rejected.labels(reason, tenant).inc()
        return APIError(status, message, headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})

    # ---- admission ----------------------------------------------------------
    async def admit(
        self,
        tenant: str,
        priority: int = 0,
        tokens: int = 0,
        rpm: int | None = None,
        tpm: int | None = None,
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> Ticket:
        """A `Ticket` holding a slot (settle it when the request ends), or `APIError` 429, or
        `ClientGone` when ``gone`` (awaited while queued) returns first."""
        now = self._clock()
        t = self._tenant(tenant, rpm, tpm, now)
        if t.rpm is not None and (w := t.rpm.wait_s(1)) > 0:
            raise self._reject("rpm", tenant, f"tenant {tenant!r} is over its limit of {rpm} requests per minute", w)
        if t.tpm is not None:
            if tokens > t.tpm.capacity:  # no wait would ever admit it: the client's error, not a rate limit
                self.metrics.rejected.labels("tpm", tenant).inc()
                raise APIError(
                    400,
                    f"the request needs {tokens} tokens (prompt + max_tokens), more than tenant {tenant!r}'s "
                    f"whole limit of {tpm} tokens per minute, so it can never be admitted; lower max_tokens "
                    "or shorten the prompt",
                    param="max_tokens",
                )
            if (w := t.tpm.wait_s(tokens)) > 0:
                raise self._reject("tpm", tenant, f"tenant {tenant!r} is over its limit of {tpm} tokens per minute", w)
        tk = Ticket(self, tenant, priority, tokens)
        if self.max_concurrent <= 0 or (self.active < self.max_concurrent and not self.waiting):
            self._charge(t, tk)
            self._grant(tk)
            return tk
        wait = self.estimate_wait(tenant, priority)
        if self.waiting >= self.queue_size:
            raise self._reject(
                "queue_full",
                tenant,
                f"the router's queue is full ({self.queue_size} waiting)",
                retry_after(wait, self.max_queue_wait) if wait is not None else 1,
            )
        if wait is not None and self.max_queue_wait > 0 and wait > self.max_queue_wait:
            alone = self.estimate_wait(tenant, priority, own_ahead=0)
            assert alone is not None
            if alone <= self.max_queue_wait:  # its own backlog makes the wait: the tenant's limit
                raise self._reject(
                    "queue_wait",
                    tenant,
                    f"tenant {tenant!r} has {self._queued(tenant, priority)} requests queued; this one would "
                    f"wait about {wait:.0f} s, over the router's bound of {self.max_queue_wait:g} s",
                    retry_after(wait, self.max_queue_wait),
                )
            raise self._reject(
                "saturated",
                tenant,
                f"the service is saturated: a request would wait about {wait:.0f} s in the router's queue "
                f"({self.waiting} waiting), over its bound of {self.max_queue_wait:g} s",
                retry_after(wait, self.max_queue_wait),
                status=503,
            )
        self._charge(t, tk)
        await self._wait(tk, gone)
        return tk

    def _queued(self, tenant: str, priority: int) -> int:
        q = self._levels.get(priority, {}).get(tenant)
        return len(q) if q else 0

    def estimate_wait(self, tenant: str, priority: int, own_ahead: int | None = None) -> float | None:
        """Seconds before a request of ``tenant`` queued now would be admitted, or None while no finish
        rate is measured. Ahead of it: every waiter of a higher priority and, at its own, the round
        robin's turns: with ``k`` of its tenant's requests ahead (``own_ahead``, default: those queued),
        each other tenant there gets up to ``k + 1`` admissions first. It is admitted when one more
        slot frees than that: ``(ahead + 1) / finish rate``."""
        rate = self.finishes.rate
        if not rate:
            return None
        k = self._queued(tenant, priority) if own_ahead is None else own_ahead
        ahead = k
        for prio, level in self._levels.items():
            if prio > priority:
                ahead += sum(len(q) for q in level.values())
            elif prio == priority:
                ahead += sum(min(len(q), k + 1) for name, q in level.items() if name != tenant)
        return (ahead + 1) / rate

    def _charge(self, t: _Tenant, tk: Ticket) -> None:
        if t.rpm is not None:
            t.rpm.take(1)
        if t.tpm is not None:
            t.tpm.take(tk.tokens)

    def _refund(self, tk: Ticket) -> None:
        t = self._tenants[tk.tenant]
        if t.rpm is not None:
            t.rpm.give(1)
        if t.tpm is not None:
            t.tpm.give(tk.tokens)

    def _grant(self, tk: Ticket) -> None:
        self.finishes.tick()  # busy from here: the finish rate's window runs
        self.active += 1
        self._seq += 1
        self._tenants[tk.tenant].last_admitted = self._seq
        tk.admitted = True
        self.metrics.admitted.labels(tk.tenant).inc()
        self.metrics.active.set(self.active)

    async def _wait(self, tk: Ticket, gone: Callable[[], Awaitable[object]] | None) -> None:
        tk.future = asyncio.get_running_loop().create_future()
        self._levels.setdefault(tk.priority, {}).setdefault(tk.tenant, deque()).append(tk)
        self.waiting += 1
        self._depth(tk.priority)
        watch = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            waits = {tk.future} if watch is None else {tk.future, watch}
            await asyncio.wait(waits, timeout=self.queue_timeout or None, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: the client left (RequestGuard cancels its handler) or the router stops
            self._leave(tk)
            self.metrics.rejected.labels("client_gone", tk.tenant).inc()
            raise
        finally:
            if watch is not None:
                watch.cancel()
        if tk.admitted and not (watch is not None and watch.done()):
            return
        self._leave(tk)
        if watch is not None and watch.done():
            self.metrics.rejected.labels("client_gone", tk.tenant).inc()
            raise ClientGone()
        wait = self.estimate_wait(tk.tenant, tk.priority)
        raise self._reject(
            "queue_timeout",
            tk.tenant,
            f"waited {self.queue_timeout:g} s in the router's queue for a free slot",
            retry_after(wait, self.max_queue_wait) if wait is not None else 1,
        )

    def _leave(self, tk: Ticket) -> None:
        """A waiter that will not run: out of the queue (or its slot back) and its tokens refunded."""
        if tk.settled:
            return
        tk.settled = True
        if tk.admitted:
            self._free()
        else:
            q = self._levels[tk.priority][tk.tenant]
            q.remove(tk)
            self._drop_empty(tk.priority, tk.tenant)
            self.waiting -= 1
            self._depth(tk.priority)
        self._refund(tk)

    def _drop_empty(self, priority: int, tenant: str) -> None:
        level = self._levels[priority]
        if not level[tenant]:
            del level[tenant]
            if not level:
                del self._levels[priority]

    def _settle(self, tk: Ticket, used: int | None) -> None:
        if tk.admitted:
            self._free()
        if used is not None:
            t = self._tenants.get(tk.tenant)
            if t is not None and t.tpm is not None:
                t.tpm.give(tk.tokens - used)  # negative: it used more than estimated

    def _free(self) -> None:
        self.active -= 1
        self.finishes.add()
        self.metrics.active.set(self.active)
        while self.waiting and (self.max_concurrent <= 0 or self.active < self.max_concurrent):
            tk = self._pop()
            self._grant(tk)
            assert tk.future is not None
            tk.future.set_result(None)
        if not self.active and not self.waiting:
            self.finishes.idle()  # keep the rate, leave the idle gap out of it

    def _pop(self) -> Ticket:
        """The next waiter: highest priority, then the tenant admitted least recently."""
        prio = max(self._levels)
        level = self._levels[prio]
        tenant = min(level, key=lambda name: self._tenants[name].last_admitted)
        tk = level[tenant].popleft()
        self._drop_empty(prio, tenant)
        self.waiting -= 1
        self._depth(prio)
        return tk

    def _depth(self, priority: int) -> None:
        self.metrics.queue_depth.labels(str(priority)).set(sum(len(q) for q in self._levels.get(priority, {}).values()))


def request_budget(body: dict, plen: int, max_model_len: int | None, limit: int) -> int:
    """Tokens the request may generate (prompts × ``n`` × ``max_tokens``, an unset one counting as the
    context left): its TPM charge beyond the prompt; over ``limit`` a 400, as the pod answers it
    (services/api/protocol.py)."""
    m = body.get("max_completion_tokens")
    if m is None:
        m = body.get("max_tokens", 16 if "prompt" in body else None)  # completions' default is OpenAI's 16
    n = body.get("n")
    p = body.get("prompt")
    prompts = len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1
    return check_request_tokens(n if isinstance(n, int) and n > 0 else 1, prompts, m, plen, max_model_len, limit)
