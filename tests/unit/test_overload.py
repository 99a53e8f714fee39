"""Shedding's estimates in isolation (a fake clock, no sockets): the EWMA rates, the pod's wait estimate
and deadline check, the router queue's estimated wait and its 429 (the tenant's own backlog) against
503 (the service is saturated), and the per-request token budget shared by router and pod."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.services.api.overload import PodAdmission, PodLoad, RateMeter, estimate_pod_wait, retry_after
from kvmesh.services.api.protocol import check_request_tokens, completion_tokens
from kvmesh.services.errors import APIError
from kvmesh.services.router.admission import Admission, request_budget
from kvmesh.services.router.metrics import RouterMetrics

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_rate_meter_is_an_ewma_over_busy_windows_only() -> None:
    clock = Clock()
    m = RateMeter(clock)
    m.tick()  # busy from here
    assert m.rate is None
    clock.t += 0.2
    m.add(4)
    assert m.rate is None  # the window is shorter than WINDOW_S
    clock.t += 0.8
    m.add(6)
    assert m.rate == pytest.approx(10.0)  # 10 events in 1 s
    m.idle()
    clock.t += 3600  # an idle hour is not counted
    m.tick()
    clock.t += 1.0
    m.add(20)
    assert m.rate == pytest.approx(0.7 * 10 + 0.3 * 20)


def test_rate_meter_waits_for_a_first_event() -> None:
    clock = Clock()
    m = RateMeter(clock)
    m.tick()
    clock.t += 2.0
    m.tick()
    assert m.rate is None  # no finish in 2 s of a cold start: no evidence of a zero rate
    m.add(4)
    assert m.rate == pytest.approx(2.0)


def load(**kw) -> PodLoad:
    base = dict(
        waiting=0,
        running=0,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        prompt_tokens_pending=0,
        free_blocks=64,
        total_blocks=64,
        blocks_needed=1,
    )
    base.update(kw)
    return PodLoad(**base)


def test_pod_wait_is_the_slowest_of_backlog_slots_and_kv() -> None:
    assert estimate_pod_wait(load(), None, None) == 0.0  # idle: starts now, rates or not
    # prefill backlog: 1000 tokens, 256 a step: it starts in the 4th step, after 768 tokens at 500 tokens/s
    assert estimate_pod_wait(load(prompt_tokens_pending=1000), 500.0, None) == pytest.approx(768 / 500)
    # each running sequence takes a token of a step: 6 steps of 250 before it, 1500 tokens
    assert estimate_pod_wait(load(prompt_tokens_pending=1500, running=6), 500.0, 2.0) == pytest.approx(3.0)
    # slots: 4 running, 5 waiting -> 6 must finish first, at 2/s
    assert estimate_pod_wait(load(running=4, waiting=5), 500.0, 2.0) == pytest.approx(3.0)
    # KV: 40 blocks short, 4 running hold 60 (15 each) -> ~2.67 requests to finish, at 2/s
    kv = load(running=4, max_num_seqs=8, free_blocks=4, blocks_needed=44)
    assert estimate_pod_wait(kv, 500.0, 2.0) == pytest.approx(40 / 15 / 2)
    # something is queued but its rate is not known yet
    assert estimate_pod_wait(load(running=4, waiting=1), 500.0, None) is None


def test_a_backlog_the_next_step_takes_delays_nothing_whatever_the_rate() -> None:
    """A decode pod measures its token rate over one-token decode steps (a few tokens/s on a busy CPU). A
    prompt it takes over from a dead peer (a migration, computed whole there) is computed in its next step,
    and so is the prompt of a request arriving now: neither waits on the other's tokens at that rate."""
    migrated = load(running=1, waiting=1, max_num_seqs=32, max_num_batched_tokens=2048, prompt_tokens_pending=427)
    assert estimate_pod_wait(migrated, 5.0, 1.0) == 0.0
    assert estimate_pod_wait(migrated, None, None) == 0.0  # no rate needed for no step
    adm = PodAdmission(30.0)
    adm.tokens.rate, adm.finishes.rate = 5.0, 1.0
    assert adm.check(migrated) is None
    # past the step's budget the full steps before it count: 9 of 2047 tokens, at 5 tokens/s
    flood = load(running=1, waiting=40, max_num_seqs=64, max_num_batched_tokens=2048, prompt_tokens_pending=20000)
    shed = adm.check(flood)
    assert shed is not None and shed.wait_s == pytest.approx(9 * 2047 / 5.0)


def test_pod_admission_sheds_past_the_deadline_with_a_computed_retry_after() -> None:
    adm = PodAdmission(2.0)
    adm.tokens.rate, adm.finishes.rate = 1000.0, 2.0
    assert adm.check(load(running=4, waiting=2)) is None  # 3 / 2 = 1.5 s
    shed = adm.check(load(running=4, waiting=9))  # 10 / 2 = 5 s
    assert shed is not None and shed.wait_s == pytest.approx(5.0) and shed.retry_after_s == 3
    assert "5.0 s" in shed.message and adm.refused == 1
    assert PodAdmission(0.0).check(load(running=4, waiting=1000)) is None  # 0: off


def test_a_held_requests_budget_lowers_the_pods_deadline_never_raises_it() -> None:
    adm = PodAdmission(2.0)
    adm.tokens.rate, adm.finishes.rate = 1000.0, 2.0
    assert adm.check(load(running=4, waiting=2), budget_s=5.0) is None  # 1.5 s: within both
    shed = adm.check(load(running=4, waiting=2), budget_s=1.0)  # 1.5 s: past what the router's hold left
    assert shed is not None and shed.retry_after_s == 1 and "deadline of 1 s" in shed.message
    assert adm.check(load(running=4, waiting=5), budget_s=10.0) is not None  # 3 s: past the pod's own 2 s


def test_pod_admission_without_rates_admits_one_batch_of_waiters() -> None:
    adm = PodAdmission(2.0)
    assert adm.check(load(running=4, waiting=3)) is None
    shed = adm.check(load(running=4, waiting=4))
    assert shed is not None and shed.retry_after_s >= 1 and "no rate" in shed.message


def test_retry_after_is_at_least_one_second() -> None:
    assert retry_after(2.1, 2.0) == 1 and retry_after(10.0, 2.0) == 8 and retry_after(0.0, 2.0) == 1


async def _served(adm: Admission, tenant: str) -> None:
    (await adm.admit(tenant, 0, 0)).settle()  # upstream answers at once


def test_router_queue_bounded_by_estimated_wait_429_own_backlog_503_saturated() -> None:
    async def go() -> None:
        clock = Clock()
        adm = Admission(1, 1000, 0, RouterMetrics(), clock=clock, max_queue_wait=2.0)
        adm.finishes.rate = 1.0  # one admitted request finishes per second
        holder = await adm.admit("a", 0, 0)  # holds the slot
        queued = [asyncio.create_task(_served(adm, "a")) for _ in range(2)]
        await asyncio.sleep(0)
        assert adm.waiting == 2
        # tenant a: 2 of its own ahead -> (2 + 1) / 1 = 3 s > 2; alone it would wait 1 s: its own backlog
        assert adm.estimate_wait("a", 0) == pytest.approx(3.0)
        with pytest.raises(APIError) as e:
            await adm.admit("a", 0, 0)
        assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
        # tenant b: round robin gives it the next turn: (1 + 1) / 1 = 2 s, admitted to the queue
        assert adm.estimate_wait("b", 0) == pytest.approx(2.0)
        b = asyncio.create_task(_served(adm, "b"))
        await asyncio.sleep(0)
        # tenant c: a's two and b's one ahead at most once each per turn: (1 + 1 + 1) / 1 = 3 s even alone
        with pytest.raises(APIError) as e:
            await adm.admit("c", 0, 0)
        assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
        # a higher priority goes ahead of them all
        assert adm.estimate_wait("vip", 5) == pytest.approx(1.0)
        # drain: everything queued gets its slot, nothing leaks
        holder.settle()
        await asyncio.gather(*queued, b)
        assert adm.active == 0 and adm.waiting == 0

    asyncio.run(go())


def test_router_queue_falls_back_to_its_count_until_a_rate_is_measured() -> None:
    async def go() -> None:
        adm = Admission(1, 2, 0, RouterMetrics(), max_queue_wait=0.001)
        holder = await adm.admit("a", 0, 0)
        queued = [asyncio.create_task(_served(adm, "a")) for _ in range(2)]
        await asyncio.sleep(0)
        assert adm.waiting == 2  # no rate: the wait bound cannot refuse
        with pytest.raises(APIError) as e:
            await adm.admit("a", 0, 0)
        assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}  # the count bound
        holder.settle()
        await asyncio.gather(*queued)
        assert adm.finishes.rate is not None  # three finishes measured

    asyncio.run(go())


def test_unset_max_tokens_counts_as_the_context_left() -> None:
    assert completion_tokens(None, 100, 512) == 412
    assert completion_tokens(50, 100, 512) == 50
    assert completion_tokens(None, 100, None) == 0  # context unknown (a router without a model)


def test_request_tokens_over_the_limit_is_a_400_naming_max_tokens() -> None:
    assert check_request_tokens(2, 1, 100, 10, 2048, 65536) == 200
    with pytest.raises(APIError) as e:
        check_request_tokens(100, 1, 8000, 10, 8192, 65536)  # the probe's n=100 x max_tokens=8000
    assert e.value.status == 400 and e.value.param == "max_tokens"
    assert "800000" in e.value.message and "by 734464" in e.value.message
    # one sequence may always run to the end of the context, whatever the limit
    assert check_request_tokens(1, 1, None, 10, 131072, 65536) == 131062
    with pytest.raises(APIError) as e:
        check_request_tokens(2, 1, None, 10, 131072, 65536)
    assert "unset: the context left, 131062" in e.value.message
    with pytest.raises(APIError) as e:
        check_request_tokens(4, 3, 100, 10, 512, 1000)
    assert "3 prompts x n=4" in e.value.message
    assert check_request_tokens(100, 1, 8000, 10, 8192, 0) == 800000  # 0: no limit


def test_router_budget_reads_the_body_as_the_pod_does() -> None:
    assert request_budget({"prompt": "x"}, 5, 512, 65536) == 16  # completions: OpenAI's default 16
    assert request_budget({"prompt": "x", "max_tokens": None}, 5, 512, 65536) == 507
    assert request_budget({"messages": [], "n": 2}, 12, 512, 65536) == 1000  # chat: the context left
    assert request_budget({"messages": [], "max_completion_tokens": 7, "max_tokens": 9}, 12, 512, 65536) == 7
    assert request_budget({"prompt": ["a", "b"], "n": 2, "max_tokens": 10}, 5, 512, 65536) == 40
    with pytest.raises(APIError) as e:
        request_budget({"prompt": "x", "n": 100, "max_tokens": 8000}, 5, None, 65536)
    assert e.value.status == 400 and e.value.param == "max_tokens"
