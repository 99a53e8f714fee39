"""A pod that sheds a request (503 with Retry-After and the overload header: its queue would hold the
request past its deadline; it admitted nothing) is not the client's answer while another pod of the role
has room: the router tries the others, and refuses only when every pod shed it, with the soonest
Retry-After. Real router and HTTP, two stand-in pods (kvmesh.testing.pods.FakePod) that shed on demand."""

from __future__ import annotations

import httpx
import pytest

from kvmesh.services.errors import ENGINE_UNAVAILABLE_HEADER, OVERLOADED_HEADER
from kvmesh.testing.pods import FakePod, IdTokenizer, start_router
from kvmesh.topology import free_port

pytestmark = pytest.mark.integration
SHED = {"error": {"message": "server is overloaded", "type": "ServiceUnavailableError", "code": 503}}


@pytest.fixture
def two():
    from kvmesh.services.router.config import PodSpec, RouterConfig

    a, b = FakePod().start(), FakePod().start()
    cfg = RouterConfig(port=free_port(), pods=(PodSpec(a.url), PodSpec(b.url)), policy="round-robin")
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
