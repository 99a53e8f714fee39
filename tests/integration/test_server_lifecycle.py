"""Admission control and engine death against a live `kvmesh serve` with one running slot.

``--max-num-seqs 1 --max-waiting 1``: one request runs, one waits, the next is
refused with 503 + Retry-After. The engine-kill test runs last in this module
because it ends the server's engine (each test leaves the server usable for the next otherwise).
``--engine-restarts 0``: a dead engine stays dead, so /health stays 503 and the pod's liveness probe
restarts the pod (the restart itself is tested in test_robustness.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from kvmesh.health import exited, wait_until

pytestmark = pytest.mark.integration

ENV = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"}
LONG = {"prompt": "Tell me a long story.", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(serve_log):
    from kvmesh.testing.servers import ServerProcess, alive

    with ServerProcess(
        [
            *("--max-model-len", "512", "--num-kv-blocks", "128", "--max-num-seqs", "1", "--max-waiting", "1"),
            *("--engine-restarts", "0"),
        ],
        env=ENV,
        log_path=serve_log,
    ) as srv:
        yield srv
        engine = srv.engine_pid()
    assert srv.proc.poll() is not None
    assert engine is None or not alive(engine)


def _first_data(lines) -> str:
    for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("stream ended without data")


def _waiting(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if fam.name == "vllm:num_requests_waiting":
            return fam.samples[0].value
    raise AssertionError("no vllm:num_requests_waiting")


def test_queue_full_gets_503_with_retry_after(server):
    url = server.base_url
    stop = threading.Event()

    def waiting_client():
        # B: its response headers come only with its first token, so it runs in a thread until told to stop
        with httpx.Client(base_url=url, timeout=300) as b:
            with b.stream("POST", "/v1/completions", json=LONG) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

    with httpx.Client(base_url=url, timeout=120) as a:
        with a.stream("POST", "/v1/completions", json=LONG) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            _first_data(lines)  # A produced a token: it holds the only running slot
            t = threading.Thread(target=waiting_client, daemon=True)
            t.start()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _waiting(url) < 1:
                next(lines)  # keep A flowing while B reaches the engine's waiting queue
            assert _waiting(url) == 1
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
            assert r.status_code == 503, r.text
            assert r.headers.get("retry-after") == "1"
            err = r.json()["error"]
            assert err["code"] == 503 and "overloaded" in err["message"]
            stop.set()
    t.join(120)

    # both streams were dropped: the server recovers and serves again
    def serves() -> bool:
        return (
            httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60).status_code == 200
        )

    wait_until(serves, 120, "the server serving again", exited(server.proc), poll=0.5)


def test_engine_death_fails_requests_and_health(server):
    url = server.base_url
    engine = server.engine_pid()
    assert engine is not None
    assert httpx.get(url + "/health").status_code == 200
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=LONG) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            _first_data(lines)
            os.kill(engine, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]  # must end, not hang (timeout=60)
    assert rest[-1] == "data: [DONE]"
    assert any('"error"' in line and "engine" in line for line in rest)
    deadline = time.monotonic() + 30
    health = None
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health", timeout=10)
        if health.status_code == 503:
            break
        time.sleep(0.2)
    assert health is not None and health.status_code == 503
    assert health.json()["error"]["code"] == 503
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert server.proc.poll() is None  # the API process is alive and answering, not hung
