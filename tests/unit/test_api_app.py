"""The FastAPI app around a fake engine client: status codes, error schema, SSE framing, metrics.

No model and no engine process: a scripted client answers each request with
fixed tokens, so these run in milliseconds and pin the HTTP contract.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from kvmesh.engine.core.messages import EngineCoreOutput, EngineStats
from kvmesh.services.api import wire
from kvmesh.services.api.config import ServerConfig
from kvmesh.services.api.engine_client import EngineDeadError, EngineRejectedError, RequestStream
from kvmesh.services.api.metrics import ServerMetrics
from kvmesh.services.api.server import build_app

pytestmark = pytest.mark.unit

VOCAB = ["<eos>"] + [chr(ord("a") + i) for i in range(26)]


class FakeTokenizer:
    """One lowercase letter per token."""

    def __call__(self, text, add_special_tokens=True):
        return type("E", (), {"input_ids": [VOCAB.index(c) for c in text if c in VOCAB]})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == 0))

    def apply_chat_template(self, msgs, add_generation_prompt=True, tokenize=True, **kw):
        return self("".join(m["content"] for m in msgs)).input_ids + [1]

    def __len__(self):
        return len(VOCAB)


class FakeClient:
    """Replies to each request with tokens b, c, d, e (or the scripted failure)."""

    def __init__(self) -> None:
        self.ready = wire.Ready(1, "fake-model", 32, 16, 64, "both")
        self.dead_reason = None
        self.fail: Exception | None = None
        self.added, self.aborted, self.seq_aborts = [], [], []

    @property
    def healthy(self):
        return self.dead_reason is None

    stats = EngineStats()
    streams: dict = {}
    loras: frozenset[str] = frozenset()  # LoRA is off: only the base model's names are models

    async def reset_prefix_cache(self) -> bool:
        return True

    def add(self, req, stream=None):
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        stream = stream or RequestStream(req.request_id)
        self.added.append(req)
        if self.fail is not None:
            stream.queue.put_nowait(self.fail)
            return stream
        toks = [2, 3, 4, 5][: req.params.max_tokens]
        for i in range(req.params.n):
            for k, t in enumerate(toks):
                lp = [(-0.5, [(t, -0.5), (9, -1.5)])] if req.params.logprobs is not None else None
                done = k == len(toks) - 1
                stream.queue.put_nowait(
                    EngineCoreOutput(
                        req.request_id,
                        i,
                        [t],
                        lp,
                        "length" if done else None,
                        num_prompt_tokens=len(req.prompt_token_ids),
                        num_cached_tokens=16,
                    )
                )
        return stream

    def abort(self, ids):
        self.aborted += ids

    def abort_sequence(self, rid, index):
        self.seq_aborts.append((rid, index))

    def release(self, rid):
        pass


@pytest.fixture
def app_client():
    fake = FakeClient()
    metrics = ServerMetrics("fake")
    cfg = ServerConfig(served_model_names=("fake",), api_keys=("k",), max_body_bytes=2048)
    app = build_app(cfg, fake, FakeTokenizer(), metrics)
    with TestClient(app, headers={"Authorization": "Bearer k"}) as c:
        yield c, fake, metrics


def err(r, status, code=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == (code or status)
    return body["error"]


def test_completion_and_usage(app_client):
    c, fake, _ = app_client
    r = c.post(
        "/v1/completions",
        json={"prompt": "abc", "max_tokens": 4, "cache_salt": "t", "kv_transfer_params": {"do_remote_decode": True}},
    )
    body = r.json()
    assert body["choices"][0]["text"] == "bcde" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    assert fake.added[0].cache_salt == "t" and fake.added[0].kv_transfer_params == {"do_remote_decode": True}


def test_stop_string_aborts_sequence(app_client):
    c, fake, _ = app_client
    body = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "stop": "d"}).json()
    assert body["choices"][0]["text"] == "bc" and body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == "d"
    assert fake.seq_aborts == [(fake.added[0].request_id, 0)]


def test_stream_sse_framing_n2_and_usage(app_client):
    c, _, _ = app_client
    r = c.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "ab"}],
            "max_tokens": 4,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    lines = [ln for ln in r.text.split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    texts = {0: "", 1: ""}
    for ch in chunks:
        for choice in ch["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == {0: "bcde", 1: "bcde"}
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and chunks[-1]["choices"] == []


def test_logprob_formats(app_client):
    c, _, _ = app_client
    body = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "logprobs": 1}).json()
    lp = body["choices"][0]["logprobs"]
    assert lp == {
        "tokens": ["b", "c"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"b": -0.5}, {"c": -0.5}],
        "text_offset": [0, 1],
    }
    chat = c.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 2},
    ).json()
    entry = chat["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "b" and entry["bytes"] == [98]
    assert [t["token"] for t in entry["top_logprobs"]] == ["b", "i"]


def test_errors(app_client):
    c, fake, _ = app_client
    assert err(c.post("/v1/completions", json={"prompt": "a", "temperature": -1}), 400)["type"] == "BadRequestError"
    assert err(c.post("/v1/completions", json={"prompt": "a" * 40}), 400)["param"] == "prompt"  # > max_model_len 32
    assert err(c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 30}), 400)["param"] == "max_tokens"
    assert err(c.post("/v1/completions", json={"model": "nope", "prompt": "a"}), 404)["param"] == "model"
    err(c.post("/v1/completions", content=b"{", headers={"content-type": "application/json"}), 400)
    err(c.post("/v1/completions", json={"prompt": "a" * 5000}), 413)
    err(c.post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer x"}), 401, "invalid_api_key")
    assert (
        c.post(
            "/v1/completions",
            json={"prompt": "a", "presence_penalty": 1.0, "frequency_penalty": -0.5, "repetition_penalty": 1.2},
        ).status_code
        == 200
    )
    sent = fake.added[-1].params  # the penalties reach the engine as given
    assert (sent.presence_penalty, sent.frequency_penalty, sent.repetition_penalty) == (1.0, -0.5, 1.2)
    assert (
        err(c.post("/v1/completions", json={"prompt": "a", "presence_penalty": 2.5}), 400)["param"]
        == "presence_penalty"
    )
    assert (
        err(
            c.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}], "repetition_penalty": 0}
            ),
            400,
        )["param"]
        == "repetition_penalty"
    )
    assert c.post("/v1/completions", json={"prompt": "a", "logit_bias": {"5": -100, "7": 2}}).status_code == 200
    assert fake.added[-1].params.logit_bias == ((5, -100.0), (7, 2.0))
    for bias in ({"x": 1}, {"-1": 1}, {"100000": 1}, {"5": 101}, {"5": "high"}):
        assert err(c.post("/v1/completions", json={"prompt": "a", "logit_bias": bias}), 400)["param"] == "logit_bias", (
            bias
        )
    chat = {"messages": [{"role": "user", "content": "a"}]}
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert "image_url" in err(c.post("/v1/chat/completions", json=image), 400)["message"]
    assert c.post("/v1/chat/completions", json={**chat, "response_format": {"type": "text"}}).status_code == 200
    assert c.post("/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}}).status_code == 200
    assert fake.added[-1].params.structured.kind == "json_object"
    assert (
        err(c.post("/v1/chat/completions", json={**chat, "response_format": {"type": "yaml"}}), 400)["param"]
        == "response_format"
    )
    fake.fail = EngineRejectedError("queue_full", "waiting queue is full")
    r = c.post("/v1/completions", json={"prompt": "a"})
    assert err(r, 503) and r.headers["retry-after"] == "1"
    r = c.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert err(r, 503) and r.headers["retry-after"] == "1"  # streams too: status before headers are sent
    fake.fail = EngineRejectedError("invalid", "bad prompt")
    err(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]}), 400)
    fake.fail = None
    fake.dead_reason = "engine process exited with code -9"
    assert c.get("/health").status_code == 503
    err(c.post("/v1/completions", json={"prompt": "a"}), 503)


def test_health_and_metrics_open_without_key(app_client):
    c, _, metrics = app_client
    metrics.on_stats(
        EngineStats(
            num_running=3,
            kv_cache_usage=0.25,
            prefix_cache_queries=10,
            prefix_cache_hits=4,
            num_prompt_tokens_pending=700,
        )
    )
    assert c.get("/health", headers={"Authorization": ""}).status_code == 200
    text = c.get("/metrics", headers={"Authorization": ""}).text
    assert 'vllm:num_requests_running{model_name="fake"} 3.0' in text
    assert 'kvmesh:prompt_tokens_pending{model_name="fake"} 700.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="fake"} 4.0' in text
    err(c.get("/v1/models", headers={"Authorization": ""}), 401, "invalid_api_key")


def test_metrics_counters_advance_by_delta():
    m = ServerMetrics("m")
    m.on_stats(EngineStats(prefix_cache_queries=10, num_preemptions=1, num_steps=5, num_round_steps=0))
    m.on_stats(
        EngineStats(prefix_cache_queries=15, num_preemptions=1, num_steps=30, num_round_steps=24, num_chained_rounds=2)
    )
    text = m.render().decode()
    assert 'vllm:prefix_cache_queries_total{model_name="m"} 15.0' in text
    assert 'vllm:num_preemptions_total{model_name="m"} 1.0' in text
    # 30 steps, 24 of them in device rounds: 6 one-step
    assert 'kvmesh:engine_steps_total{model_name="m",path="round"} 24.0' in text
    assert 'kvmesh:engine_steps_total{model_name="m",path="one_step"} 6.0' in text
    assert 'kvmesh:engine_chained_rounds_total{model_name="m"} 2.0' in text
    m.observe_finished("length", 0.5)
    assert 'vllm:request_success_total{finished_reason="length",model_name="m"} 1.0' in m.render().decode()


def test_host_tier_metrics():
    m = ServerMetrics("m")
    text = m.render().decode()
    assert "kvmesh:kv_offload_blocks{" not in text  # no tier, no series
    m.on_stats(EngineStats(kv_offload_blocks={"GPU": 10, "CPU": 3}, kv_offload_stored=5, kv_offload_loaded=2))
    m.on_stats(
        EngineStats(
            kv_offload_blocks={"GPU": 9, "CPU": 4},
            kv_offload_stored=7,
            kv_offload_loaded=2,
            kv_offload_hit_tokens=32,
            kv_offload_evictions=1,
        )
    )
    text = m.render().decode()
    assert 'kvmesh:kv_offload_blocks{medium="CPU",model_name="m"} 4.0' in text
    assert 'kvmesh:kv_offload_blocks{medium="GPU",model_name="m"} 9.0' in text
    assert 'kvmesh:kv_offloads_total{model_name="m"} 7.0' in text
    assert 'kvmesh:kv_offload_loads_total{model_name="m"} 2.0' in text
    assert 'kvmesh:kv_offload_hit_tokens_total{model_name="m"} 32.0' in text
    assert 'kvmesh:kv_offload_evictions_total{model_name="m"} 1.0' in text


def test_admin_endpoints_take_the_admin_key_alone():
    """/drain and /reset_prefix_cache act on the whole pod: a client's key gets 403 (a fuzz holding one
    once drained a pod for good), the admin key works (and is accepted where a client key is); with no
    admin key configured they are refused to everyone; with no credential at all the server is open."""

    def serve(**kw) -> TestClient:
        cfg = ServerConfig(served_model_names=("fake",), **kw)
        return TestClient(build_app(cfg, FakeClient(), FakeTokenizer(), ServerMetrics("fake")))

    def auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    admin_routes = (("POST", "/drain"), ("GET", "/drain"), ("DELETE", "/drain"), ("POST", "/reset_prefix_cache"))
    with serve(api_keys=("k",), admin_key="adm") as c:
        for method, path in admin_routes:
            e = err(c.request(method, path, headers=auth("k")), 403)
            assert e["type"] == "PermissionDeniedError" and "admin key" in e["message"], e
            err(c.request(method, path), 401, "invalid_api_key")
            err(c.request(method, path, headers=auth("wrong")), 401, "invalid_api_key")
        assert c.post("/drain", headers=auth("adm")).json()["draining"] is True
        assert c.get("/health").status_code == 503
        assert c.get("/drain", headers=auth("adm")).json()["draining"] is True
        assert c.delete("/drain", headers=auth("adm")).json()["draining"] is False
        assert c.post("/reset_prefix_cache", headers=auth("adm")).json() == {"reset": True}
        assert c.get("/v1/models", headers=auth("adm")).status_code == 200
        assert c.get("/v1/models", headers=auth("k")).status_code == 200
    with serve(api_keys=("k",)) as c:  # keys but no admin key: nobody may drain
        for method, path in admin_routes:
            e = err(c.request(method, path, headers=auth("k")), 403)
            assert "no admin key is configured" in e["message"], e
    with serve(admin_key="adm") as c:  # an admin key alone: the client endpoints stay open
        assert c.get("/v1/models").status_code == 200
        err(c.post("/drain"), 401, "invalid_api_key")
        assert c.post("/drain", headers=auth("adm")).status_code == 200
    with serve() as c:  # nothing configured: open, as a local `kvmesh serve`
        assert c.post("/drain").json()["draining"] is True
        assert c.post("/reset_prefix_cache").status_code == 200


def test_models_and_cache_config_info_report_number_formats():
    """/v1/models entries carry the engine's quantization and KV cache dtype (extra fields, as vLLM's);
    /metrics has kvmesh:cache_config_info with them as labels."""

    def serve(ready):
        fake = FakeClient()
        fake.ready = ready
        metrics = ServerMetrics("fake")
        metrics.on_ready(ready)  # what the launcher does with the engine's Ready
        app = build_app(ServerConfig(served_model_names=("fake",), api_keys=("k",)), fake, FakeTokenizer(), metrics)
        with TestClient(app, headers={"Authorization": "Bearer k"}) as c:
            (entry,) = c.get("/v1/models").json()["data"]
            text = c.get("/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("kvmesh:cache_config_info{"))
        assert line.endswith(" 1.0")
        return entry, line

    entry, line = serve(wire.Ready(1, "fake-model", 32, 16, 128, "both", kv_cache_dtype="fp8", quantization="fp8"))
    assert (entry["quantization"], entry["kv_cache_dtype"]) == ("fp8", "fp8")
    for label in ('block_size="16"', 'num_gpu_blocks="128"', 'cache_dtype="fp8"', 'quantization="fp8"'):
        assert label in line, line
    entry, line = serve(wire.Ready(1, "fake-model", 32, 16, 64, "both"))  # an unquantized model, auto KV
    assert (entry["quantization"], entry["kv_cache_dtype"]) == (None, "auto")
    assert 'cache_dtype="auto"' in line and 'quantization="none"' in line


def test_tier_metrics_by_medium():
    """One series per tier the pod has (device, host, disk): hits, blocks in and out, LRU drops, bytes
    each way and load time, as counters of the engine's cumulative values."""
    m = ServerMetrics("m")
    assert "kvmesh:kv_tier_loads_total{" not in m.render().decode()  # no tier, no series
    tiers = dict(
        kv_tier_hit_tokens={"GPU": 64, "CPU": 16, "DISK": 32},
        kv_tier_stored={"CPU": 4, "DISK": 2},
        kv_tier_loaded={"CPU": 1, "DISK": 2},
        kv_tier_evictions={"CPU": 2, "DISK": 0},
        kv_tier_bytes={"CPU": {"in": 400, "out": 300}, "DISK": {"in": 200, "out": 200}},
        kv_tier_load_seconds={"CPU": 0.5, "DISK": 1.5},
    )
    m.on_stats(EngineStats(**tiers))
    tiers["kv_tier_loaded"] = {"CPU": 3, "DISK": 2}
    tiers["kv_tier_load_seconds"] = {"CPU": 0.75, "DISK": 1.5}
    m.on_stats(EngineStats(**tiers))
    text = m.render().decode()
    assert 'kvmesh:kv_tier_hit_tokens_total{medium="GPU",model_name="m"} 64.0' in text
    assert 'kvmesh:kv_tier_hit_tokens_total{medium="DISK",model_name="m"} 32.0' in text
    assert 'kvmesh:kv_tier_loads_total{medium="CPU",model_name="m"} 3.0' in text
    assert 'kvmesh:kv_tier_stored_total{medium="DISK",model_name="m"} 2.0' in text
    assert 'kvmesh:kv_tier_evictions_total{medium="DISK",model_name="m"} 0.0' in text
    assert 'kvmesh:kv_tier_bytes_total{direction="out",medium="DISK",model_name="m"} 200.0' in text
    assert 'kvmesh:kv_tier_load_seconds_total{medium="CPU",model_name="m"} 0.75' in text


def test_a_client_gone_mid_answer_is_noticed_while_tokens_keep_coming():
    """A non-streaming generation asks whether its client is still there by the clock, not only when
    no token came for a while: tokens every 20 ms (never a 0.5 s gap) still let it see the client
    leave, abort the request and count the abort, well before the 400 tokens are out."""
    import asyncio

    from kvmesh.engine.frontend.sampling_params import SamplingParams
    from kvmesh.services.api.serving import Generation, _Prompt

    fake, metrics = FakeClient(), ServerMetrics("fake")
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    gen = Generation(fake, metrics, FakeTokenizer(), "r1", [_Prompt("abc", [1, 2, 3])], params, None, None)
    gone: list[bool] = []

    async def is_disconnected() -> bool:
        return bool(gone)

    async def run() -> int:
        async def engine():  # one token every 20 ms, the client leaves after the 5th
            for k in range(400):
                gen.stream.queue.put_nowait(EngineCoreOutput("r1", 0, [2], None, "length" if k == 399 else None))
                if k == 5:
                    gone.append(True)
                await asyncio.sleep(0.02)

        feeder = asyncio.create_task(engine())
        n = 0
        async for _ in gen.events(is_disconnected):
            n += 1
        feeder.cancel()
        return n

    n = asyncio.run(run())
    assert (
        n < 200 and fake.aborted
    )  # ~30: the 5 before it left, then at most 0.5 s of tokens == ["r1"] and not gen.unfinished
    flat = {
        s.name + str(s.labels.get("finished_reason")): s.value for f in metrics.registry.collect() for s in f.samples
    }
    assert flat["vllm:request_success_total" + "abort"] == 1
