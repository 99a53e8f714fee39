"""Children bind what they own: `kvmesh serve --port 0 --ready-file` and `kvmesh up` without picked ports.

A port picked by a parent (bind 0, read, close) and passed down can be taken by another program before
the child binds it; a worker binds HTTP only once its model is loaded, so the window is seconds wide, and
one worker dying of it ended the whole topology. Workers now bind HTTP port 0 and report the port in a
ready file, KV events on loopback go over ipc sockets in the run's private directory, and the NIXL side
channel binds port 0 itself; only the router keeps the user's fixed port, and a taken one fails at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess

import httpx
import pytest

from kvmesh.common.python_child import kvmesh_command
from kvmesh.health import exited, wait_healthy, wait_until

pytestmark = pytest.mark.integration
BS = 16
SMALL = ("--device", "cpu", "--max-model-len", "512", "--num-kv-blocks", "64", "--block-size", str(BS))


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group (it and its engine), SIGKILL what is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def test_serve_port_0_reports_the_port_it_bound(tmp_path):
    """`kvmesh serve --port 0 --ready-file F`: F appears once the server listens, names a port that
    answers /health (and the log line names it too), and is gone once the server exited."""
    ready, log = tmp_path / "ready.json", tmp_path / "serve.log"
    env = {**os.environ, "KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "INFO"}
    argv = kvmesh_command("serve", "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready), *SMALL)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(ready.exists, 600, f"server (log: {log})", exited(proc))
        info = json.loads(ready.read_text())
        port = info["port"]
        assert port > 0 and info["url"] == f"http://127.0.0.1:{port}" and info["pid"] == proc.pid, info
        wait_healthy(info["url"], 60, proc)
        assert httpx.get(info["url"] + "/v1/models", timeout=30).status_code == 200
        assert re.search(rf"serving \S+ on http://127\.0\.0\.1:{port} \(role both\)", log.read_text()), log.read_text()
    finally:
        _stop(proc)
    assert proc.returncode == 0, log.read_text()
    assert not ready.exists() and not (tmp_path / "ready.json.tmp").exists()


def _metric(url: str, name: str, labels: dict[str, str]) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    families = text_string_to_metric_families(text)
    return sum(s.value for fam in families for s in fam.samples if s.name == name and s.labels == labels)


def test_topology_workers_bind_their_own_ports(tmp_path, monkeypatch):
    """`kvmesh up` passes no picked port to a worker (HTTP --port 0, ipc KV events, no side-channel port),
    learns the ports from the ready files, and the router reaches both workers: one chat completion
    goes prefill -> decode, the decode pod receiving the prompt's KV. Its run directory is gone after stop."""
    from kvmesh.topology import Topology, TopologyConfig, free_port

    connector = "nixl"
    try:
        import nixl  # noqa: F401
    except ImportError:
        connector = "redis"  # the HTTP and KV-event wiring is the same; only the side channel goes untested
    monkeypatch.setenv("KVMESH_CPU_THREADS", "1")
    cfg = TopologyConfig(
        port=free_port(),  # the router's: the user's fixed --port (the one port still picked)
        kv_connector=connector,
        engine_args=SMALL,
        router_args=("--pd-min-uncached", "0", "--block-size", str(BS)),
        log_dir=str(tmp_path / "logs"),
        startup_timeout_s=600,
    )
    topo = Topology(cfg)
    topo.start()
    procs = [p for _, p in topo.procs]
    run_dir = topo.run_dir
    try:
        assert run_dir is not None and os.stat(run_dir).st_mode & 0o077 == 0  # private to this user
        for w in topo.workers:
            argv = next(p.args for name, p in topo.procs if name == w.name)
            assert argv[argv.index("--port") + 1] == "0", argv
            assert not any("tcp://" in a for a in argv), argv
            assert "side_channel_port" not in json.loads(argv[argv.index("--kv-connector-config") + 1])
            assert w.events.startswith(f"ipc://{run_dir}/") and w.replay.startswith(f"ipc://{run_dir}/")
            port = int(w.url.rsplit(":", 1)[1])
            assert port > 0 and w.url == f"http://127.0.0.1:{port}"
        pd = ("kvmesh:router_pd_decisions_total", {"path": "prefill_decode"})
        before = _metric(topo.router_url, *pd)
        r = httpx.post(
            topo.router_url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 4, "temperature": 0},
            timeout=600,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        assert _metric(topo.router_url, *pd) == before + 1  # through the prefill worker, then the decode worker
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the decode pod got the KV
    finally:
        topo.stop()
    assert all(p.poll() is not None for p in procs), "kvmesh up left a process running"
    assert not os.path.exists(run_dir)


def test_topology_fails_at_once_when_the_router_port_is_taken():
    """The router's port is the user's: taken, `start` fails before any process starts, naming it."""
    from kvmesh.topology import Topology, TopologyConfig

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        topo = Topology(TopologyConfig(port=port, kv_connector="redis", redis_url="redis://127.0.0.1:1/0"))
        with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is already in use"):
            topo.start()
    assert topo.procs == [] and topo.workers == [] and topo.run_dir is None


def test_topology_refuses_router_port_0():
    """The router's port is the address the user is told: 0 (the kernel's pick) would be told to nobody."""
    from kvmesh.topology import TopologyConfig

    with pytest.raises(ValueError, match="fixed port"):
        TopologyConfig(port=0)
