"""kvmesh/common/tracing.py with the SDK's in-memory exporter (the collector-backed test is
tests/integration/test_tracing.py): off unless OTEL_* ask, a client's traceparent continued through
an app and passed on to pods, the engine's phases laid out from its timestamps, the CRD's
spec.tracing rendered as OTEL_* on every pod."""

from __future__ import annotations

import time

import pytest

from kvmesh.common import tracing

pytestmark = pytest.mark.unit

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture
def spans():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exp = InMemorySpanExporter()
    assert tracing.setup("kvmesh-test", exporter=exp)
    yield exp
    tracing.shutdown()


def test_configured_only_by_an_endpoint_and_not_disabled():
    assert not tracing.configured({})
    assert not tracing.configured({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert not tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})
    assert not tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"})


def test_off_costs_nothing(monkeypatch):
    for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    assert not tracing.setup("kvmesh-test") and not tracing.enabled()
    assert tracing.span("a") is tracing.span("b")  # one shared no-op
    with tracing.opened("c") as s:
        assert s is None
    h = {"Content-Type": "application/json"}
    assert tracing.inject(h) is h
    done = object()
    assert tracing.ending(None, done) is done  # type: ignore[arg-type]
    tracing.annotate(x=1)
    tracing.engine_spans(1.0, 2.0, 0.0, 3.0, 4.0, {})

    class App:
        def add_middleware(self, *a, **k):
            raise AssertionError("no middleware when off")

    tracing.instrument(App(), ["/v1/completions"], "router")


def test_client_traceparent_is_continued_and_passed_on(spans):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    seen = {}

    @app.post("/v1/completions")
    async def completions():
        with tracing.span("router.prefill", {"kvmesh.prompt_tokens": 3}):
            tracing.annotate(**{"kvmesh.pod": "http://p:8000", "kvmesh.none": None})
            seen["headers"] = tracing.inject({"Content-Type": "application/json"})
        return {"ok": True}

    @app.get("/health")
    async def health():
        return {}

    tracing.instrument(app, ["/v1/completions"], "router")
    c = TestClient(app)
    assert c.post("/v1/completions", headers={"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}).status_code == 200
    assert c.get("/health").status_code == 200  # not a traced path
    got = {s.name: s for s in spans.get_finished_spans()}
    assert set(got) == {"router /v1/completions", "router.prefill"}
    root, child = got["router /v1/completions"], got["router.prefill"]
    assert f"{root.context.trace_id:032x}" == TRACE_ID and f"{root.parent.span_id:016x}" == PARENT
    assert root.attributes["http.response.status_code"] == 200
    assert child.parent.span_id == root.context.span_id
    assert dict(child.attributes) == {"kvmesh.prompt_tokens": 3, "kvmesh.pod": "http://p:8000"}
    # the pod gets the prefill call's span as its parent, in the client's trace
    assert seen["headers"]["traceparent"] == f"00-{TRACE_ID}-{child.context.span_id:016x}-01"
    assert seen["headers"]["Content-Type"] == "application/json"


def test_opened_span_ends_when_the_answer_does(spans):
    ended = []
    with tracing.opened("router.decode") as s:
        pass
    assert spans.get_finished_spans() == ()
    tracing.ending(s, ended.append)(42)
    (d,) = spans.get_finished_spans()
    assert d.name == "router.decode" and d.attributes["kvmesh.total_tokens"] == 42 and ended == [42]
    with pytest.raises(RuntimeError), tracing.opened("router.decode"):
        raise RuntimeError("send failed")
    assert len(spans.get_finished_spans()) == 2  # a failed call's span ends at once


def test_engine_phases_from_monotonic_timestamps(spans):
    t = time.monotonic()
    with tracing.span("decode /v1/completions"):
        tracing.engine_spans(
            t - 1.0, t - 0.9, t - 0.5, t - 0.4, t, {"kvmesh.prompt_tokens": 80}, {"kvmesh.kv_bytes": 4096}
        )
    got = {s.name: s for s in spans.get_finished_spans()}
    assert set(got) == {
        "decode /v1/completions",
        "engine",
        "engine.queue",
        "kv.transfer",
        "engine.prefill",
        "engine.decode",
    }
    ms = {n: (s.end_time - s.start_time) / 1e6 for n, s in got.items()}
    assert ms["engine"] == pytest.approx(1000, abs=2) and ms["engine.queue"] == pytest.approx(100, abs=2)
    assert ms["kv.transfer"] == pytest.approx(400, abs=2) and ms["engine.prefill"] == pytest.approx(100, abs=2)
    assert ms["engine.decode"] == pytest.approx(400, abs=2)
    assert got["kv.transfer"].attributes["kvmesh.kv_bytes"] == 4096
    assert got["kv.transfer"].parent.span_id == got["engine"].context.span_id
    assert got["engine"].parent.span_id == got["decode /v1/completions"].context.span_id
    # no transfer (an aggregated pod, or a prompt computed locally): prefill starts at the first schedule
    spans.clear()
    with tracing.span("worker"):
        tracing.engine_spans(t - 1.0, t - 0.9, 0.0, t - 0.4, t, {}, None)
    got = {s.name: s for s in spans.get_finished_spans()}
    assert "kv.transfer" not in got
    assert (got["engine.prefill"].end_time - got["engine.prefill"].start_time) / 1e6 == pytest.approx(500, abs=2)


def test_crd_tracing_becomes_otel_env_on_every_pod():
    from kvmesh.operator.render import render

    spec = {"kvConnector": {"type": "nixl"}, "tracing": {"endpoint": "http://otel:4318", "samplingRatio": 0.25}}
    meta = {"name": "llm", "namespace": "ai", "uid": "u"}
    pods = [
        c
        for o in render(spec, meta)
        if o["kind"] in ("Deployment", "LeaderWorkerSet")
        for c in _containers(o)
        if c["name"] in ("router", "worker")
    ]
    assert {c["name"] for c in pods} == {"router", "worker"}
    for c in pods:
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel:4318"
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio" and env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
        assert env["OTEL_RESOURCE_ATTRIBUTES"] == "service.namespace=ai,kvmesh.inferenceservice=llm"
    untraced = [c for o in render({"kvConnector": {"type": "nixl"}}, meta) for c in _containers(o)]
    assert untraced and not any(e["name"].startswith("OTEL_") for c in untraced for e in c.get("env", ()))


def _containers(obj: dict) -> list[dict]:
    spec = obj.get("spec", {})
    tmpl = spec.get("template") or spec.get("leaderWorkerTemplate", {}).get("leaderTemplate") or {}
    return list(tmpl.get("spec", {}).get("containers", ()))
