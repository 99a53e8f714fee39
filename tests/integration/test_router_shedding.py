"""A pod that sheds a request (503 with Retry-After and the overload header: its queue would hold the
request past its deadline; it admitted nothing) is not the client's answer while another pod of the role
has room: the router tries the others, and refuses only when every pod shed it, with the soonest
Retry-After. Real router and HTTP, two stand-in pods (kvmesh.testing.pods.FakePod) that shed on demand."""

from __future__ import annotations

import httpx
import pytest

from kvmesh.services.errors import ENGINE_UNAVAILABLE_HEADER, OVERLOADED_HEADER, QUEUE_BUDGET_HEADER
from kvmesh.testing.pods import FakePod, IdTokenizer, start_router, wait_for
from kvmesh.topology import free_port

pytestmark = pytest.mark.integration
SHED = {"error": {"message": "server is overloaded", "type": "ServiceUnavailableError", "code": 503}}


@pytest.fixture
def two():
    from kvmesh.services.router.config import PodSpec, RouterConfig

    a, b = FakePod().start(), FakePod().start()
    # shed_hold_s 0: the router answers the 503 of a request both pods shed at once (holding: its own test)
    cfg = RouterConfig(port=free_port(), pods=(PodSpec(a.url), PodSpec(b.url)), policy="round-robin", shed_hold_s=0)
    srv, router = start_router(cfg, tokenizer=IdTokenizer())
    yield srv, router, a, b
    srv.stop()
    a.stop()
    b.stop()


def _post(srv) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"prompt": "1 2 3", "max_tokens": 2}, timeout=30)


def _retries(router) -> float:
    return router.metrics.registry.get_sample_value("kvmesh:router_retries_total", {"reason": "Overloaded"}) or 0.0


def test_a_shedding_pod_is_skipped_and_all_shedding_is_a_503_with_the_soonest_retry_after(two):
    srv, router, a, b = two
    a.refuse, a.refuse_headers = (503, SHED), {"Retry-After": "7", OVERLOADED_HEADER: "1"}
    for _ in range(4):  # round-robin sends half of them to the shedding pod first
        r = _post(srv)
        assert r.status_code == 200, r.text
    assert len(b.bodies) == 4 and len(a.bodies) >= 1 and _retries(router) >= 1
    assert all(p.healthy for p in router.pods.values())  # busy is not down
    b.refuse, b.refuse_headers = (503, SHED), {"Retry-After": "3", OVERLOADED_HEADER: "1"}
    r = _post(srv)
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    assert "overloaded" in r.json()["error"]["message"] and ENGINE_UNAVAILABLE_HEADER not in r.headers
    assert router.admission.active == 0  # nothing held after the refusal


def test_blocks_prefilled_for_a_shedding_decode_pod_never_go_to_a_pod_of_another_layout():
    """Mid-rollout: the decode pod chosen sheds the request after a prefill pod of its KV layout computed
    it. The retry keeps to decode pods of that layout; with none, another decode pod computes the prompt
    itself (it is never sent blocks it would refuse)."""
    from kvmesh.services.router.config import PodSpec, RouterConfig

    pre, d1, d2 = FakePod().start(), FakePod().start(), FakePod().start()
    pre.kv_layout, d1.kv_layout, d2.kv_layout = "old", "old", "new"
    d1.refuse, d1.refuse_headers = (503, SHED), {"Retry-After": "2", OVERLOADED_HEADER: "1"}
    cfg = RouterConfig(
        port=free_port(),
        pods=(PodSpec(pre.url, "prefill"), PodSpec(d1.url, "decode"), PodSpec(d2.url, "decode")),
        policy="round-robin",
        pd_min_uncached=0,
        health_interval=0.1,
    )
    srv, router = start_router(cfg, tokenizer=IdTokenizer())
    try:
        for p in (pre, d1, d2):
            assert wait_for(lambda p=p: router.pods[p.url].kv_layout == p.kv_layout, timeout=10)
        for _ in range(4):  # round-robin picks the shedding "old" pod first for half of them
            r = _post(srv)
            assert r.status_code == 200, r.text
        assert len(d1.bodies) >= 1 and len(pre.bodies) >= 1  # the scenario ran: prefilled for d1, d1 shed
        assert len(d2.bodies) == 4 and all("kv_transfer_params" not in b for b in d2.bodies)
        fallback = router.metrics.registry.get_sample_value(
            "kvmesh:router_pd_decisions_total", {"path": "fallback_decode_layout"}
        )
        assert fallback == len(pre.bodies)
    finally:
        srv.stop()
        for p in (pre, d1, d2):
            p.stop()


def test_a_request_every_pod_shed_is_held_for_the_retry_after_and_served():
    """With --shed-hold-s, a request both pods shed waits out the soonest Retry-After in the router and
    is tried again: served once a pod has room, a 503 only when the hold would pass the bound."""
    import threading
    import time

    from kvmesh.services.router.config import PodSpec, RouterConfig

    a, b = FakePod().start(), FakePod().start()
    for p in (a, b):
        p.refuse, p.refuse_headers = (503, SHED), {"Retry-After": "1", OVERLOADED_HEADER: "1"}
    cfg = RouterConfig(port=free_port(), pods=(PodSpec(a.url), PodSpec(b.url)), policy="round-robin", shed_hold_s=5)
    srv, router = start_router(cfg, tokenizer=IdTokenizer())
    try:
        threading.Timer(1.5, lambda: setattr(b, "refuse", None)).start()  # b has room again after 1.5 s
        t0 = time.monotonic()
        r = _post(srv)
        assert r.status_code == 200, r.text
        held = router.metrics.registry.get_sample_value("kvmesh:router_shed_holds_total")
        assert held >= 1 and time.monotonic() - t0 >= 1.0  # it waited the Retry-After, at least once
        assert b.bodies and "kv_transfer_params" not in b.bodies[-1]
        # the first try had the pods' own deadline; a try after a hold, what the hold left of the router's
        assert QUEUE_BUDGET_HEADER not in b.headers[0]
        assert 0 < float(b.headers[-1][QUEUE_BUDGET_HEADER]) < cfg.max_queue_wait_s
        b.refuse = (503, SHED)  # both shed for good: 503 once the next hold would pass 5 s
        r = _post(srv)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert router.metrics.registry.get_sample_value("kvmesh:router_shed_holds_total") >= held + 4
        assert router.admission.active == 0
    finally:
        srv.stop()
        a.stop()
        b.stop()
