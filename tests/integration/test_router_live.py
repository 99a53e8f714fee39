"""The router in front of two real `kvmesh serve` pods publishing KV events.

Events -> index -> decision end to end: a request sharing a long prefix goes
to the pod that served the first; after that pod evicts the blocks (small
pool), the index forgets them; streaming passes through to the official
`openai` client unchanged; a killed pod is taken out and no request fails.
"""

from __future__ import annotations

import functools

import httpx
import pytest

from kvmesh.testing.pods import wait_for as _wait_for

pytestmark = pytest.mark.integration

ENV = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"}
BS = 16


# Real pods publish events at their own pace: a longer wait than the loopback tests'.
wait_for = functools.partial(_wait_for, timeout=20.0, poll=0.05)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from kvmesh.testing.pods import serve_pods_behind_router

    args = ["--max-model-len", "512", "--num-kv-blocks", "64", "--block-size", str(BS), "--stats-interval", "0.1"]
    d = tmp_path_factory.mktemp("router")
    with serve_pods_behind_router(d, [args, args], ENV, block_size=BS, health_interval=0.5) as running:
        yield running


def doc(i: int, words: int = 60) -> str:
    return f"Document {i}. " + " ".join(f"w{i}x{j}" for j in range(words))


def complete(url, prompt, **kw):
    r = httpx.post(
        url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **kw}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r


def test_prefix_follows_then_eviction_forgets(cluster):
    srv, router, pods = cluster
    base = doc(1)
    r1 = complete(srv.url, base)
    first = r1.headers["x-kvmesh-pod"]
    ids = router.tok.prompt_ids("/v1/completions", {"prompt": base})
    h = router.tok.block_hashes(ids, BS, None)
    assert len(h) >= 8
    assert wait_for(lambda: router.index.match_exact(router.ns, h, first) == len(h))  # exact, from events
    other = next(p.base_url for p in pods if p.base_url != first)
    assert router.index.match_exact(router.ns, h, other) == 0
    for _ in range(3):  # same prefix, new suffixes: all follow the first pod
        r = complete(srv.url, base + " and then some more words")
        assert r.headers["x-kvmesh-pod"] == first
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(h) - 1) * BS
    m = httpx.get(srv.url + "/metrics").text
    assert "kvmesh:router_reported_cached_tokens_total" in m
    # evict: fill the first pod's 64-block pool with other documents, sent to it directly
    for i in range(2, 8):
        complete(first, doc(i))
    assert wait_for(lambda: router.index.match_exact(router.ns, h, first) < len(h))
    assert router.index.match_exact(router.ns, h, first) == 0
    # the evictions were counted as that pod's pressure (a scoring input), the idle pod has none
    pressure = router.index.eviction_pressure([first, other])
    assert pressure[first] >= len(h) and pressure[other] == 0


def test_streaming_passthrough_openai_client(cluster):
    from openai import OpenAI

    srv, router, pods = cluster
    client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    prompt = "The capital of France is"
    direct = OpenAI(base_url=pods[0].base_url + "/v1", api_key="none").completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=6, temperature=0
    )
    chunks = list(
        client.completions.create(model=direct.model, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == direct.choices[0].text
    chat = client.chat.completions.create(
        model=direct.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = list(chat)
    assert parts[-1].usage is not None and parts[-1].usage.prompt_tokens > 0


def test_reset_prefix_cache_clears_the_pod_and_the_router_index(cluster):
    srv, router, pods = cluster
    pod = pods[0].base_url
    base = doc(40)
    complete(pod, base)
    ids = router.tok.prompt_ids("/v1/completions", {"prompt": base})
    h = router.tok.block_hashes(ids, BS, None)
    assert wait_for(lambda: router.index.match_exact(router.ns, h, pod) == len(h))
    # refused while a request runs: its blocks are in use (OpenAI error schema, nothing reset)
    body = {"prompt": doc(41, 10), "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", pod + "/v1/completions", json=body, timeout=120) as s:
        assert s.status_code == 200
        lines = s.iter_lines()
        assert next(ln for ln in lines if ln.startswith("data:"))  # running: its first token is out
        busy = httpx.post(pod + "/reset_prefix_cache", timeout=30)
        assert busy.status_code == 409, busy.text
        assert busy.json()["error"]["code"] == 409 and "running" in busy.json()["error"]["message"]
        for _ in lines:
            pass
    assert router.index.match_exact(router.ns, h, pod) == len(h)
    r = httpx.post(pod + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json() == {"reset": True}
    # AllBlocksCleared reached the router; the pod recomputes the whole prompt
    assert wait_for(lambda: router.index.match_exact(router.ns, h, pod) == 0)
    again = complete(pod, base)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(pod, base).json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(h) - 1) * BS


def test_killed_pod_taken_out(cluster):
    srv, router, pods = cluster
    victim = pods[1]
    victim.stop()
    for i in range(6):
        r = complete(srv.url, doc(100 + i, 10))
        assert r.headers["x-kvmesh-pod"] == pods[0].base_url
    assert router.pods[victim.base_url].healthy is False
    assert httpx.get(srv.url + "/health").status_code == 200


def test_pod_gone_from_discovery_leaves_no_series_and_no_index(cluster):
    """Discovery dropping a pod removes every series labelled with it from the router's /metrics
    (routing decisions, in-flight, health, KV-event counters ...) and its index entries, so neither
    dashboards nor an autoscaler keep counting a pod that is gone."""
    srv, router, pods = cluster
    gone, kept = pods[1].base_url, pods[0].base_url

    def series(url: str) -> list[str]:
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        return [ln for ln in text.splitlines() if not ln.startswith("#") and f'pod="{url}"' in ln]

    assert series(gone) and series(kept)  # earlier tests routed to both
    srv.call(router.remove_pod, gone)  # what K8sDiscovery calls when the EndpointSlice drops the pod
    assert series(gone) == []
    assert series(kept)
    assert gone not in router.pods and router.index.pod_blocks(gone) == 0
    assert complete(srv.url, doc(200, 10)).headers["x-kvmesh-pod"] == kept
    assert series(gone) == []  # a request afterwards does not bring them back
