"""LoRA adapters served: through `kvmesh up` (router -> prefill -> decode, both connectors) an adapter's
requests go P/D and answer what the offline engine answers under that adapter; the router loads an
adapter no pod has (``--lora-modules`` on the router) and sends an adapter's requests only to pods that
hold it; the pods' adapter endpoints (vLLM's), ``/v1/models`` and ``vllm:lora_requests_info``.

Every process is real (redis-server, engine servers with their engine processes, the router) on
loopback; the adapters are made with ``peft`` on the embedded model's HF twin.
"""

from __future__ import annotations

import functools
import re

import httpx
import pytest
from lora_checks import make_adapter

from kvmesh import SamplingParams
from kvmesh.testing.pods import wait_for as _wait_for

pytestmark = pytest.mark.integration
BS = 16
MAX_NEW = 8
ADMIN_KEY = "admin-key-of-the-run"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
WORKER_ARGS = ("--max-model-len", "1024", "--num-kv-blocks", "256", "--block-size", str(BS), "--max-loras", "2")
# name -> (rank, alpha, target modules, rsLoRA, scale of the random B)
ADAPTERS = {
    "qv8": (8, 16, ["q_proj", "v_proj"], False, 1.0),
    "all16": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False, 0.4),
}
wait_for = functools.partial(_wait_for, timeout=30.0, poll=0.1)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_model) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    out = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        out[name] = str(root / name)
        make_adapter(hf_model, out[name], *spec, seed)
    return out


@pytest.fixture(scope="module")
def prompts(smol) -> dict[str, list[int]]:
    text = (
        "The history of computing spans centuries, from mechanical calculators and punched cards to "
        "vacuum tubes, transistors and integrated circuits. "
    ) * 5
    # several blocks of context and an open question at the end, where an adapter changes the answer
    long = smol.tokenizer(text + "Now a different topic. My favourite animal is the").input_ids
    return {"short": smol.tokenizer("Once upon a time").input_ids, "long": long}


@pytest.fixture(scope="module")
def reference(make_llm, adapters, prompts) -> dict[tuple[str | None, str], str]:
    """(adapter or None, prompt) -> the offline engine's greedy text; each adapter changes the answer."""
    llm = make_llm(lora_modules=tuple(f"{n}={p}" for n, p in adapters.items()), num_kv_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    out = {}
    for adapter in (None, *adapters):
        for k, ids in prompts.items():
            out[(adapter, k)] = llm.generate([ids], params, lora_name=adapter)[0].outputs[0].text
    for adapter in adapters:
        assert out[(adapter, "long")] != out[(None, "long")], adapter  # so the checks below could fail
    return out


def _metric(url: str, name: str) -> float:
    """A sample summed over its label sets; ``name{k="v",...}``: only the series with those labels."""
    from prometheus_client.parser import text_string_to_metric_families

    base, _, rest = name.partition("{")
    want = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == base and all(s.labels.get(k) == v for k, v in want.items())
    )


def _pods(topo) -> list[dict]:
    return httpx.get(topo.router_url + "/pods", headers=ADMIN, timeout=30).json()["pods"]


def _complete(url: str, ids: list[int], model: str | None, headers=None) -> httpx.Response:
    body: dict = {"prompt": ids, "max_tokens": MAX_NEW, "temperature": 0}
    if model is not None:
        body["model"] = model
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=600)


# ---- kvmesh up: P/D with adapters ------------------------------------------------------------------
@pytest.fixture(scope="module", params=["nixl", "redis"])
def topo(request, tmp_path_factory, adapters, monkeypatch_module):
    if request.param == "nixl":
        pytest.importorskip("nixl")
    from kvmesh.topology import Topology, TopologyConfig, free_port

    monkeypatch_module.setenv("KVMESH_CPU_THREADS", "1")
    cfg = TopologyConfig(
        port=free_port(),
        kv_connector=request.param,
        # every worker serves qv8 from the start; all16 only the router knows of
        engine_args=(*WORKER_ARGS, "--lora-modules", f"qv8={adapters['qv8']}"),
        router_args=(
            *("--pd-min-uncached", "0", "--block-size", str(BS), "--health-interval", "0.5"),
            *("--lora-modules", f"all16={adapters['all16']}"),
        ),
        log_dir=str(tmp_path_factory.mktemp(f"up-lora-{request.param}")),
        startup_timeout_s=600,
        admin_key=ADMIN_KEY,
    )
    t = Topology(cfg)
    t.start()
    yield t
    t.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_adapter_requests_go_prefill_then_decode_with_the_offline_tokens(topo, prompts, reference):
    pd = 'kvmesh:router_pd_decisions_total{path="prefill_decode"}'
    assert wait_for(lambda: all("qv8" in p["lora"]["registered"] for p in _pods(topo)))  # scraped
    before = _metric(topo.router_url, pd)
    for model in (None, "qv8"):
        for k, ids in prompts.items():
            r = _complete(topo.router_url, ids, model)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["text"] == reference[(model, k)], (model, k)
            if model is not None:
                assert body["model"] == model
            # the blocks before the last prompt token came from the prefill pod, computed under the adapter
            received = ((len(ids) - 1) // BS) * BS
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == received, (model, k)
    assert _metric(topo.router_url, pd) == before + 4
    decode = next(w for w in topo.workers if w.role == "decode")
    # the pod tells vLLM-aware routers what it holds
    assert _metric(decode.url, 'vllm:lora_requests_info{max_lora="2"}') > 0
    assert _metric(decode.url, 'kvmesh:lora_adapter_info{lora_name="qv8"}') == 1


def test_the_router_loads_an_adapter_no_pod_has_and_lists_every_model(topo, prompts, reference):
    loads = "kvmesh:router_lora_loads_total"
    before = _metric(topo.router_url, loads)
    for k, ids in prompts.items():
        r = _complete(topo.router_url, ids, "all16")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference[("all16", k)], k
    assert _metric(topo.router_url, loads) == before + 2  # once onto the decode pod, once onto the prefill pod
    models = {m["id"]: m for m in httpx.get(topo.router_url + "/v1/models", timeout=30).json()["data"]}
    base = next(m for m in models.values() if m.get("parent") is None)["id"]
    assert models["qv8"]["parent"] == base and models["all16"]["parent"] == base
    unknown = _complete(topo.router_url, prompts["short"], "no-such-adapter")
    assert unknown.status_code == 404, unknown.text


# ---- two aggregated pods behind the router: adapter affinity, the pods' endpoints --------------------
@pytest.fixture(scope="module")
def pods(tmp_path_factory, adapters):
    """Two `kvmesh serve` pods, LoRA on in both, qv8 only on the first, behind an in-process router."""
    from kvmesh.testing.pods import serve_pods_behind_router

    d = tmp_path_factory.mktemp("lora-pods")
    env = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING", "KVMESH_ADMIN_KEY": ADMIN_KEY}
    args = [
        [*WORKER_ARGS, *extra, "--stats-interval", "0.1"]
        for extra in (("--lora-modules", f"qv8={adapters['qv8']}"), ("--enable-lora",))
    ]
    with serve_pods_behind_router(d, args, env, block_size=BS, health_interval=0.2) as running:
        yield running


def test_adapter_requests_go_only_to_pods_that_hold_the_adapter(pods, smol, reference, prompts):
    rsrv, router, servers = pods
    holder, other = servers[0].base_url, servers[1].base_url
    assert wait_for(lambda: "qv8" in router.pods[holder].lora.registered)
    assert "qv8" not in router.pods[other].lora.registered
    served = []
    for i in range(6):
        ids = smol.tokenizer(f"Request {i}: tell me about the number {i * 7}.").input_ids
        r = _complete(rsrv.url, ids, "qv8", ADMIN)
        assert r.status_code == 200, r.text
        served.append(r.headers["x-kvmesh-pod"])
    assert set(served) == {holder}
    r = _complete(rsrv.url, prompts["long"], "qv8", ADMIN)
    assert r.json()["choices"][0]["text"] == reference[("qv8", "long")]


def test_the_pods_adapter_endpoints_take_the_admin_key(pods, adapters, prompts, reference):
    _, _, servers = pods
    url = servers[1].base_url
    body = {"lora_name": "all16", "lora_path": adapters["all16"]}
    assert httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=60).status_code == 401  # no key
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    again = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=60)
    assert again.status_code == 400 and "already been loaded" in again.text
    bad = httpx.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"}, headers=ADMIN, timeout=60
    )
    assert bad.status_code == 400 and "no such folder" in bad.json()["error"]["message"]
    models = {m["id"]: m for m in httpx.get(url + "/v1/models", headers=ADMIN, timeout=30).json()["data"]}
    assert models["all16"]["parent"] is not None
    r = _complete(url, prompts["long"], "all16", ADMIN)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference[("all16", "long")]
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "all16"}, headers=ADMIN, timeout=60)
    assert gone.status_code == 200, gone.text
    assert _complete(url, prompts["short"], "all16", ADMIN).status_code == 404
    missing = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "all16"}, headers=ADMIN, timeout=60)
    assert missing.status_code == 404
