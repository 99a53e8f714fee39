"""Router over real loopback HTTP and ZMQ, with fake pods (no model forwards).

Covers: events -> index (stored, removed, cleared), gap recovery through the replay socket, restart
detection, hot-prefix spreading, selective P/D, the P/D fallback, retry on a dead pod, upstream
timeouts and streaming relay.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from kvmesh.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.engine.core.kv_publisher import KVEventPublisher, PublisherConfig
from kvmesh.services.router.config import PodSpec, RouterConfig
from kvmesh.services.router.events import EventHub
from kvmesh.services.router.index import PrefixIndex
from kvmesh.testing.pods import FakePod, IdTokenizer, start_router, wait_for
from kvmesh.topology import free_port

pytestmark = pytest.mark.integration
BS = 16
TOK = IdTokenizer()


def hashes(ids):
    return TOK.block_hashes(ids, BS, None)


def test_events_index_gap_replay_restart(tmp_path):
    idx = PrefixIndex()
    hub = EventHub(idx, replay_timeout=2.0)
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rep"
    pub = KVEventPublisher(PublisherConfig(ep, rep, "kv@a@m"))
    hub.add_pod("a", "m", ep, rep)
    h = hashes(list(range(64)))  # 4 blocks
    assert wait_for(lambda: hub.pod_seq("a") is None and "a" in [s.pod for s in hub._subs.values()])
    time.sleep(0.3)
    pub.publish([BlockStored(h[:2], None, list(range(32)), BS)])
    assert wait_for(lambda: idx.match("m", h, ["a"])["a"] == 2)
    # a gap: the hub misses seq 1 and 2 (published while disconnected) and must replay them
    hub.remove_pod("a")
    assert wait_for(lambda: hub.pod_seq("a") is None)
    time.sleep(0.2)
    pub.publish([BlockStored(h[:2], None, list(range(32)), BS)])
    pub.publish([BlockStored(h[2:4], h[1], list(range(32, 64)), BS)])
    time.sleep(0.3)
    hub.add_pod("a", "m", ep, rep)
    time.sleep(0.5)
    pub.publish([BlockRemoved([h[3]])])  # seq 3: the hub replays 0..2 first
    assert wait_for(lambda: hub.pod_seq("a") == 3)
    assert idx.match("m", h, ["a"])["a"] == 3
    assert hub.stats.gaps >= 1 and hub.stats.replayed >= 3
    pub.publish([AllBlocksCleared()])
    assert wait_for(lambda: idx.match("m", h, ["a"])["a"] == 0)
    # restart: a new publisher starts again at seq 0 -> everything the pod held is forgotten
    pub.publish([BlockStored(h[:1], None, list(range(16)), BS)])
    assert wait_for(lambda: idx.match("m", h, ["a"])["a"] == 1)
    pub.close()
    time.sleep(0.2)
    pub2 = KVEventPublisher(PublisherConfig(ep, rep, "kv@a@m"))
    time.sleep(0.5)
    pub2.publish([BlockRemoved([12345])])
    assert wait_for(lambda: hub.stats.restarts == 1)
    assert idx.match("m", h, ["a"])["a"] == 0
    pub2.close()
    hub.close()


def test_unrecoverable_gap_resyncs(tmp_path):
    """Batches the publisher had to drop leave a gap replay cannot fill: the pod's entries are dropped."""
    idx = PrefixIndex()
    hub = EventHub(idx, replay_timeout=1.0)
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rep"
    pub = KVEventPublisher(PublisherConfig(ep, rep, "t"))
    hub.add_pod("a", "m", ep, rep)
    time.sleep(0.5)
    h = hashes(list(range(32)))
    pub.publish([BlockStored(h[:1], None, list(range(16)), BS)])
    assert wait_for(lambda: idx.match("m", h, ["a"])["a"] == 1)
    pub._lost += 2  # what a full queue does: two batches never sent, their seqs skipped
    pub.publish([BlockStored(h[1:2], h[0], list(range(16, 32)), BS)])
    assert wait_for(lambda: hub.pod_seq("a") == 3)
    assert hub.stats.resyncs == 1
    assert idx.match("m", h, ["a"])["a"] == 0  # block 0 forgotten: the chain from the start is broken
    pub.close()
    hub.close()


@pytest.fixture
def pods():
    ps = [FakePod(delay=0.3).start() for _ in range(4)]
    yield ps
    for p in ps:
        p.stop()


def test_hot_prefix_spreads(pods):
    """64 requests in flight at once share a 512-token system prompt: no pod gets more than 1.5x the mean."""
    cfg = RouterConfig(port=free_port(), block_size=BS, pods=tuple(PodSpec(p.url) for p in pods), health_interval=0.5)
    srv, router = start_router(cfg, TOK)
    try:
        system = list(range(1000, 1512))

        # request 0 carries a longer history of its own (256 tokens), like a conversation's first turn
        own = lambda i: [50000 + i] * (256 if i == 0 else 32)  # noqa: E731

        def one(i):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": system + own(i), "max_tokens": 4}, timeout=30)
            assert r.status_code == 200, r.text
            return r.headers["x-kvmesh-pod"]

        # The pods hold every answer until all 64 requests are in flight, so each routing decision sees
        # the ones before it still running, however slowly this machine sends them.
        for p in pods:
            p.paused = True
        with cf.ThreadPoolExecutor(64) as ex:
            futs = [ex.submit(one, i) for i in range(64)]
            assert wait_for(lambda: sum(p.inflight for p in pods) == 64, timeout=60)
            for p in pods:
                p.paused = False
            got = [f.result() for f in futs]
        counts = [got.count(p.url) for p in pods]
        assert max(counts) / (64 / len(pods)) <= 1.5 and min(counts) > 0, counts
        # a follow-up of request 0's conversation goes where request 0 went (history/predicted index)
        time.sleep(1.2)  # let a scrape see the pods idle again
        r = httpx.post(
            srv.url + "/v1/completions", json={"prompt": system + own(0) + list(range(40)), "max_tokens": 1}, timeout=30
        )
        assert r.headers["x-kvmesh-pod"] == got[0]
        m = httpx.get(srv.url + "/metrics").text
        assert "kvmesh:router_routing_decisions_total" in m and "kvmesh:router_index_drift_tokens" in m
    finally:
        srv.stop()


def test_dead_pod_is_retried_and_taken_out(pods):
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = RouterConfig(
        port=free_port(),
        block_size=BS,
        policy="round-robin",
        pods=(PodSpec(dead), PodSpec(pods[0].url)),
        health_interval=60,
    )
    srv, router = start_router(cfg, TOK)
    try:
        router.pods[dead].healthy = True  # as if it died after the last health check
        for _ in range(6):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, timeout=30)
            assert r.status_code == 200 and r.headers["x-kvmesh-pod"] == pods[0].url
        assert router.pods[dead].healthy is False and router.pods[dead].failures == 1
        assert 'kvmesh:router_retries_total{reason="ConnectError"} 1.0' in httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()


def test_upstream_timeout_is_an_openai_error_and_close_frees_the_client():
    slow = FakePod(delay=2.0).start()
    cfg = RouterConfig(port=free_port(), block_size=BS, pods=(PodSpec(slow.url),), health_interval=60, read_timeout=0.3)
    srv, router = start_router(cfg, TOK)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, timeout=30)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["type"] == "GatewayTimeoutError" and "ReadTimeout" in r.json()["error"]["message"]
        assert router.pods[slow.url].healthy  # slow is not gone: no retry, no marking down
        assert router.pods[slow.url].inflight_requests == 0
        r = httpx.post(srv.url + "/v1/completions", content=b"{not json", timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    finally:
        srv.stop()
        slow.stop()
    assert router.upstream.session is None  # shutdown closed the session and its pooled connections


def test_non_text_content_parts_are_refused_like_the_pod_refuses_them():
    """The router renders chats with the engine's `chat_messages`: a non-text part is a 400 in the
    pods' error schema, and no pod sees the request."""
    from kvmesh.common.chat import chat_messages

    class ChatTokenizer(IdTokenizer):
        def prompt_ids(self, path, body):
            if path.endswith("chat/completions"):
                return [len(m["content"]) for m in chat_messages(body["messages"])]
            return super().prompt_ids(path, body)

    pod = FakePod().start()
    cfg = RouterConfig(port=free_port(), block_size=BS, pods=(PodSpec(pod.url),), health_interval=60)
    srv, _ = start_router(cfg, ChatTokenizer())
    try:
        text = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
        assert httpx.post(srv.url + "/v1/chat/completions", json=text, timeout=30).status_code == 200
        image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=image, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "BadRequestError" and err["param"] == "messages"
        assert "image_url" in err["message"] and len(pod.bodies) == 1
    finally:
        srv.stop()
        pod.stop()


def test_stream_is_relayed_chunk_by_chunk():
    """Each SSE event reaches the client when the pod sends it, not when the stream ends: the pod
    sends its later events only after the client has received the first one (a relay that
    buffered would make it give up waiting and say so in the stream)."""
    import asyncio
    import threading

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from kvmesh.testing.pods import ThreadServer

    app = FastAPI()
    client_saw_first = threading.Event()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def gen():
        async def sse():
            yield 'data: {"choices": [{"index": 0, "text": "0"}]}\n\n'
            seen = await asyncio.to_thread(client_saw_first.wait, 20)
            for i in (1, 2):
                text = str(i) if seen else "buffered"
                yield f'data: {{"choices": [{{"index": 0, "text": "{text}"}}]}}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    pod = ThreadServer(app).start()
    cfg = RouterConfig(port=free_port(), block_size=BS, pods=(PodSpec(pod.url),), health_interval=60)
    srv, router = start_router(cfg, TOK)
    try:
        seen = []
        with httpx.stream(
            "POST", srv.url + "/v1/completions", json={"prompt": [1, 2], "stream": True}, timeout=60
        ) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for chunk in r.iter_raw():
                seen.append(chunk)
                if b'"text": "0"' in chunk:
                    client_saw_first.set()
        body = b"".join(seen)
        assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")
        assert b"buffered" not in body, body  # the first event was relayed before the pod went on
        assert router.pods[pod.url].inflight_requests == 0
    finally:
        srv.stop()
        pod.stop()


def test_selective_pd_and_fallback(tmp_path):
    pre, dec = FakePod().start(), FakePod(cached_tokens=0).start()
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rep"
    pub = KVEventPublisher(PublisherConfig(ep, rep, "kv@dec@m"))
    cfg = RouterConfig(
        port=free_port(),
        block_size=BS,
        pd_min_uncached=64,
        health_interval=60,
        pods=(PodSpec(pre.url, "prefill"), PodSpec(dec.url, "decode", ep, rep)),
    )
    srv, router = start_router(cfg, TOK)
    try:
        prompt = list(range(500, 500 + 320))  # 20 blocks
        # nothing cached on decode: prefill first, then decode with the returned params
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5}, timeout=30)
        assert r.status_code == 200
        assert pre.bodies[-1]["max_tokens"] == 1 and pre.bodies[-1]["kv_transfer_params"] == {"do_remote_decode": True}
        assert dec.bodies[-1]["kv_transfer_params"]["remote_engine_id"] == "fake"
        assert dec.bodies[-1]["max_tokens"] == 5
        # only the router sets kv_transfer_params: a client's own never reach a pod (security_probe 4b+)
        n_pre, n_dec = len(pre.bodies), len(dec.bodies)
        for stream in (False, True):
            stolen = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_block_ids": [0]}
            r = httpx.post(
                srv.url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 5, "stream": stream, "kv_transfer_params": stolen},
                timeout=30,
            )
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["param"] == "kv_transfer_params" and err["type"] == "BadRequestError" and err["code"] == 400
        assert (len(pre.bodies), len(dec.bodies)) == (n_pre, n_dec)
        # decode publishes that it holds 18 of the 20 blocks of another prompt sharing the first 18
        time.sleep(0.3)
        other = prompt[:288] + list(range(9000, 9040))
        h = hashes(other)
        pub.publish([BlockStored(h[:18], None, other[:288], BS)])
        assert wait_for(lambda: router.index.match_exact(router.ns, h, dec.url) >= 18)
        n_pre = len(pre.bodies)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": other, "max_tokens": 5}, timeout=30)
        assert r.status_code == 200 and len(pre.bodies) == n_pre  # prefill skipped
        assert "kv_transfer_params" not in dec.bodies[-1]
        m = httpx.get(srv.url + "/metrics").text
        assert 'kvmesh:router_pd_decisions_total{path="decode_only"} 1.0' in m
        assert 'kvmesh:router_pd_decisions_total{path="prefill_decode"} 1.0' in m
        # a 4xx from the prefill pod is the client's error: answered as it is, never retried on decode
        refusal = {"error": {"message": "temperature must be >= 0", "type": "BadRequestError", "param": "temperature"}}
        pre.refuse, n_dec = (400, refusal), len(dec.bodies)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": list(range(7000, 7320))}, timeout=30)
        pre.refuse = None
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
        assert r.json()["error"]["message"] == "temperature must be >= 0"
        assert len(dec.bodies) == n_dec  # decode never saw it
        assert (
            'kvmesh:router_pd_decisions_total{path="prefill_client_error"} 1.0' in httpx.get(srv.url + "/metrics").text
        )
        # prefill pod dies: decode recomputes, the client still gets its answer
        pre.stop()
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": list(range(3000, 3400)), "max_tokens": 2, "stream": True},
            timeout=30,
        )
        assert r.status_code == 200 and "[DONE]" in r.text
        assert "kv_transfer_params" not in dec.bodies[-1]
        assert "fallback_prefill_unavailable" in httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
        pub.close()
        dec.stop()


def test_prefill_pairs_only_with_a_decode_pod_of_its_kv_layout():
    """Mid-rollout a prefill pod may have another KV layout (dtype, block size) than the decode pod: the
    router then lets decode compute the prompt, and pairs them again once the layouts agree."""
    pre, dec = FakePod().start(), FakePod().start()
    pre.kv_layout, dec.kv_layout = "old-layout", "new-layout"
    cfg = RouterConfig(
        port=free_port(),
        block_size=BS,
        pd_min_uncached=0,
        health_interval=0.1,
        pods=(PodSpec(pre.url, "prefill"), PodSpec(dec.url, "decode")),
    )
    srv, router = start_router(cfg, TOK)
    try:
        assert wait_for(lambda: router.pods[pre.url].kv_layout == "old-layout", timeout=10)
        assert wait_for(lambda: router.pods[dec.url].kv_layout == "new-layout", timeout=10)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": list(range(100, 164))}, timeout=30)
        assert r.status_code == 200 and pre.bodies == [] and "kv_transfer_params" not in dec.bodies[-1]
        assert 'kvmesh:router_pd_decisions_total{path="decode_only_layout"} 1.0' in httpx.get(srv.url + "/metrics").text
        pre.kv_layout = "new-layout"
        assert wait_for(lambda: router.pods[pre.url].kv_layout == "new-layout", timeout=10)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": list(range(200, 264))}, timeout=30)
        assert r.status_code == 200 and len(pre.bodies) == 1
        assert dec.bodies[-1]["kv_transfer_params"]["remote_engine_id"] == "fake"
    finally:
        srv.stop()
        pre.stop()
        dec.stop()


def test_liveness_does_not_depend_on_the_pods():
    """No decode pod: /health (readiness) is 503, /live (liveness) stays 200."""
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = RouterConfig(port=free_port(), block_size=BS, pods=(PodSpec(dead, role="decode"),), health_interval=0.2)
    srv, router = start_router(cfg, TOK)
    try:
        wait_for(lambda: not router.pods[dead].healthy)
        assert httpx.get(srv.url + "/health").status_code == 503
        assert httpx.get(srv.url + "/live").status_code == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("form", ["map", "array"])
def test_hub_reads_either_form_and_learns_the_pods_hash_scheme(tmp_path, form):
    """A pod publishing in either form (engine events, built by the pool of that form) is indexed the same;
    the batches are counted per form, and the pod's first block shows the router its block-hash scheme."""
    from kvmesh.common.kv_events import event_classes
    from kvmesh.engine.core.kv_cache_manager import KVCacheManager
    from kvmesh.engine.core.request import Request
    from kvmesh.engine.frontend.sampling_params import SamplingParams

    forms, schemes = [], []
    idx = PrefixIndex()
    hub = EventHub(idx, on_form=lambda pod, f: forms.append((pod, f)), on_scheme=lambda p, s: schemes.append((p, s)))
    ep = f"ipc://{tmp_path}/ev"
    pub = KVEventPublisher(PublisherConfig(ep, None, "kv@a@m"))
    hub.add_pod("a", TOK.identity, ep, None)
    time.sleep(0.5)
    try:
        ids = list(range(48))
        for scheme in ("vllm", "kvmesh"):
            kv = KVCacheManager(8, BS, event_format=form)
            req = Request("r", ids, SamplingParams(max_tokens=1), BS, TOK.identity, cache_salt="t", prefix_hash=scheme)
            kv.allocate_slots(req, req.num_tokens)
            pub.publish(kv.pool.take_events())
            want = TOK.block_hashes(ids, BS, "t", scheme)
            assert wait_for(lambda w=want: idx.match(TOK.identity, w, ["a"])["a"] == 3)
            assert wait_for(lambda s=scheme: hub.pod_prefix_hash("a") == s)
            if scheme == "vllm":  # a restarted pod may run another scheme: the hub learns it again
                pub.close()
                time.sleep(0.2)
                pub = KVEventPublisher(PublisherConfig(ep, None, "kv@a@m"))
                time.sleep(0.5)
                pub.publish([event_classes(form).cleared()])
                assert wait_for(lambda: hub.pod_prefix_hash("a") is None)
        assert schemes == [("a", "vllm"), ("a", None), ("a", "kvmesh")]
        assert {f for _, f in forms} == {form} and hub.stats.forms[form] == len(forms) == 3
        assert hub.stats.decode_errors == 0
    finally:
        pub.close()
        hub.close()


def test_router_hashes_prompts_as_its_pods_do_and_flags_a_mixed_set():
    from kvmesh.services.router.router import Router

    r = Router(RouterConfig(block_size=BS), tokenizer=TOK)
    try:
        assert r.prefix_hash == "kvmesh"
        r._pod_scheme("a", "vllm")
        r._pod_scheme("b", "vllm")
        assert r.prefix_hash == "vllm" and r.metrics.prefix_hash_mixed._value.get() == 0
        r._pod_scheme("c", "kvmesh")  # a mixed set: kvmesh's scheme, flagged
        assert r.prefix_hash == "kvmesh" and r.metrics.prefix_hash_mixed._value.get() == 1
        r._pod_scheme("c", None)  # c restarted (or left): the set agrees again
        assert r.prefix_hash == "vllm" and r.metrics.prefix_hash_mixed._value.get() == 0
    finally:
        r.hub.close()
