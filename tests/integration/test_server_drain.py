"""POST /drain on a live `kvmesh serve --simulate`: a stream in flight completes, /health turns 503
(readiness: the EndpointSlice drops the pod, so routers stop sending it work) while /live stays
200 (liveness: a draining pod is not restarted), new requests are still answered, GET /drain
reports idle once nothing is open, DELETE /drain makes it ready again; /drain takes the admin key,
never a client's."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.integration

KEY = "drain-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": "Bearer drain-test-admin-key"}
# 20 ms per decode step: a 40-token stream lasts about a second, long enough to drain under it.
ENV = {
    "KVMESH_CPU_THREADS": "1",
    "KVMESH_LOG_LEVEL": "WARNING",
    "KVMESH_API_KEY": KEY,
    "KVMESH_ADMIN_KEY": "drain-test-admin-key",
}


@pytest.fixture(scope="module")
def server(serve_log):
    from kvmesh.testing.servers import ServerProcess

    with ServerProcess(
        ["--simulate", "--sim-decode-ms", "20,0", "--max-model-len", "512", "--num-kv-blocks", "64"],
        env=ENV,
        log_path=serve_log,
    ) as srv:
        yield srv


def test_drain_lets_the_open_stream_finish_and_turns_readiness_off(server) -> None:
    url = server.base_url
    body = {"prompt": "Tell me a story.", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=60, headers=AUTH) as c:
        assert c.post("/drain", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.post("/drain").status_code == 403  # a client's key
        assert c.get("/health").status_code == 200
        with c.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert first
            state = c.post("/drain", headers=ADMIN).json()
            assert state["draining"] is True and state["open_requests"] == 1 and not state["idle"]
            health = c.get("/health")
            assert health.status_code == 503 and "draining" in health.json()["error"]["message"]
            assert c.get("/live").status_code == 200
            # A request that still reaches a draining server is answered, not dropped.
            late = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert late.status_code == 200 and late.json()["usage"]["completion_tokens"] == 3
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        tokens = sum(1 for line in [first, *rest] if line != "data: [DONE]" and '"text"' in line)
        assert tokens >= 40  # the whole stream came through
        deadline = time.monotonic() + 30
        state = c.get("/drain", headers=ADMIN).json()
        while not state["idle"] and time.monotonic() < deadline:
            time.sleep(0.1)
            state = c.get("/drain", headers=ADMIN).json()
        assert state == {"draining": True, "open_requests": 0, "running": 0, "waiting": 0, "held": 0, "idle": True}
        assert c.delete("/drain", headers=ADMIN).json()["draining"] is False
        assert c.get("/health").status_code == 200
