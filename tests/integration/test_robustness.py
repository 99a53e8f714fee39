"""One request cannot hurt a `kvmesh serve` or the router in front of it (the security probe's findings).

One live server (the embedded model on the CPU, 512-token context) and one router in front of it, for
the whole module. Every bad input gets a 4xx in the OpenAI error schema at both, and a normal request
still succeeds afterwards; slow bodies are cut off; a non-streaming request whose client leaves is
aborted at the server and through the router (its blocks freed); the router's OpenAPI declares its
request bodies; a SIGKILLed engine is restarted with no process left behind. The engine test runs last:
it restarts the engine the other tests use. (`kvmesh bench fuzz`, schemathesis against both, is
tests/bench/test_bench_fuzz_live.py.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from kvmesh.health import wait_healthy
from kvmesh.testing.servers import ServerProcess, alive, descendants, pool_metrics, wait_pools_idle

pytestmark = pytest.mark.integration

ENV = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"}
BODY_TIMEOUT = 2.0
HEADER_TIMEOUT = 2.0
OK = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(serve_log):
    with ServerProcess(
        [
            "--max-model-len",
            "512",
            "--num-kv-blocks",
            "256",
            "--stats-interval",
            "0.1",
            "--body-timeout",
            str(BODY_TIMEOUT),
            "--header-timeout",
            str(HEADER_TIMEOUT),
        ],
        env=ENV,
        log_path=serve_log,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def router(server):
    from kvmesh.services.router.config import PodSpec, RouterConfig
    from kvmesh.testing.pods import start_router
    from kvmesh.topology import free_port

    cfg = RouterConfig(
        host="127.0.0.1",
        port=free_port(),
        pods=(PodSpec(server.base_url),),
        health_interval=0.3,
        body_timeout=BODY_TIMEOUT,
        header_timeout=HEADER_TIMEOUT,
    )
    srv, rt = start_router(cfg)
    yield srv.url
    srv.stop()


@pytest.fixture(params=["server", "router"])
def url(request, server, router) -> str:
    return server.base_url if request.param == "server" else router


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def still_serves(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json=OK, timeout=60)
    assert r.status_code == 200, r.text


DEEP = b'{"prompt": "hi", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
BAD_JSON = {
    "seed out of int64": (json.dumps({**OK, "seed": 2**70}).encode(), "seed"),
    "nested 10,000 deep": (DEEP, None),
    "invalid UTF-8": (b'{"prompt": "\xff\xfe", "max_tokens": 2}', None),
    "max_tokens as a string": (json.dumps({**OK, "max_tokens": "10"}).encode(), "max_tokens"),
    "n as a string": (json.dumps({**OK, "n": "2"}).encode(), "n"),
    "stream as a string": (json.dumps({**OK, "stream": "yes"}).encode(), "stream"),
    "n over 128": (json.dumps({**OK, "n": 129}).encode(), "n"),
    "five stop strings": (json.dumps({**OK, "stop": list("abcde")}).encode(), "stop"),
    "a 100 KB stop string": (json.dumps({**OK, "stop": "x" * 100_000}).encode(), "stop"),
    "logprobs 50": (json.dumps({**OK, "logprobs": 50}).encode(), "logprobs"),
    "200 prompts of n=2": (json.dumps({**OK, "prompt": ["a"] * 200, "n": 2}).encode(), "prompt"),
    "not an object": (b"[1, 2]", None),
    "a token id beyond 64 bits": (json.dumps({**OK, "prompt": [1, 2**70]}).encode(), "prompt"),  # found by fuzzing
}


@pytest.mark.parametrize("case", list(BAD_JSON))
def test_bad_input_is_a_400_in_the_openai_schema(url, case):
    body, param = BAD_JSON[case]
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    err = assert_openai_error(r, 400)
    if param is not None:
        assert err["param"] == param, err


def test_limits_of_body_and_headers(url):
    r = httpx.post(url + "/v1/completions", content=json.dumps(OK), headers={"content-type": "text/plain"})
    assert_openai_error(r, 400)
    big = json.dumps({**OK, "prompt": "x" * (10 << 20)})
    assert_openai_error(httpx.post(url + "/v1/completions", content=big, timeout=60), 413)
    many = {f"x-h{i}": "v" for i in range(200)}
    assert_openai_error(httpx.post(url + "/v1/completions", json=OK, headers=many), 431)
    assert_openai_error(httpx.post(url + "/v1/completions", json=OK, headers={"x-big": "v" * 65536}), 431)
    assert_openai_error(httpx.get(url + "/no/such/path"), 404)
    still_serves(url)


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=60)
    return s


def test_slow_body_is_cut_off(url):
    """A body that trickles in gets 408 after --body-timeout, not a connection held forever."""
    s = _raw(url)
    try:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        deadline = time.monotonic() + 10 * BODY_TIMEOUT  # trickle for longer than the limit
        got = b""
        s.settimeout(0.5)
        while time.monotonic() < deadline and b"\r\n\r\n" not in got:
            try:
                s.sendall(b" ")
                got += s.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
    finally:
        s.close()
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    still_serves(url)


def test_slow_headers_and_idle_connections_are_cut_off(url):
    """Slowloris: headers that trickle in one line at a time get 408 (OpenAI schema) and a closed
    connection after --header-timeout; a connection that sends nothing is closed too. Neither holds
    the server's connection for ever."""
    s = _raw(url)
    got = b""
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(0.3)
        deadline = time.monotonic() + 10 * HEADER_TIMEOUT  # trickle for longer than the limit
        while time.monotonic() < deadline:
            try:
                s.sendall(b"x-slow: 1\r\n")
                chunk = s.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            got += chunk
    finally:
        s.close()
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    err = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == 408 and err["type"] == "RequestTimeoutError"  # services/errors.py's, as every error
    idle = _raw(url)
    try:
        idle.settimeout(10 * HEADER_TIMEOUT)
        assert idle.recv(100) == b""  # closed by the server, nothing sent
    finally:
        idle.close()
    still_serves(url)


def test_non_streaming_request_whose_client_left_is_aborted(server, url):
    """The probe's abandoned non-streaming requests kept generating; now the engine aborts them."""
    before = wait_pools_idle(server.base_url)
    body = json.dumps({"prompt": "Write a long story about dragons.", "max_tokens": 400, "ignore_eos": True})
    s = _raw(url)
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    deadline = time.monotonic() + 60
    while pool_metrics(server.base_url)["vllm:num_requests_running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool_metrics(server.base_url)["vllm:num_requests_running"] == 1
    s.close()  # the client leaves without reading the answer
    after = wait_pools_idle(server.base_url)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0.0
    ended = {k: v - before.get(k, 0) for k, v in after.items() if k.startswith("vllm:request_success_total")}
    assert ended["vllm:request_success_total{finished_reason=abort}"] == 1, ended
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 400


def test_streaming_request_whose_client_left_is_aborted(server, url):
    before = wait_pools_idle(server.base_url)
    body = {"prompt": "Write a long story about dragons.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
    after = wait_pools_idle(server.base_url)
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 400


def test_router_openapi_declares_bodies_and_content_types(router):
    spec = httpx.get(router + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = spec["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in ("CompletionRequest", "ChatCompletionRequest")
        assert "400" in op["responses"]
    assert "max_tokens" in spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    r = httpx.get(router + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert not spec["paths"]["/health"]["get"]["responses"]["200"].get("content")
    assert httpx.get(router + "/health").content == b""


# ---- last: restarts the engine ------------------------------------------------------------------
def test_killed_engine_is_restarted(server, router):
    """SIGKILL the engine core: the in-flight request gets a 503, /health goes 503 then 200, new requests
    are served by a new engine, and the old one is gone (no leaked process)."""
    old = server.engine_pid()
    assert old is not None
    result: dict = {}

    def long_request():
        body = {"prompt": "Count to a thousand:", "max_tokens": 300, "ignore_eos": True}
        result["r"] = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 60
    while pool_metrics(server.base_url)["vllm:num_requests_running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(old, signal.SIGKILL)
    t.join(120)
    assert_openai_error(result["r"], 503)
    wait_healthy(server.base_url, 300, server.proc, "the server after its engine's restart")
    assert httpx.get(server.base_url + "/health").status_code == 200
    new = server.engine_pid()
    assert new is not None and new != old and not alive(old)
    assert descendants(server.proc.pid) == {new}
    still_serves(server.base_url)
    # the router took the pod out while its engine was down and back in after
    wait_healthy(router, 30, what="the router with the pod back")
    still_serves(router)
    assert wait_pools_idle(server.base_url)["vllm:kv_cache_usage_perc"] == 0.0
