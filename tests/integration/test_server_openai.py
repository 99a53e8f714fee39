"""`kvmesh serve` against the official `openai` client: one live server for the whole module.

The server runs the embedded SmolLM2 on the CPU with an API key, a 512-token
context and a 64 KiB body limit, so every error path is reachable with small
requests. Outputs are compared to the offline `LLM` on the same weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from kvmesh.common.prometheus import flat_metrics

pytestmark = pytest.mark.integration

API_KEY = "test-key"
MAX_MODEL_LEN = 512
ENV = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(serve_log):
    from kvmesh.testing.servers import ServerProcess

    with ServerProcess(
        [
            "--api-key",
            API_KEY,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--num-kv-blocks",
            "256",
            "--max-body-bytes",
            "65536",
            "--served-model-name",
            "smol",
            "--stats-interval",
            "0.1",
        ],
        env=ENV,
        log_path=serve_log,
    ) as srv:
        yield srv
    assert srv.proc.poll() is not None


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    """The offline engine on the same model: the reference for greedy outputs."""
    os.environ.setdefault("KVMESH_CPU_THREADS", "1")
    from kvmesh import LLM

    return LLM(num_kv_blocks=256, max_model_len=MAX_MODEL_LEN)


def metrics(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    return flat_metrics(r.text)


def wait_idle(http, idle_usage: float, timeout: float = 60) -> dict[str, float]:
    """Poll /metrics until nothing runs and KV usage is back at its idle value (stats arrive asynchronously)."""
    deadline = time.monotonic() + timeout
    m = metrics(http)
    while time.monotonic() < deadline:
        m = metrics(http)
        if (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == idle_usage
        ):
            return m
        time.sleep(0.2)
    return m


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == (code or status) and body["error"]["message"]
    return body["error"]


# ---- plain endpoints -------------------------------------------------------
def test_models_version_health(client, http, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["smol"]
    entry = models.data[0].to_dict()  # extra fields: the number formats the engine runs
    assert entry["kv_cache_dtype"] == "auto" and entry["quantization"] is None
    assert http.get("/version").json()["version"]
    assert httpx.get(server.base_url + "/health").status_code == 200  # no key needed


def test_tokenize_detokenize(http, offline):
    r = http.post("/tokenize", json={"prompt": PROMPT})
    ids = r.json()["tokens"]
    assert ids == offline.encode(PROMPT)[1] and r.json()["count"] == len(ids)
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith(PROMPT)
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert chat == offline.apply_chat_template([{"role": "user", "content": "hi"}])
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400)


# ---- generation ------------------------------------------------------------
def test_completion_greedy_matches_offline(client, offline):
    from kvmesh import SamplingParams

    ref = offline.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(offline.encode(PROMPT)[1])
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens_details.cached_tokens is not None

    chunks = list(
        client.completions.create(
            model="smol",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_penalties_reach_the_engine(client, offline):
    """presence / frequency / repetition penalties through the official client and the API and
    engine processes: the same greedy text as the offline engine given the same parameters, and
    not the unpenalized text (the penalties did something)."""
    from kvmesh import SamplingParams

    kw = dict(presence_penalty=0.5, frequency_penalty=1.0)
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.2, **kw))[
        0
    ].outputs[0]
    plain = offline.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert ref.token_ids != plain.token_ids
    r = client.completions.create(
        model="smol", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"repetition_penalty": 1.2}, **kw
    )
    assert r.choices[0].text == ref.text


def test_logit_bias_reaches_the_engine(client, offline):
    """OpenAI's ``logit_bias`` through the official client: -100 on the greedy first token bans
    it (the same text as the offline engine with the same bias, not the plain text), +100 on a
    token makes it every greedy pick; an id outside the vocabulary is a 400 naming the field."""
    import openai

    from kvmesh import SamplingParams

    plain = offline.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0]
    ban = {plain.token_ids[0]: -100}
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, logit_bias=ban))[0].outputs[0]
    assert ref.token_ids[0] != plain.token_ids[0]
    r = client.completions.create(
        model="smol", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(k): v for k, v in ban.items()}
    )
    assert r.choices[0].text == ref.text != plain.text
    forced = offline.encode(" yes")[1][-1]
    r = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logit_bias={str(forced): 100},
    )
    assert r.choices[0].message.content == offline.tokenizer.decode([forced] * 4)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt=PROMPT, max_tokens=2, logit_bias={"99999999": 1})
    assert e.value.body["param"] == "logit_bias"


def test_chat_greedy_matches_offline(client, offline):
    from kvmesh import SamplingParams

    msgs = [{"role": "user", "content": "What is 2+2?"}]
    ref = offline.chat(msgs, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    r = client.chat.completions.create(model="smol", messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids)

    stream = client.chat.completions.create(
        model="smol",
        messages=msgs,
        max_completion_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + len(ref.token_ids)


def test_n2_and_seed(client):
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=1.0, n=2, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == sum(6 for _ in r.choices)
    again = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=1.0, n=2, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible

    chunks = list(
        client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            n=2,
            stream=True,
            temperature=0.8,
            seed=1,
        )
    )
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert all(texts.values())


def test_stop_strings(client):
    full = client.completions.create(model="smol", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]  # a string in the middle of the greedy output
    cut = full[: full.index(stop)]
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(model="smol", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for val, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and len(top) >= 3
        assert max(top.values()) == pytest.approx(val, abs=1e-4)  # greedy: the sampled token is the best
    assert lp.text_offset[0] == 0

    c = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    assert "".join(e.token for e in content) == c.choices[0].message.content or c.choices[0].finish_reason == "stop"


def test_prefix_cache_and_salt(client):
    prompt = "Once upon a time, in a land far away, " * 8  # > 4 blocks
    first = client.completions.create(model="smol", prompt=prompt, max_tokens=1, temperature=0)
    second = client.completions.create(model="smol", prompt=prompt, max_tokens=1, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    # cache_salt travels to the engine: another tenant's salt shares nothing
    salted = client.completions.create(
        model="smol",
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        extra_body={"cache_salt": "tenant-b", "kv_transfer_params": {"x": 1}},
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


# ---- errors ----------------------------------------------------------------
def test_errors(http, server):
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    e = assert_error(http.post(chat, json={"messages": msgs, "temperature": -1}), 400)
    assert "temperature" in e["message"]
    assert_error(http.post(chat, json={"messages": msgs, "n": 0}), 400)
    assert_error(http.post(chat, json={"messages": msgs, "top_p": 2}), 400)
    assert_error(http.post(chat, json={"messages": []}), 400)
    assert_error(http.post(chat, json={"messages": "nope"}), 400)
    assert_error(http.post(chat, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(http.post("/v1/completions", json={"prompt": [10**9]}), 400)
    assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": -3}), 400)
    # prompt longer than max_model_len
    e = assert_error(http.post("/v1/completions", json={"prompt": list(range(1, MAX_MODEL_LEN + 10))}), 400)
    assert "maximum context length" in e["message"]
    # max_tokens beyond the remaining context: rejected, as vLLM does
    e = assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": MAX_MODEL_LEN}), 400)
    assert "max_tokens" in e["message"] and e["param"] == "max_tokens"
    # unknown model
    e = assert_error(http.post(chat, json={"model": "gpt-9", "messages": msgs}), 404)
    assert e["type"] == "NotFoundError"
    # oversized body
    assert_error(http.post("/v1/completions", json={"prompt": "x" * 100_000}), 413)
    # auth: everything but /health and /metrics
    assert_error(httpx.get(server.base_url + "/v1/models"), 401, "invalid_api_key")
    assert_error(
        httpx.post(
            server.base_url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"}
        ),
        401,
        "invalid_api_key",
    )
    assert httpx.get(server.base_url + "/metrics").status_code == 200
    # the server still serves after all that
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_chat_default_max_tokens_is_rest_of_context(http):
    """Without max_tokens a chat request may run to max_model_len (vLLM's default); we only check acceptance."""
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0,
            "stop": ["."],
            "max_tokens": None,
            "stream": False,
            "min_p": 0.1,
            "top_k": 5,
        },
    )
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"] <= MAX_MODEL_LEN


# ---- disconnects, concurrency, metrics -------------------------------------
def test_disconnect_mid_stream_aborts(http, server):
    idle = wait_idle(http, 0.0)
    assert idle["vllm:kv_cache_usage_perc"] == 0.0
    aborted_before = idle.get("vllm:request_success_total{finished_reason=abort}", 0)
    body = {
        "prompt": "Write a very long story about dragons.",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(g.startswith("data: ") for g in got)
            busy = metrics(http)
    assert busy["vllm:kv_cache_usage_perc"] > 0.0 or busy["vllm:num_requests_running"] > 0
    after = wait_idle(http, 0.0)
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:request_success_total{finished_reason=abort}"] == aborted_before + 1
    # it was aborted, not run to the end: far fewer than 400 tokens were generated
    assert after["vllm:generation_tokens_total"] - idle["vllm:generation_tokens_total"] < 400


def test_64_concurrent_streams(server, client):
    from openai import AsyncOpenAI

    prompts = [f"Repeat the number {i} five times:" for i in range(64)]
    refs = {}
    for p in prompts[:4]:  # references for a sample, computed alone
        refs[p] = client.completions.create(model="smol", prompt=p, max_tokens=6, temperature=0).choices[0].text

    async def one(ac, p):
        text, ids = "", set()
        stream = await ac.completions.create(model="smol", prompt=p, max_tokens=6, temperature=0, stream=True)
        async for chunk in stream:
            ids.add(chunk.id)
            text += chunk.choices[0].text
        return p, text, ids

    async def run_all():
        ac = AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300, http_client=None
        )
        try:
            return await asyncio.gather(*(one(ac, p) for p in prompts))
        finally:
            await ac.close()

    results = asyncio.run(run_all())
    assert len(results) == 64
    all_ids = set()
    for p, text, ids in results:
        assert len(ids) == 1  # every chunk of a stream belongs to that stream's request
        all_ids |= ids
        assert text  # everyone got output
        if p in refs:
            assert text == refs[p]  # same as the prompt run alone: no tokens from other streams mixed in
    assert len(all_ids) == 64


def test_metrics_parse_and_move(http):
    from prometheus_client.parser import text_string_to_metric_families

    text = http.get("/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "kvmesh:engine_steps",
        "kvmesh:engine_chained_rounds",
        "kvmesh:cache_config_info",
    ):
        assert name in names, name
    assert 'model_name="smol"' in text
    before = wait_idle(http, 0.0)
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    after = wait_idle(http, 0.0)
    key = "vllm:request_success_total{finished_reason=length}"
    assert after[key] == before.get(key, 0) + 1
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 3
    assert after["vllm:prompt_tokens_total"] == before["vllm:prompt_tokens_total"] + r.json()["usage"]["prompt_tokens"]
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 1
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 1
    assert after["vllm:inter_token_latency_seconds_count"] == before["vllm:inter_token_latency_seconds_count"] + 2
    # queue time is reported by the engine once per request; it arrives with the outputs
    assert after["vllm:request_queue_time_seconds_count"] >= before["vllm:request_queue_time_seconds_count"] + 1
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    # a CPU engine runs one step at a time: prefill + 2 decode steps, no rounds
    one, rnd = "kvmesh:engine_steps_total{path=one_step}", "kvmesh:engine_steps_total{path=round}"
    assert after[one] >= before[one] + 3 and after[rnd] == before[rnd] == 0
    json.dumps(after)  # plain numbers
