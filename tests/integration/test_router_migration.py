"""A pod killed under a request never fails it: the router migrates the request to another pod.

Three real `kvmesh serve` pods behind an in-process router. Each test SIGKILLs the pod (or engine) serving a
request in flight, found through the router's per-pod in-flight count and the pod's pid:

- a non-streaming request is sent whole to another pod, and its answer is the uninterrupted one (its
  headers come with its body, so this is the router's retry before the first byte);
- a chat stream (the official `openai` client) continues on another pod from the tokens already streamed:
  one stream (same id), the text equal to the uninterrupted greedy answer, usage counting it all;
- with no pod left, a stream whose engine dies ends with an error event, never a silent cut.

The migration counter moves, and nothing leaks: no flight or admission slot left in the router, no running
request or KV block on the surviving pods.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import httpx
import pytest

from kvmesh.testing.pods import wait_for as _wait_for
from kvmesh.testing.servers import wait_pools_idle

pytestmark = pytest.mark.integration

ENV = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"}
BS = 16
TOKENS = 40  # long enough (~2 s on a shared CPU) to kill its pod mid-way
wait_for = functools.partial(_wait_for, timeout=30.0, poll=0.01)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from kvmesh.testing.pods import serve_pods_behind_router

    args = ["--max-model-len", "512", "--num-kv-blocks", "64", "--block-size", str(BS), "--engine-restarts", "0"]
    d = tmp_path_factory.mktemp("router-migration")
    # health checks far apart: the router learns of each death from the request it breaks
    with serve_pods_behind_router(d, [args, args, args], ENV, block_size=BS, health_interval=600.0) as running:
        yield running


def _migrations(router, reason: str) -> float:
    return router.metrics.migrations.labels(reason)._value.get()


def _moved(router) -> float:
    """Requests sent to another pod after theirs failed: before its answer's headers (retries: a
    non-streaming answer's headers come with its body) or after (migrations)."""
    m = router.metrics
    return sum(c._value.get() for c in (*m.retries._metrics.values(), *m.migrations._metrics.values()))


def _serving(router, pods):
    """The pod with a request in flight (the test sends one at a time)."""
    assert wait_for(lambda: any(router.pods[p.base_url].inflight_requests > 0 for p in pods))
    busy = [p for p in pods if router.pods[p.base_url].inflight_requests > 0]
    assert len(busy) == 1, busy
    return busy[0]


def _no_leak(router, pods) -> None:
    assert wait_for(lambda: all(p.inflight_requests == 0 for p in router.pods.values()))
    assert wait_for(lambda: router.admission.active == 0)
    for p in pods:
        if p.proc.poll() is None and router.pods[p.base_url].healthy:
            m = wait_pools_idle(p.base_url)
            assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0, m


def _kill(pod) -> None:
    os.kill(pod.proc.pid, signal.SIGKILL)  # the pod's main process: its connections reset
    pod.proc.wait(10)


def test_stream_continues_on_another_pod(cluster):
    import openai

    srv, router, pods = cluster
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Tell me about the sea and the ships on it."}]
    kw = dict(model=router.model, messages=messages, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True})
    ref = client.chat.completions.create(**kw)
    before = _migrations(router, "disconnect")
    taken = sum(_taken_as_migrations(p) for p in pods)
    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks, text = [], ""
    victim = None
    for chunk in stream:
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if victim is None and len(chunks) == 4:
            victim = _serving(router, [p for p in pods if p.proc.poll() is None])
            _kill(victim)
    assert victim is not None
    assert text == ref.choices[0].message.content  # greedy: the same answer as an uninterrupted run
    assert {c.id for c in chunks} == {chunks[0].id} and {c.created for c in chunks} == {chunks[0].created}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == TOKENS
    assert usage.prompt_tokens == ref.usage.prompt_tokens  # the original prompt, not the continuation's
    assert not any("token_ids" in (c.choices[0].model_extra or {}) for c in chunks if c.choices)  # not asked for
    assert _migrations(router, "disconnect") == before + 1
    # the continuation went as a migration (MIGRATED_HEADER): a pod took it, never shed by its deadline
    assert sum(_taken_as_migrations(p) for p in pods if p.proc.poll() is None) == taken + 1
    _no_leak(router, pods)


def _taken_as_migrations(pod) -> float:
    from kvmesh.common import metric_names as mn
    from kvmesh.testing.servers import pool_metrics

    return pool_metrics(pod.base_url).get(mn.total(mn.MIGRATED_REQUESTS), 0.0)


def test_non_streaming_request_survives_its_pod(cluster):
    srv, router, pods = cluster
    body = {"prompt": "The history of the printing press", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    ref = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert ref.status_code == 200, ref.text
    before = _moved(router)
    out: dict = {}
    t = threading.Thread(
        target=lambda: out.update(r=httpx.post(srv.url + "/v1/completions", json=body, timeout=120)), daemon=True
    )
    t.start()
    victim = _serving(router, pods)
    time.sleep(0.3)  # mid-generation
    _kill(victim)
    t.join(120)
    r = out["r"]
    assert r.status_code == 200, r.text
    assert r.headers["x-kvmesh-pod"] != victim.base_url
    assert r.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
    assert r.json()["usage"]["completion_tokens"] == TOKENS
    assert _moved(router) == before + 1
    assert router.pods[victim.base_url].healthy is False
    _no_leak(router, pods)


def test_stream_with_no_pod_left_ends_with_an_error_event(cluster):
    srv, router, pods = cluster
    (last,) = [p for p in pods if p.proc.poll() is None]
    body = {
        "prompt": "A list of rivers:",
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events = []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    os.kill(last.engine_pid(), signal.SIGKILL)  # its engine dies: the pod's error event
    assert events[-1] == "[DONE]"
    err = httpx.Response(200, content=events[-2]).json()
    assert err["error"]["code"] == 503 and "failed (engine_error)" in err["error"]["message"], err
    assert all('"error"' not in e for e in events[:-2])
    assert router.pods[last.base_url].healthy is False
    _no_leak(router, pods)
