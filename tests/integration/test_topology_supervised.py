"""`kvmesh up`'s topology keeps serving when one of its processes dies, and starts it again.

Real processes on loopback (redis-server, one prefill and two decode servers with their engines, the
router), driven the way `kvmesh up` drives them: `Topology.supervise()` once a second. A decode worker
SIGKILLed with streams in flight and under a stream of requests: the streams finish right (the router
continues them on the other decode worker), the requests go on (the router takes the dead worker out),
and the worker comes back on its URL and serves again. The redis-server killed: it comes back, and
requests stay right meanwhile (blocks the store lost are recomputed).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvmesh import SamplingParams

pytestmark = pytest.mark.integration
BS = 16
WORKER_ARGS = ("--max-model-len", "512", "--num-kv-blocks", "128", "--block-size", str(BS))


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    from kvmesh.topology import Topology, TopologyConfig, free_port

    mp = pytest.MonkeyPatch()
    mp.setenv("KVMESH_CPU_THREADS", "1")
    cfg = TopologyConfig(
        port=free_port(),
        num_decode=2,
        kv_connector="redis",
        engine_args=WORKER_ARGS,
        router_args=("--pd-min-uncached", "0", "--block-size", str(BS)),
        log_dir=str(tmp_path_factory.mktemp("up-supervised")),
        startup_timeout_s=600,
    )
    t = Topology(cfg)
    t.start()
    stop = threading.Event()

    def supervise() -> None:  # what `kvmesh up` does every second
        while not stop.wait(0.5):
            t.supervise()

    th = threading.Thread(target=supervise, daemon=True)
    th.start()
    yield t
    stop.set()
    th.join(5)
    procs = [p for _, p in t.procs]
    t.stop()
    mp.undo()
    assert all(p.poll() is not None for p in procs), "kvmesh up left a process running"


@pytest.fixture(scope="module")
def reference(make_llm):
    llm = make_llm()
    return lambda prompt, n=6: llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n))[0].outputs[0].text


def _ask(t, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    return httpx.post(t.router_url + "/v1/completions", json=body, timeout=120)


def _healthy_at_router(t, url: str) -> bool:
    pods = httpx.get(t.router_url + "/pods", timeout=10).json()
    return any(p["url"] == url and p["healthy"] for p in pods["pods"])


def _stream(t, prompt: str, n: int) -> str:
    """A streamed completion's text, read chunk by chunk (an error event or a cut stream fails)."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    text, done = [], False
    with httpx.stream("POST", t.router_url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text.append(chunk["choices"][0]["text"])
    assert done, "the stream ended without [DONE]"
    return "".join(text)


def test_a_killed_decode_worker_comes_back_and_nothing_fails_meanwhile(topo, reference):
    victim = next(w for w in topo.workers if w.name == "decode-0")
    assert victim.proc is not None
    old_pid = victim.proc.pid
    # streams in flight on both decode workers when one dies: the router continues each on the other
    prompts = [f"Stream {i}: once upon a time, in a land far away, there lived" for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(_stream, topo, p, 96) for p in prompts]
        time.sleep(1.5)  # their prefills done, tokens streaming
        os.killpg(old_pid, signal.SIGKILL)  # the server and its engine, as the OOM killer would
        for p, f in zip(prompts, futs):
            assert f.result() == reference(p, 96), p
    metrics = httpx.get(topo.router_url + "/metrics", timeout=10).text
    migrated = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kvmesh:router_migrations_total{")
    )
    assert migrated >= 1, "no stream was on the killed worker"
    answered, deadline = 0, time.monotonic() + 300
    while True:  # every request meanwhile is answered, and right (by decode-1)
        prompt = f"Item {answered}: the quick brown fox jumps over the lazy dog, again and again"
        r = _ask(topo, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference(prompt)
        answered += 1
        if victim.proc.pid != old_pid and _healthy_at_router(topo, victim.url):
            break
        assert time.monotonic() < deadline, "decode-0 did not come back"
    assert answered >= 1
    # decode-0 serves again: sent to it directly (the router's key), it answers right
    key = {"Authorization": f"Bearer {topo.upstream_key}"}
    body = {"prompt": "Back again", "max_tokens": 6, "temperature": 0}
    r = httpx.post(victim.url + "/v1/completions", json=body, headers=key, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference("Back again")


def test_a_killed_redis_server_comes_back_and_requests_stay_right(topo, reference):
    name, redis = next((n, p) for n, p in topo.procs if n == "redis")
    redis.kill()
    redis.wait(10)
    deadline = time.monotonic() + 60
    while True:
        prompt = "A long prompt about the history of computing, from calculators to transistors."
        r = _ask(topo, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference(prompt)
        new = next(p for n, p in topo.procs if n == name)
        if new is not redis and new.poll() is None:
            break
        assert time.monotonic() < deadline, "redis-server did not come back"
        time.sleep(0.5)


def test_kvmesh_up_killed_leaves_no_process_behind(tmp_path):
    """`kvmesh up` SIGKILLed (the OOM killer, a kill -9): its servers see their parent gone and shut
    down in order, taking their engines along, and the kernel ends its redis-server; nothing is left."""
    import subprocess

    from kvmesh.common.python_child import kvmesh_command
    from kvmesh.testing.servers import alive, descendants
    from kvmesh.topology import free_port

    argv = kvmesh_command("up", "--port", str(free_port()), "--kv-connector", "redis", "--log-dir", str(tmp_path))
    for a in WORKER_ARGS:
        argv.append(f"--worker-arg={a}")
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, "KVMESH_CPU_THREADS": "1"})
    try:
        assert up.stdout is not None
        for line in up.stdout:  # kvmesh up prints "ready: ..." once the router answers
            if line.startswith("ready:"):
                break
        else:
            pytest.fail(f"kvmesh up exited with {up.wait()} before it was ready")
        kids = descendants(up.pid)
        assert len(kids) >= 6, kids  # redis, 2 servers + 2 engines, the router
        up.kill()
        up.wait(10)
        end = time.monotonic() + 60
        while any(alive(k) for k in kids) and time.monotonic() < end:
            time.sleep(0.5)
        assert not [k for k in kids if alive(k)], "processes outlived kvmesh up"
    finally:
        if up.poll() is None:
            up.kill()
        for k in descendants(up.pid):
            os.kill(k, signal.SIGKILL)
