"""The router's memory is bounded: many distinct prompts leave its per-request structures empty and
its index and metric label sets within their limits (the probe saw ~177 MB of growth that stayed).

Real HTTP through the router to fake pods that publish no events (approximate mode: the predicted
index is the only record of what a pod holds, so it is the structure that grew).
"""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from kvmesh.services.router.config import PodSpec, RouterConfig
from kvmesh.testing.pods import FakePod, IdTokenizer, start_router
from kvmesh.topology import free_port

pytestmark = pytest.mark.integration
CAPACITY = 256


def test_many_distinct_prompts_leave_bounded_state():
    pods = [FakePod().start() for _ in range(2)]
    cfg = RouterConfig(
        port=free_port(), block_size=16, pods=tuple(PodSpec(p.url) for p in pods), approx_capacity=CAPACITY
    )
    srv, router = start_router(cfg, IdTokenizer())
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:

            def one(i: int) -> int:
                prompt = [i * 1000 + k for k in range(64)]  # 4 blocks no other prompt shares
                return c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code

            with cf.ThreadPoolExecutor(8) as ex:
                codes = list(ex.map(one, range(400)))
            assert codes.count(200) == 400
            for i in range(50):  # paths and bad requests clients choose must not add metric series
                c.post(f"/v1/x{i}", json={})
                c.post("/v1/completions", json={"prompt": [1], "max_tokens": f"{i}"})
        # 1,600 blocks were routed; each pod keeps at most CAPACITY of them
        assert router.index.size()["predicted"] <= 2 * CAPACITY
        assert all(len(router.index._predicted[p.url]) == CAPACITY for p in pods)
        for pod in router.pods.values():
            assert pod.inflight_requests == 0 and pod.inflight_tokens == 0 and not pod.inflight_blocks
        labels = {s.labels.get("endpoint") for m in router.metrics.requests.collect() for s in m.samples}
        assert labels <= {"/v1/completions", "/v1/chat/completions", "other"}
        statuses = {s.labels["status"] for m in router.metrics.requests.collect() for s in m.samples}
        assert statuses == {"200", "400"}
    finally:
        srv.stop()
        for p in pods:
            p.stop()
