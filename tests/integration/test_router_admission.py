"""Admission control over real HTTP: the router (one upstream slot, a queue of three) in front of a
`FakePod` whose answers a test holds back (``paused``) to fill the queue deterministically.

A tenant over its RPM or TPM gets 429 with Retry-After while another tenant is served; a tenant
with queued requests does not delay another tenant's request behind all of them (round robin); a
higher-priority key overtakes, a client's priority header cannot raise its key's; a full queue
answers 429, no healthy pod 503; a queue whose estimated wait passes the bound answers 429 when the
tenant's own backlog makes it long and 503 when the service is saturated, each with Retry-After from
the queue; a request over the token budget (n x max_tokens) is a 400 naming max_tokens; a client
that disconnects while queued leaves the queue; afterwards nothing is in flight. Orders of admission
are read from the order the pod received the requests (one slot: admission order), never from wall
times; the queue's finish rate is set by the test, never measured from them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvmesh.services.errors import ENGINE_UNAVAILABLE_HEADER
from kvmesh.testing.pods import FakePod, IdTokenizer, start_router
from kvmesh.testing.pods import wait_for as _wait_for
from kvmesh.topology import free_port

pytestmark = pytest.mark.integration

KEYS = [
    {"key": "alpha-key", "tenant": "alpha"},
    {"key": "beta-key", "tenant": "beta"},
    {"key": "vip-key", "tenant": "vip", "priority": 5},
    {"key": "limited-key", "tenant": "limited", "rpm": 2},
    {"key": "tokens-key", "tenant": "tokens", "tpm": 100},
]
wait_for = functools.partial(_wait_for, timeout=20.0)
PROMPT = " ".join(str(i) for i in range(1, 51))  # IdTokenizer: 50 prompt tokens


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from kvmesh.services.router.config import PodSpec, RouterConfig

    keys = tmp_path_factory.mktemp("adm") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    pod = FakePod().start()
    cfg = RouterConfig(
        port=free_port(),
        pods=(PodSpec(pod.url),),
        policy="round-robin",
        api_keys_file=str(keys),
        max_concurrent_requests=1,
        queue_size=3,
    )
    srv, router = start_router(cfg, tokenizer=IdTokenizer())
    with ThreadPoolExecutor(16) as pool:
        yield srv, router, pod, pool
    srv.stop()
    pod.stop()


@pytest.fixture
def settled(stack):
    """After the test: every request answered, nothing in flight or queued."""
    yield
    _, router, pod, _ = stack
    pod.paused = False
    assert wait_for(lambda: router.admission.active == 0 and router.admission.waiting == 0 and pod.inflight == 0)
    assert router.metrics.registry.get_sample_value("kvmesh:router_active_requests") == 0


def post(url: str, key: str, max_tokens: int = 1, **headers) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": max_tokens},
        headers={"Authorization": f"Bearer {key}", **headers},
        timeout=60,
    )


def rejected(router, reason: str, tenant: str) -> float:
    return (
        router.metrics.registry.get_sample_value(
            "kvmesh:router_rejected_requests_total", {"reason": reason, "tenant": tenant}
        )
        or 0.0
    )


def hold_one(stack, key: str = "alpha-key"):
    """Pause the pod and put one request in the only slot; returns (its future, the pod's body count before)."""
    srv, _, pod, pool = stack
    pod.paused = True
    n0 = len(pod.bodies)
    f = pool.submit(post, srv.url, key)
    assert wait_for(lambda: len(pod.bodies) == n0 + 1)
    return f, n0


def queue(stack, key: str, **headers):
    srv, router, _, pool = stack
    before = router.admission.waiting
    f = pool.submit(post, srv.url, key, **headers)
    assert wait_for(lambda: router.admission.waiting == before + 1)
    return f


def tenants_seen(pod, n0: int) -> list[str]:
    return [b["cache_salt"] for b in pod.bodies[n0:]]


def test_rpm_sheds_one_tenant_while_another_is_served(stack, settled):
    srv, router, _, _ = stack
    assert [post(srv.url, "limited-key").status_code for _ in range(2)] == [200, 200]
    r = post(srv.url, "limited-key")
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "RateLimitError" and "requests per minute" in r.json()["error"]["message"]
    assert post(srv.url, "beta-key").status_code == 200
    assert post(srv.url, "limited-key").status_code == 429
    assert rejected(router, "rpm", "limited") == 2 and rejected(router, "rpm", "beta") == 0


def test_tpm_counts_prompt_and_max_tokens_then_usage(stack, settled):
    srv, router, pod, _ = stack
    first, _ = hold_one(stack, "tokens-key")  # 50 prompt + 1 max_tokens: 51 of the 100 charged
    r = post(srv.url, "tokens-key", max_tokens=40)  # 90 more: over the 49 left
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert "tokens per minute" in r.json()["error"]["message"]
    other = queue(stack, "beta-key")  # another tenant is not refused: it waits for the slot
    pod.paused = False
    assert first.result().status_code == 200 and other.result().status_code == 200
    # the pod reported 2 tokens used: the rest of the estimate came back, so 90 fit now
    assert post(srv.url, "tokens-key", max_tokens=40).status_code == 200
    big = post(srv.url, "tokens-key", max_tokens=60)  # 110 > the whole minute's 100: never admissible
    # a client error, not a rate limit: no Retry-After (waiting would never help), and it says why
    assert big.status_code == 400 and "retry-after" not in big.headers
    err = big.json()["error"]
    assert err["type"] == "BadRequestError" and err["param"] == "max_tokens" and "never be admitted" in err["message"]
    assert rejected(router, "tpm", "tokens") == 2 and rejected(router, "tpm", "beta") == 0


def test_fair_across_tenants_not_fifo(stack, settled):
    _, _, pod, _ = stack
    first, n0 = hold_one(stack, "alpha-key")
    waiting = [queue(stack, "alpha-key"), queue(stack, "alpha-key"), queue(stack, "beta-key")]
    pod.paused = False
    assert [f.result().status_code for f in (first, *waiting)] == [200] * 4
    # beta came last but alpha was admitted last: beta's one request goes before alpha's queued two
    assert tenants_seen(pod, n0) == ["alpha", "beta", "alpha", "alpha"]


def test_priority_overtakes_and_the_header_cannot_raise_it(stack, settled):
    _, router, pod, _ = stack
    first, n0 = hold_one(stack, "alpha-key")
    a2 = queue(stack, "alpha-key")
    a3 = queue(stack, "alpha-key", **{"x-kvmesh-priority": "9"})  # capped at alpha's key: 0
    assert router.metrics.registry.get_sample_value("kvmesh:router_queue_depth", {"priority": "0"}) == 2
    vip = queue(stack, "vip-key")
    pod.paused = False
    assert [f.result().status_code for f in (first, a2, a3, vip)] == [200] * 4
    assert tenants_seen(pod, n0) == ["alpha", "vip", "alpha", "alpha"]
    assert router.metrics.registry.get_sample_value("kvmesh:router_queue_depth", {"priority": "0"}) == 0


def test_full_queue_gets_429(stack, settled):
    srv, router, pod, _ = stack
    first, _ = hold_one(stack)
    queued = [queue(stack, "alpha-key") for _ in range(3)]
    r = post(srv.url, "beta-key")
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and "queue is full" in r.text
    assert rejected(router, "queue_full", "beta") == 1
    pod.paused = False
    assert [f.result().status_code for f in (first, *queued)] == [200] * 4


def test_queue_bounded_by_estimated_wait_429_for_own_backlog_503_when_saturated(stack, settled):
    srv, router, pod, _ = stack
    adm = router.admission
    first, n0 = hold_one(stack)
    bound = adm.max_queue_wait
    try:
        # One admitted request finishes every 10 s (as measured); a request may wait 15 s at most.
        adm.finishes.rate, adm.max_queue_wait = 0.1, 15.0
        queued = queue(stack, "alpha-key")  # 1 slot to free: 10 s, within the bound
        # alpha's next: its own queued request goes first, 20 s; alone it would fit: 429, its backlog
        r = post(srv.url, "alpha-key")
        assert r.status_code == 429 and r.headers["retry-after"] == "5"  # 20 s - 15 s, from the queue
        assert r.json()["error"]["type"] == "RateLimitError" and "alpha" in r.json()["error"]["message"]
        # beta's first: alpha's queued request has the next turn, 20 s even alone: the service is saturated
        r = post(srv.url, "beta-key")
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert ENGINE_UNAVAILABLE_HEADER not in r.headers and "saturated" in r.json()["error"]["message"]
        assert rejected(router, "queue_wait", "alpha") == 1 and rejected(router, "saturated", "beta") == 1
    finally:
        adm.max_queue_wait = bound
    pod.paused = False
    assert [f.result().status_code for f in (first, queued)] == [200, 200]
    assert tenants_seen(pod, n0) == ["alpha", "alpha"]  # the refused requests never reached the pod


def test_request_over_the_token_budget_is_a_400_at_the_router(stack, settled):
    srv, router, pod, _ = stack
    n0 = len(pod.bodies)
    body = {"prompt": PROMPT, "n": 100, "max_tokens": 8000}  # the probe's 800,000 tokens
    r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer beta-key"}, timeout=60)
    assert r.status_code == 400 and "retry-after" not in r.headers
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "800000" in err["message"] and "65536" in err["message"]
    assert len(pod.bodies) == n0  # answered by the router, before any queue or pod


def test_a_prompt_over_the_context_is_a_400_at_the_router(stack, settled):
    """The router checks the context after its own tokenization, as a pod would, so the request never
    waits in a queue nor reaches a pod."""
    srv, router, pod, _ = stack
    n0, cfg = len(pod.bodies), router.cfg
    router.cfg = dataclasses.replace(cfg, max_model_len=40)  # PROMPT is 50 tokens
    try:
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": PROMPT},
            headers={"Authorization": "Bearer beta-key"},
            timeout=60,
        )
    finally:
        router.cfg = cfg
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "maximum context length is 40 tokens" in r.json()["error"]["message"]
    assert len(pod.bodies) == n0


def test_client_gone_while_queued_leaves_the_queue(stack, settled):
    srv, router, pod, _ = stack
    first, n0 = hold_one(stack)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    raw = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer beta-key\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(raw)
        assert wait_for(lambda: router.admission.waiting == 1)
    assert wait_for(lambda: router.admission.waiting == 0)
    assert rejected(router, "client_gone", "beta") == 1
    pod.paused = False
    assert first.result().status_code == 200
    assert tenants_seen(pod, n0) == ["alpha"]  # the abandoned request never reached the pod


def test_no_healthy_pod_gets_503_with_retry_after():
    from kvmesh.services.router.config import PodSpec, RouterConfig

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = RouterConfig(port=free_port(), pods=(PodSpec(dead),), api_keys=("k",))
    srv, router = start_router(cfg, tokenizer=IdTokenizer())
    try:
        r = post(srv.url, "k")
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        assert rejected(router, "no_pod", "default") == 1
        assert router.admission.active == 0 and router.admission.waiting == 0
    finally:
        srv.stop()
