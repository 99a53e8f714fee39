"""A pod whose engine is down answers 503 with the engine-unavailable header, and the router sends the
request to another pod instead of passing the 503 on.

Two real `kvmesh serve` pods behind the router; the one that holds a prompt's prefix loses its engine
process (killed, no restart left: what a lost tensor-parallel rank or a crash leaves). The next request
for that prefix is routed to it by the prefix index, gets the 503, and is answered by the other pod.
"""

from __future__ import annotations

import functools
import os
import signal

import httpx
import pytest

from kvmesh.services.errors import ENGINE_UNAVAILABLE_HEADER
from kvmesh.testing.pods import wait_for as _wait_for

pytestmark = pytest.mark.integration

ENV = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"}
BS = 16
wait_for = functools.partial(_wait_for, timeout=30.0, poll=0.05)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from kvmesh.testing.pods import serve_pods_behind_router

    args = ["--max-model-len", "512", "--num-kv-blocks", "64", "--block-size", str(BS), "--engine-restarts", "0"]
    d = tmp_path_factory.mktemp("router-unavailable")
    # Health checks far apart: the router must learn of the dead engine from the request itself.
    with serve_pods_behind_router(d, [args, args], ENV, block_size=BS, health_interval=600.0) as running:
        yield running


def _complete(url: str, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_a_pod_without_its_engine_is_skipped_not_passed_on(cluster):
    srv, router, pods = cluster
    prompt = "Document 7. " + " ".join(f"w7x{j}" for j in range(60))
    first = _complete(srv.url, prompt)
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvmesh-pod"]
    other = next(p for p in pods if p.base_url != holder)
    ids = router.tok.prompt_ids("/v1/completions", {"prompt": prompt})
    h = router.tok.block_hashes(ids, BS, None)
    assert wait_for(lambda: router.index.match_exact(router.ns, h, holder) == len(h))  # the router knows
    victim = next(p for p in pods if p.base_url == holder)
    os.kill(victim.engine_pid(), signal.SIGKILL)
    direct = None

    def unavailable() -> bool:
        nonlocal direct
        direct = _complete(holder, prompt)
        return direct.status_code == 503

    assert wait_for(unavailable)  # the pod's own answer: 503, marked as an unavailable engine
    assert direct is not None and direct.headers.get(ENGINE_UNAVAILABLE_HEADER) == "1"
    assert "Retry-After" not in direct.headers  # not an overload
    assert router.pods[holder].healthy  # no health check has run since

    before = router.metrics.retries.labels("EngineUnavailable")._value.get()
    again = _complete(srv.url, prompt)  # the prefix index still points at the dead engine's pod
    assert again.status_code == 200, again.text
    assert again.headers["x-kvmesh-pod"] == other.base_url
    assert router.metrics.retries.labels("EngineUnavailable")._value.get() == before + 1
    assert router.pods[holder].healthy is False  # out until a health check finds it back
