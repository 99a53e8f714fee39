"""`kvmesh up`'s topology keeps serving when one of its processes dies, and starts it again.

Real processes on loopback (redis-server, one prefill and two decode servers with their engines, the
router), driven the way `kvmesh up` drives them: `Topology.supervise()` once a second. A decode worker
SIGKILLed under a stream of requests: the requests go on (the router takes the dead worker out), and
the worker comes back on its URL and serves again. The redis-server killed: it comes back, and
requests stay right meanwhile (blocks the store lost are recomputed).
"""

from __future__ import annotations

import os
import signal
import threading
import time

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
    return lambda prompt: llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].text


def _ask(t, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    return httpx.post(t.router_url + "/v1/completions", json=body, timeout=120)


def _healthy_at_router(t, url: str) -> bool:
    pods = httpx.get(t.router_url + "/pods", timeout=10).json()
    return any(p["url"] == url and p["healthy"] for p in pods["pods"])


def test_a_killed_decode_worker_comes_back_and_nothing_fails_meanwhile(topo, reference):
    victim = next(w for w in topo.workers if w.name == "decode-0")
    assert victim.proc is not None
    old_pid = victim.proc.pid
    os.killpg(old_pid, signal.SIGKILL)  # the server and its engine, as the OOM killer would
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
    assert answered >= 2
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
