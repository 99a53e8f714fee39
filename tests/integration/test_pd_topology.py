"""The local disaggregated topology (`kvmesh up`): router -> prefill -> decode, both connectors.

Every process is real (redis-server, two engine servers with their engine
processes, the router) on loopback. Greedy outputs must equal the offline
engine's; the decode pod must report the transferred tokens as not computed by
it; the prefill pod must end with every block free.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from kvmesh import SamplingParams

pytestmark = pytest.mark.integration
BS = 16
WORKER_ARGS = ("--max-model-len", "1024", "--num-kv-blocks", "256", "--block-size", str(BS))


@pytest.fixture(scope="module", params=["nixl", "redis"])
def topo(request, tmp_path_factory, monkeypatch_module):
    if request.param == "nixl":
        pytest.importorskip("nixl")
    from kvmesh.topology import Topology, TopologyConfig, free_port

    monkeypatch_module.setenv("KVMESH_CPU_THREADS", "1")
    cfg = TopologyConfig(
        port=free_port(),
        kv_connector=request.param,
        engine_args=WORKER_ARGS,
        router_args=("--pd-min-uncached", "0", "--block-size", str(BS)),
        log_dir=str(tmp_path_factory.mktemp(f"up-{request.param}")),
        startup_timeout_s=600,
    )
    t = Topology(cfg)
    t.start()
    yield t
    procs = [p for _, p in t.procs]
    assert len(procs) >= 3  # router, prefill, decode (+ redis-server)
    t.stop()
    assert all(p.poll() is not None for p in procs), "kvmesh up left a process running"


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def prompts(smol):
    text = (
        "The history of computing spans centuries, from mechanical calculators and punched cards to "
        "vacuum tubes, transistors and integrated circuits. "
    ) * 12
    ids = smol.tokenizer(text).input_ids
    # shorter than a block, an exact multiple of the block size, and several blocks plus a remainder
    return {"short": ids[:5], "exact": ids[: 4 * BS], "long": ids[:150]}


@pytest.fixture(scope="module")
def reference(make_llm, prompts):
    llm = make_llm()
    params = SamplingParams(temperature=0.0, max_tokens=8)
    return {k: llm.generate([v], params)[0].outputs[0].text for k, v in prompts.items()}


def _metric(url: str, name: str) -> float:
    """A sample summed over its label sets; ``name{k="v",...}``: the one series with exactly those labels."""
    from prometheus_client.parser import text_string_to_metric_families

    base, _, rest = name.partition("{")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', rest)) if rest else None
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == base and (labels is None or s.labels == labels)
    )


def test_pd_greedy_equals_single_engine_and_decode_skips_received_tokens(topo, prompts, reference):
    prefill = next(w for w in topo.workers if w.role == "prefill")
    decode = next(w for w in topo.workers if w.role == "decode")
    pd = 'kvmesh:router_pd_decisions_total{path="prefill_decode"}'
    before = _metric(topo.router_url, pd)
    for name, ids in prompts.items():
        r = httpx.post(
            topo.router_url + "/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0}, timeout=600
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == reference[name], name
        # Everything but the block holding the last prompt token came from the prefill pod.
        received = ((len(ids) - 1) // BS) * BS
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == received, name
    # Both connectors report their P/D path as such (Redis too: its params say what decode can load).
    assert _metric(topo.router_url, pd) == before + 3
    assert _metric(topo.router_url, 'kvmesh:router_pd_decisions_total{path="fallback_no_params"}') == 0
    # The prefill pod's blocks held for the reader return to its pool.
    deadline = time.monotonic() + 120
    while _metric(prefill.url, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _metric(prefill.url, "vllm:kv_cache_usage_perc") == 0
    deadline = time.monotonic() + 60
    while _metric(decode.url, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _metric(decode.url, "vllm:kv_cache_usage_perc") == 0


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
        ({"do_remote_prefill": True, "remote_block_ids": [1, "x"]}, "remote_block_ids"),
        ({"do_remote_prefill": True, "remote_block_ids": [-4]}, "remote_block_ids"),
        ({"do_remote_prefill": True, "do_remote_decode": True}, "both"),
        ("not-an-object", "kv_transfer_params"),
    ],
)
def test_malformed_kv_transfer_params_get_400(topo, params, fragment):
    decode = next(w for w in topo.workers if w.role == "decode")
    r = httpx.post(
        decode.url + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 2, "kv_transfer_params": params},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["param"] == "kv_transfer_params"


def _wait_metric_zero(url: str, name: str, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while (v := _metric(url, name)) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    return v


def test_bad_remote_params_get_400_and_leave_nothing(topo, prompts, reference):
    """NIXL: params naming a side channel that does not answer, another engine, or block ids beyond the
    prefill's pool are rejected with 400 before admission (both endpoints, streaming too); no block stays
    in use on either side. Redis ignores the NIXL-only fields: such a request is simply computed."""
    prefill = next(w for w in topo.workers if w.role == "prefill")
    decode = next(w for w in topo.workers if w.role == "decode")
    ids = prompts["long"]
    bogus = {
        "do_remote_prefill": True,
        "remote_block_ids": list(range(8)),
        "remote_engine_id": "nobody",
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "remote_request_id": "r-none",
        "remote_transfer_id": "t-none",
    }
    if topo.config.kv_connector != "nixl":
        r = httpx.post(
            decode.url + "/v1/completions",
            json={
                "prompt": ids,
                "max_tokens": 8,
                "temperature": 0,
                "kv_transfer_params": bogus,
                "cache_salt": "isolated",
            },
            timeout=600,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference["long"]
        return
    first = httpx.post(
        prefill.url + "/v1/completions",
        json={"prompt": ids, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=600,
    )
    assert first.status_code == 200, first.text
    good = first.json()["kv_transfer_params"]
    assert good["remote_block_ids"], good
    pool = 256  # WORKER_ARGS --num-kv-blocks
    cases = [
        (bogus, "did not answer the side-channel handshake", False),
        (dict(good, remote_engine_id="nobody"), "belongs to engine", False),
        (dict(good, remote_block_ids=[0, pool + 3]), "remote_block_ids out of range", False),
        (dict(good, remote_block_ids=[pool]), "remote_block_ids out of range", True),  # streaming
    ]
    for params, fragment, stream in cases:
        for path, body in (
            ("/v1/completions", {"prompt": ids}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            r = httpx.post(
                decode.url + path,
                json={**body, "max_tokens": 4, "temperature": 0, "stream": stream, "kv_transfer_params": params},
                timeout=120,
            )
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert fragment in err["message"], (path, err)
            assert err["type"] == "BadRequestError" and err["code"] == 400
            assert err["param"] == "kv_transfer_params", err
    assert _metric(decode.url, "vllm:kv_cache_usage_perc") == 0
    # The genuine params still pull and answer exactly; afterwards both pools are empty again.
    r = httpx.post(
        decode.url + "/v1/completions",
        json={"prompt": ids, "max_tokens": 8, "temperature": 0, "kv_transfer_params": good},
        timeout=600,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference["long"]
    assert _wait_metric_zero(prefill.url, "vllm:kv_cache_usage_perc", 120) == 0
    assert _wait_metric_zero(decode.url, "vllm:kv_cache_usage_perc", 60) == 0


def test_structured_outputs_and_tools_through_pd(topo):
    """`parse()` through the router's P/D path (the prefill pod's token obeys the grammar, the decode
    pod's grammar starts from the prompt) returns what the decode pod answers alone, greedy, streamed
    and not; a required tool call too. The router passes response_format, tools and tool_choice on."""
    from openai import OpenAI
    from structured_schemas import MAX_TOKENS, SCHEMAS

    decode = next(w for w in topo.workers if w.role == "decode")
    via_pd = OpenAI(base_url=topo.router_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    alone = OpenAI(base_url=decode.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = alone.models.list().data[0].id
    pd = 'kvmesh:router_pd_decisions_total{path="prefill_decode"}'
    before = _metric(topo.router_url, pd)
    for i, (cls, prompt) in enumerate(SCHEMAS[:4]):
        kw = dict(
            model=model,
            messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
            response_format=cls,
            temperature=0.0,
            max_tokens=MAX_TOKENS,
        )
        want = alone.chat.completions.parse(**kw).choices[0].message
        if i % 2:
            with via_pd.chat.completions.stream(**kw) as s:
                for _ in s:
                    pass
                got = s.get_final_completion().choices[0].message
        else:
            got = via_pd.chat.completions.parse(**kw).choices[0].message
        assert isinstance(got.parsed, cls) and got.content == want.content, (cls.__name__, got.content, want.content)
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    }
    r = via_pd.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Add 2 and 3."}],
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add" and 0 <= json.loads(call.function.arguments)["a"] <= 99
    assert _metric(topo.router_url, pd) == before + 5
