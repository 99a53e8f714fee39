"""OpenTelemetry traces of one P/D request, as a real OpenTelemetry Collector received them.

The collector (tests/e2e/cluster/build.sh otelcol: core distribution, OTLP/HTTP receiver, debug
exporter printing every span) runs here; a router (in process) with a prefill pod and a decode pod
(`kvmesh serve`; NIXL, then the Redis connector with a real redis-server) export to it through the
standard ``OTEL_*`` variables. One streamed request with the client's own ``traceparent`` must come
back as one trace: the router's admission, routing, prefill and decode calls, each pod's server span,
and the decode pod's KV transfer (with bytes and connector) and engine phases, all under the client's
trace id.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import httpx
import pytest
from prom_bin import otelcol

pytestmark = pytest.mark.integration

BS = 16
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
ENV = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING", "KVMESH_KV_AUTH_KEY": "tracing-kv-auth-key"}

CONFIG = """
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{port}
exporters:
  debug:
    verbosity: detailed
service:
  telemetry:
    metrics:
      level: none
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [debug]
"""


def parse_spans(log: str) -> list[dict]:
    """The spans the debug exporter printed: name, trace id, parent id, id, service, attributes."""
    spans: list[dict] = []
    service, cur, in_resource = "", None, False
    for line in log.splitlines():
        s = line.strip()
        if s.startswith("Resource attributes:"):
            in_resource, cur = True, None
        elif s.startswith("ScopeSpans #"):
            in_resource = False
        elif s.startswith("Span #"):
            cur = {"service": service, "attributes": {}}
            spans.append(cur)
        elif s.startswith("->"):
            m = re.match(r"-> ([^:]+): \w+\((.*)\)$", s)
            if m is None:
                continue
            if in_resource and m.group(1) == "service.name":
                service = m.group(2)
            elif cur is not None:
                cur["attributes"][m.group(1)] = m.group(2)
        elif cur is not None and ":" in s:
            k, _, v = s.partition(":")
            k = k.strip()
            if k in ("Trace ID", "Parent ID", "ID", "Name", "Kind"):
                cur[k] = v.strip()
    return spans


@pytest.fixture(scope="module", params=["nixl", "redis"])
def traced(request, tmp_path_factory):
    connector = request.param
    if connector == "nixl":
        pytest.importorskip("nixl")
    pytest.importorskip("opentelemetry.sdk")
    from test_connectors_redis import RedisServer

    from kvmesh.common import tracing
    from kvmesh.services.router.config import PodSpec, RouterConfig
    from kvmesh.testing.pods import start_router
    from kvmesh.testing.servers import ServerProcess
    from kvmesh.topology import free_port

    d = tmp_path_factory.mktemp("tracing")
    port = free_port()
    (d / "otelcol.yaml").write_text(CONFIG.format(port=port))
    col_log = d / "otelcol.log"
    with open(col_log, "wb") as out:
        col = subprocess.Popen([str(otelcol()), "--config", str(d / "otelcol.yaml")], stdout=out, stderr=out)
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within a tenth of a second (default: 5 s)
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
    }
    saved = {k: os.environ.get(k) for k in otel}
    pre = dec = srv = redis = None
    try:
        conn = ["--kv-connector", connector]
        if connector == "redis":
            redis = RedisServer()
            conn += ["--kv-connector-config", f'{{"url": "{redis.url}"}}']
        deadline = time.monotonic() + 30
        while b"Everything is ready" not in col_log.read_bytes():
            assert col.poll() is None and time.monotonic() < deadline, col_log.read_text()
            time.sleep(0.1)
        common = ["--max-model-len", "512", "--num-kv-blocks", "128", "--block-size", str(BS), *conn]
        env = {**ENV, **otel}
        pre = ServerProcess([*common, "--role", "prefill", "--engine-id", "pre0"], env=env, log_path=str(d / "p.log"))
        dec = ServerProcess([*common, "--role", "decode", "--engine-id", "dec0"], env=env, log_path=str(d / "d.log"))
        pre.start()
        dec.start()
        os.environ.update(otel)  # the in-process router reads them when its app is built
        cfg = RouterConfig(
            port=free_port(),
            block_size=BS,
            pd_min_uncached=16,
            health_interval=1.0,
            pods=(PodSpec(pre.base_url, "prefill"), PodSpec(dec.base_url, "decode")),
        )
        srv, _ = start_router(cfg)
        assert tracing.enabled()
        yield srv, col_log, connector
    finally:
        if srv is not None:
            srv.stop()
        tracing.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p in (pre, dec):
            if p is not None:
                p.stop()
        col.terminate()
        col.wait(10)
        if redis is not None:
            redis.stop()


def wait_for_trace(col_log, trace_id: str, names: set[str], timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in parse_spans(col_log.read_text()) if s.get("Trace ID") == trace_id]
        if names <= {s["Name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def test_pd_request_is_one_trace_in_the_collector(traced):
    srv, col_log, connector = traced
    prompt = "Once upon a time, " + " ".join(f"word{j}" for j in range(70))
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200
        assert any(line.startswith("data: [DONE]") for line in r.iter_lines())
    want = {
        "router /v1/completions",
        "router.admission",
        "router.route",
        "router.prefill",
        "router.decode",
        "prefill /v1/completions",
        "decode /v1/completions",
        "kv.transfer",
        "engine.queue",
        "engine.prefill",
        "engine.decode",
    }
    spans = wait_for_trace(col_log, TRACE_ID, want)
    by = {s["Name"]: s for s in spans}
    assert want <= set(by), (sorted(by), col_log.read_text()[-4000:])
    # the client's span is the root's parent; each hop hangs off the router's call to it
    assert by["router /v1/completions"]["Parent ID"] == CLIENT_SPAN
    assert by["router /v1/completions"]["service"] == "kvmesh-router"
    assert by["prefill /v1/completions"]["Parent ID"] == by["router.prefill"]["ID"]
    assert by["prefill /v1/completions"]["service"] == "kvmesh-prefill"
    assert by["decode /v1/completions"]["Parent ID"] == by["router.decode"]["ID"]
    assert by["decode /v1/completions"]["service"] == "kvmesh-decode"
    route = by["router.route"]["attributes"]
    assert route["kvmesh.role"] == "decode" and route["kvmesh.pod"] and "kvmesh.predicted_hit_blocks" in route
    # the KV transfer is the decode pod's (its engine pulled the prefill pod's blocks)
    decode_spans = {s["ID"] for s in spans if s["service"] == "kvmesh-decode"}
    xfer = by["kv.transfer"]
    assert xfer["service"] == "kvmesh-decode" and xfer["Parent ID"] in decode_spans
    assert xfer["attributes"]["kvmesh.kv_connector"] == connector
    assert int(xfer["attributes"]["kvmesh.kv_blocks"]) >= 4 and int(xfer["attributes"]["kvmesh.kv_bytes"]) > 0


def test_a_request_without_traceparent_gets_its_own_trace(traced):
    srv, col_log, _ = traced
    before = {s.get("Trace ID") for s in parse_spans(col_log.read_text())}
    prompt = "A different story begins: " + " ".join(f"item{j}" for j in range(60))
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=300)
    assert r.status_code == 200
    deadline = time.monotonic() + 60
    while True:
        new = [s for s in parse_spans(col_log.read_text()) if s.get("Trace ID") not in before]
        roots = [s for s in new if s["Name"] == "router /v1/completions"]
        names = {s["Name"] for s in new if roots and s["Trace ID"] == roots[0]["Trace ID"]}
        if {"router.prefill", "decode /v1/completions", "kv.transfer"} <= names or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(roots) == 1 and roots[0]["Parent ID"] == ""
    assert {"router.prefill", "prefill /v1/completions", "decode /v1/completions", "kv.transfer"} <= names, names
