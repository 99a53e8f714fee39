"""The admission queue driven directly: 10,000 waiters cost bounded memory and all drain; buckets and
fairness in isolation (a fake clock, no sockets)."""

from __future__ import annotations

import asyncio
import gc
import os

import pytest

from kvmesh.services.errors import APIError
from kvmesh.services.router.admission import Admission, ClientGone, TokenBucket
from kvmesh.services.router.metrics import RouterMetrics

pytestmark = pytest.mark.unit


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _flood(adm: Admission, n: int, tenants: int, order: list[str]) -> int:
    """``n`` requests from ``tenants`` tenants against one slot; a cheap upstream (one loop turn).
    Returns the RSS growth measured while all but one wait."""
    gate = asyncio.Event()

    async def one(i: int) -> None:
        t = await adm.admit(f"t{i % tenants}", 0, 10)
        order.append(t.tenant)
        if not gate.is_set():
            await gate.wait()  # the first holds the slot until everybody queued
        await asyncio.sleep(0)  # the upstream
        t.settle(3)

    gc.collect()
    before = rss_bytes()
    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    while adm.waiting < n - 1:
        await asyncio.sleep(0)
    gc.collect()
    grown = rss_bytes() - before
    gate.set()
    await asyncio.gather(*tasks)
    return grown


def test_ten_thousand_queued_requests_stay_small_and_drain():
    n = 10_000
    adm = Admission(max_concurrent=1, queue_size=n, queue_timeout=0, metrics=RouterMetrics())

    async def main():
        order: list[str] = []
        first = await _flood(adm, n, 4, order)
        assert len(order) == n and adm.active == 0 and adm.waiting == 0 and not adm._levels
        # round robin across the 4 tenants, not arrival order
        assert order[1:9] == ["t1", "t2", "t3", "t0", "t1", "t2", "t3", "t0"]
        order.clear()
        second = await _flood(adm, n, 4, order)  # a second flood reuses what the first freed
        return first, second

    first, second = asyncio.run(main())
    # a waiter is its task (the handler's coroutine), a Ticket and a future: a few KiB, not a request body
    assert first < n * 8192, f"{first / n:.0f} bytes per queued request"
    assert second < n * 8192
    assert adm.metrics.registry.get_sample_value("kvmesh:router_queue_depth", {"priority": "0"}) == 0
    assert adm.metrics.registry.get_sample_value("kvmesh:router_admitted_requests_total", {"tenant": "t0"}) == n // 2


def test_queue_full_and_queue_timeout_refund_their_tokens():
    adm = Admission(max_concurrent=1, queue_size=1, queue_timeout=0.01, metrics=RouterMetrics())

    async def main():
        held = await adm.admit("a", tokens=10, tpm=100)
        waiter = asyncio.create_task(adm.admit("a", tokens=10, tpm=100))
        while not adm.waiting:
            await asyncio.sleep(0)
        with pytest.raises(APIError) as full:
            await adm.admit("b", tokens=10)
        assert full.value.status == 429 and full.value.headers == {"Retry-After": "1"}
        with pytest.raises(APIError) as late:
            await waiter
        assert late.value.status == 429 and "waited" in late.value.message
        assert adm.waiting == 0 and adm._tenants["a"].tpm.level == pytest.approx(90, abs=1)  # only the held one
        held.settle(4)
        assert adm.active == 0 and adm._tenants["a"].tpm.level == pytest.approx(96, abs=1)

    asyncio.run(main())


def test_client_gone_leaves_and_cancellation_frees_the_slot():
    adm = Admission(max_concurrent=1, queue_size=8, queue_timeout=0, metrics=RouterMetrics())

    async def main():
        held = await adm.admit("a")
        bye = asyncio.Event()
        gone = asyncio.create_task(adm.admit("b", gone=bye.wait))
        cancelled = asyncio.create_task(adm.admit("c"))
        while adm.waiting < 2:
            await asyncio.sleep(0)
        bye.set()
        with pytest.raises(ClientGone):
            await gone
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert adm.waiting == 0 and not adm._levels
        held.settle()
        held.settle()  # idempotent
        assert adm.active == 0

    asyncio.run(main())


def test_token_bucket_refills_and_tells_the_wait():
    b = TokenBucket(60, now=0.0)  # one a second, a minute's burst
    b.take(60)
    assert b.wait_s(1) == pytest.approx(1.0)
    b.refill(0.5)
    assert b.wait_s(1) == pytest.approx(0.5)
    b.refill(1000.0)
    assert b.level == 60  # never beyond a minute's worth
    b.set_limit(30)
    assert b.level == 30 and b.wait_s(31) > 0
