"""API keys and tenants end to end: the router (in-process, real HTTP) in front of a real `kvmesh serve`
worker that accepts only the router's own key.

No key -> 401 at both; the right key -> 200 through the official `openai` client; a rotated keys
file takes effect without a restart; a tenant's key sent straight to the worker is refused; the
same long prompt hits the cache for the tenant that sent it before and never for another tenant
(router prediction, reported usage and the engine's prefix-cache counter agree); nothing is left
running afterwards. The admin key, distinct from every client key, is the only one that reads the
router's /pods, sees x-kvmesh-pod, and calls the worker's /drain and /reset_prefix_cache; the
router's open /metrics names no tenant unless --metrics-tenant-labels.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import replace

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from kvmesh.testing.pods import start_router
from kvmesh.testing.pods import wait_for as _wait_for
from kvmesh.topology import free_port

pytestmark = pytest.mark.integration

BS = 16
INTERNAL = "internal-key-of-the-router"
ADMIN = "admin-key-of-the-operator"
KEYS = [
    {"key": "alpha-key", "tenant": "alpha", "priority": 1},
    {"key": "beta-key", "tenant": "beta"},
]
wait_for = functools.partial(_wait_for, timeout=20.0, poll=0.05)


def write_keys(path, keys) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(keys, f)
    os.replace(tmp, path)  # as the kubelet swaps a Secret: the reader sees the old or the new file whole


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from kvmesh.services.router.config import PodSpec, RouterConfig
    from kvmesh.testing.servers import ServerProcess

    d = tmp_path_factory.mktemp("auth")
    keys_file, upstream_file, admin_file = d / "keys.json", d / "upstream", d / "admin"
    write_keys(keys_file, KEYS)
    upstream_file.write_text(INTERNAL + "\n")
    admin_file.write_text(ADMIN + "\n")
    env = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING", "KVMESH_API_KEY": INTERNAL}
    pod = ServerProcess(
        ["--max-model-len", "512", "--num-kv-blocks", "64", "--block-size", str(BS), "--stats-interval", "0.1"],
        env={**env, "KVMESH_ADMIN_KEY": ADMIN},
        log_path=str(d / "pod.log"),
    )
    pod.start()
    try:
        cfg = RouterConfig(
            port=free_port(),
            block_size=BS,
            pods=(PodSpec(pod.base_url),),
            health_interval=0.5,
            api_keys_file=str(keys_file),
            upstream_api_key_file=str(upstream_file),
            admin_key_file=str(admin_file),
        )
        srv, router = start_router(cfg)
        yield srv, router, pod, keys_file
        srv.stop()
    finally:
        pod.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def test_keys_at_router_and_worker(stack):
    srv, router, pod, _ = stack
    for url in (srv.url, pod.base_url):
        for headers in ({}, auth("wrong"), {"Authorization": "alpha-key"}):
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers)
            assert r.status_code == 401, (url, r.text)
            err = r.json()["error"]
            assert err["type"] == "AuthenticationError" and err["code"] == "invalid_api_key", err
        assert httpx.get(url + "/v1/models").status_code == 401
        for path in ("/health", "/metrics"):
            assert httpx.get(url + path).status_code == 200, (url, path)
    assert httpx.get(srv.url + "/live").status_code == 200
    assert httpx.get(srv.url + "/pods").status_code == 401
    assert httpx.get(srv.url + "/pods", headers=auth("beta-key")).status_code == 403  # the admin key's alone
    assert httpx.get(srv.url + "/pods", headers=auth(ADMIN)).status_code == 200
    assert httpx.post(pod.base_url + "/reset_prefix_cache").status_code == 401

    # the official client: a tenant key works at the router, and is refused by the worker
    client = OpenAI(base_url=srv.url + "/v1", api_key="alpha-key", max_retries=0, timeout=120)
    model = client.models.list().data[0].id  # the pod's list, fetched by the router with its own key
    out = client.completions.create(model=model, prompt="Hello there", max_tokens=2, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 2
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=pod.base_url + "/v1", api_key="alpha-key", max_retries=0).completions.create(
            model=model, prompt="Hello there", max_tokens=2
        )
    # the router's own key is the one the worker takes (models through the router need it too)
    r = httpx.post(pod.base_url + "/tokenize", json={"prompt": "hi"}, headers=auth(INTERNAL))
    assert r.status_code == 200 and r.json()["count"] >= 1


def test_the_admin_key_alone_administers_and_sees_the_topology(stack):
    srv, _, pod, _ = stack

    def forbidden(r: httpx.Response) -> None:
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["type"] == "PermissionDeniedError" and "admin key" in err["message"], err

    # a client key never administers: the router's /pods, the worker's /drain and /reset_prefix_cache
    for key in ("alpha-key", "beta-key"):
        forbidden(httpx.get(srv.url + "/pods", headers=auth(key)))
    for method, path in (("POST", "/drain"), ("GET", "/drain"), ("DELETE", "/drain"), ("POST", "/reset_prefix_cache")):
        forbidden(httpx.request(method, pod.base_url + path, headers=auth(INTERNAL)))  # the worker's client key
        assert httpx.request(method, pod.base_url + path, headers=auth("alpha-key")).status_code == 401
    assert httpx.get(pod.base_url + "/health").status_code == 200  # the client's POST /drain did nothing

    # the admin key does
    pods = httpx.get(srv.url + "/pods", headers=auth(ADMIN)).json()["pods"]
    assert [p["url"] for p in pods] == [pod.base_url]
    assert httpx.get(pod.base_url + "/drain", headers=auth(ADMIN)).json()["draining"] is False
    assert httpx.post(pod.base_url + "/reset_prefix_cache", headers=auth(ADMIN), timeout=30).status_code in (200, 409)

    # x-kvmesh-pod: never to a tenant (streaming or not), to the admin key only
    body = {"prompt": "Hello there", "max_tokens": 2, "temperature": 0}
    for stream in (False, True):
        r = httpx.post(
            srv.url + "/v1/completions", json={**body, "stream": stream}, headers=auth("alpha-key"), timeout=120
        )
        assert r.status_code == 200 and "x-kvmesh-pod" not in r.headers, r.headers
        r = httpx.post(srv.url + "/v1/completions", json={**body, "stream": stream}, headers=auth(ADMIN), timeout=120)
        assert r.status_code == 200 and r.headers["x-kvmesh-pod"] == pod.base_url


def test_metrics_name_tenants_only_with_the_opt_in(stack):
    from kvmesh.services.router.config import PodSpec, RouterConfig
    from kvmesh.services.router.metrics import tenant_label

    srv, router, pod, keys_file = stack
    body = {"prompt": "Hello there", "max_tokens": 1}
    assert httpx.post(srv.url + "/v1/completions", json=body, headers=auth("alpha-key"), timeout=120).status_code == 200
    text = httpx.get(srv.url + "/metrics").text  # open: any scraper reads it
    assert f'kvmesh:router_admitted_requests_total{{tenant="{tenant_label("alpha")}"}}' in text
    assert "alpha" not in text and "beta" not in text
    assert tenant_label("alpha") == "t-8ed3f6ad"  # printf %s alpha | sha256sum | cut -c1-8: stable, documented
    assert router.metrics.registry.get_sample_value("kvmesh:router_admitted_requests_total", {"tenant": "alpha"})

    cfg = replace(router.cfg, port=free_port(), metrics_tenant_labels=True, pods=(PodSpec(pod.base_url),))
    assert isinstance(cfg, RouterConfig)
    opted, _ = start_router(cfg)
    try:
        r = httpx.post(opted.url + "/v1/completions", json=body, headers=auth("alpha-key"), timeout=120)
        assert r.status_code == 200, r.text
        text = httpx.get(opted.url + "/metrics").text
        assert 'kvmesh:router_admitted_requests_total{tenant="alpha"} 1.0' in text
    finally:
        opted.stop()


def test_rotating_the_keys_file_needs_no_restart(stack):
    srv, _, _, keys_file = stack

    def status(key: str) -> int:
        return httpx.post(
            srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=auth(key), timeout=60
        ).status_code

    assert status("gamma-key") == 401
    write_keys(keys_file, [*KEYS, {"key": "gamma-key", "tenant": "gamma"}])
    assert wait_for(lambda: status("gamma-key") == 200)
    write_keys(keys_file, [k for k in KEYS if k["tenant"] != "beta"] + [{"key": "gamma-key", "tenant": "gamma"}])
    assert wait_for(lambda: status("beta-key") == 401)
    assert status("alpha-key") == 200
    # a broken file keeps the keys it replaced (a half-written Secret must not lock everybody out)
    keys_file.write_text("[{not json")
    os.utime(keys_file, ns=(1, 1))
    assert status("alpha-key") == 200
    write_keys(keys_file, KEYS)
    assert wait_for(lambda: status("gamma-key") == 401)
    assert status("beta-key") == 200


def test_tenants_never_share_cached_blocks(stack):
    srv, router, pod, _ = stack
    prompt = "Tenant isolation. " + " ".join(f"secret{j} of the first tenant" for j in range(40))

    def complete(key: str, **kw) -> dict:
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **kw},
            headers=auth(key),
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    def predicted() -> float:
        return router.metrics.registry.get_sample_value("kvmesh:router_predicted_hit_tokens_total") or 0.0

    first = complete("alpha-key")
    plen = first["prompt_tokens"]
    assert plen > 8 * BS
    p0 = predicted()
    second = complete("alpha-key")
    assert second["prompt_tokens_details"]["cached_tokens"] >= (plen - 1) // BS * BS - BS  # alpha hits its blocks
    assert predicted() - p0 >= (plen - 1) // BS * BS - BS  # and the router knew

    wait_for(lambda: metric(pod.base_url, "vllm:prefix_cache_queries_total") >= 2 * plen)
    queries, hits = (
        metric(pod.base_url, "vllm:prefix_cache_queries_total"),
        metric(pod.base_url, "vllm:prefix_cache_hits_total"),
    )
    p1 = predicted()
    beta = complete("beta-key")
    assert beta["prompt_tokens_details"]["cached_tokens"] == 0
    assert predicted() == p1  # the router's index predicted no hit for beta
    # the client's own salt is combined with the tenant, never used alone: alpha's salt gets beta nothing
    salted = complete("beta-key", cache_salt="alpha")
    assert salted["prompt_tokens_details"]["cached_tokens"] == 0
    assert predicted() == p1
    # the engine's prefix-cache counters: beta's lookups counted, no hit among them
    assert wait_for(lambda: metric(pod.base_url, "vllm:prefix_cache_queries_total") >= queries + 2 * plen)
    assert metric(pod.base_url, "vllm:prefix_cache_hits_total") == hits

    # nothing left running: no request on the worker, no block in use, the router's queue empty
    assert wait_for(lambda: metric(pod.base_url, "vllm:num_requests_running") == 0)
    assert wait_for(lambda: metric(pod.base_url, "vllm:kv_cache_usage_perc") == 0)
    assert router.admission.active == 0 and router.admission.waiting == 0
    admitted = router.metrics.registry.get_sample_value
    assert admitted("kvmesh:router_admitted_requests_total", {"tenant": "beta"}) >= 2
