"""P/D through the router with real pods: a prefill pod and a decode pod (`kvmesh serve --role ...
--kv-connector nixl`), KV blocks pulled over NIXL.

The router prefills with ``max_tokens=1`` + ``do_remote_decode``, hands the returned
params to the decode pod, and streams its answer; greedy outputs must equal the
decode pod's own answer without a transfer. A second request whose prefix the
decode pod now holds skips the prefill pod (selective P/D). Neither pod tokenizes the router's
requests: both take the prompt ids the router computed (``kvmesh_prompt_token_ids``).
"""

from __future__ import annotations

import json

import httpx
import pytest

from kvmesh.common import metric_names as mn
from kvmesh.common.prometheus import flat_metrics

pytestmark = pytest.mark.integration

ENV = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING", "KVMESH_KV_AUTH_KEY": "router-pd-live-kv-auth-key"}
BS = 16


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    pytest.importorskip("nixl")
    from kvmesh.services.router.config import PodSpec, RouterConfig
    from kvmesh.testing.pods import start_router
    from kvmesh.testing.servers import ServerProcess
    from kvmesh.topology import free_port

    d = tmp_path_factory.mktemp("pd")
    common = ["--max-model-len", "512", "--num-kv-blocks", "128", "--block-size", str(BS), "--kv-connector", "nixl"]
    pre = ServerProcess([*common, "--role", "prefill", "--engine-id", "pre0"], env=ENV, log_path=str(d / "prefill.log"))
    dec = ServerProcess(
        [
            *common,
            "--role",
            "decode",
            "--engine-id",
            "dec0",
            "--kv-events-endpoint",
            f"ipc://{d}/ev",
            "--kv-events-replay-endpoint",
            f"ipc://{d}/rep",
        ],
        env=ENV,
        log_path=str(d / "decode.log"),
    )
    try:
        pre.start()
        dec.start()
        cfg = RouterConfig(
            port=free_port(),
            block_size=BS,
            pd_min_uncached=64,
            health_interval=1.0,
            pods=(PodSpec(pre.base_url, "prefill"), PodSpec(dec.base_url, "decode", f"ipc://{d}/ev", f"ipc://{d}/rep")),
        )
        srv, router = start_router(cfg)
        yield srv, router, pre, dec
        srv.stop()
    finally:
        pre.stop()
        dec.stop()


def tokenized(pod) -> dict[str, float]:
    """The pod's prompts by source: tokenized there ("text") or the router's ids taken ("ids")."""
    m = flat_metrics(httpx.get(pod.base_url + "/metrics").text)
    return {s: m[f"{mn.total(mn.PROMPT_TOKENIZATIONS)}{{source={s}}}"] for s in mn.PROMPT_SOURCES}


def test_pd_through_router_exact_and_selective(pd):
    srv, router, pre, dec = pd
    prompt = "Once upon a time, " + " ".join(f"word{j}" for j in range(70))
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    # the reference: the decode pod alone, computing the prompt itself (salted so it caches nothing we reuse)
    ref = httpx.post(dec.base_url + "/v1/completions", json={**body, "cache_salt": "ref"}, timeout=300).json()
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        text = "".join(
            json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines() if line.startswith("data: {")
        )
    assert text == ref["choices"][0]["text"]
    m = httpx.get(srv.url + "/metrics").text
    assert 'kvmesh:router_pd_decisions_total{path="prefill_decode"} 1.0' in m, m
    # the reference was the decode pod's one tokenization; the router's request was tokenized by neither pod
    assert tokenized(pre) == {"ids": 1.0, "text": 0.0} and tokenized(dec) == {"ids": 1.0, "text": 1.0}
    # same prefix again: the decode pod holds it now, so the prefill pod is skipped
    r2 = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": prompt + " and more"}, timeout=300)
    assert r2.status_code == 200
    m = httpx.get(srv.url + "/metrics").text
    assert 'kvmesh:router_pd_decisions_total{path="decode_only"} 1.0' in m, m
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * BS


def test_client_kv_transfer_params_are_refused(pd):
    """security_probe 4b+: a client naming a side channel and blocks of its choice gets 400 from the router
    (OpenAI error schema); test_router_loopback shows no pod sees such a request."""
    srv, _, _, _ = pd
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "pre0",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_transfer_id": "0" * 32,
        "remote_block_ids": [0, 1],
    }
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": "steal", "max_tokens": 4, "kv_transfer_params": params},
        timeout=60,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params" and r.json()["error"]["type"] == "BadRequestError"
