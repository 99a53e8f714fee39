"""Router logic over real loopback HTTP and ZMQ, with fake pods (no model forwards).

Covers: events -> index (stored, removed, cleared), gap recovery through the
replay socket, restart detection, hot-prefix spreading, selective P/D, the P/D
fallback, retry on a dead pod, scoring and config parsing.
"""
from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest
import zmq

from kvmesh.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.engine.kv_publisher import KVEventPublisher, PublisherConfig
from kvmesh.services.router.config import PodSpec, RouterConfig, ScoringWeights, parse_pod_spec
from kvmesh.services.router.events import EventHub
from kvmesh.services.router.index import PrefixIndex
from kvmesh.services.router.policy import Pod, score_pods, shared_hits
from kvmesh.services.router.testing import FakePod, IdTokenizer, free_port, start_router

pytestmark = pytest.mark.unit
BS = 16
TOK = IdTokenizer()


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def hashes(ids):
    return TOK.block_hashes(ids, BS, None)


def test_parse_pod_spec():
    s = parse_pod_spec("http://10.0.0.1:8000,replay=tcp://10.0.0.1:9", "decode", events_port=5557)
    assert s == PodSpec("http://10.0.0.1:8000", "decode", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:9")
    with pytest.raises(ValueError):
        parse_pod_spec("http://x:1,bogus=1", "worker")
    with pytest.raises(ValueError):
        RouterConfig(policy="nope")


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


def test_score_prefers_hit_but_spreads_load():
    w = ScoringWeights()
    a, b = Pod(PodSpec("http://a:1")), Pod(PodSpec("http://b:1"))
    d = score_pods([a, b], {"http://a:1": 10}, 200, BS, w)
    assert d.pod is a and d.reason == "kv_hit" and d.hit_tokens == 160
    a.inflight_requests = 6  # far above the balance bound: the hit no longer wins
    assert score_pods([a, b], {"http://a:1": 10}, 200, BS, w).pod is b


def test_shared_system_prompt_reaches_the_idle_pod():
    """Three of four pods hold a system prompt that the 12 requests in flight on each share; the
    fourth is idle and holds nothing. The prefix is hot, so the guard's stricter limit (mean + 2 =
    11) sends the next request to the idle pod; with the general limit (1.25 x mean + 2 = 13.25)
    the fourth pod stayed idle up to 32 requests each. A prefix no in-flight request holds keeps
    the general limit."""
    w = ScoringWeights()
    pods = [Pod(PodSpec(f"http://{c}:1")) for c in "abcd"]
    hashes = list(range(900, 934))  # 32 system blocks, then the request's own
    for p in pods[:3]:
        p.inflight_requests = 12
        p.inflight_blocks.update({h: 12 for h in hashes[:32]})
    hits = {p.url: 32 for p in pods[:3]}  # 512 of a 544-token prompt
    hot = shared_hits(pods, hits, hashes)[1]
    assert hot == {p.url for p in pods[:3]} and not shared_hits(pods, hits, hashes)[0]
    d = score_pods(pods, hits, 544, BS, w, ref_len=544, hot=hot)
    assert d.pod is pods[3] and d.reason == "load"
    assert score_pods(pods, hits, 544, BS, w, ref_len=544).pod in pods[:3]  # not hot: general limit
    for p in pods[:3]:  # below the stricter limit too (mean 6 + 2) the hot prefix still wins
        p.inflight_requests = 3
    assert score_pods(pods, hits, 544, BS, w, ref_len=544, hot=hot).pod in pods[:3]


def test_hot_limit_scope_all_and_off():
    """The scope switch behind the A/Bs: "all" gives the stricter limit to every pod (the idle pod
    takes the request although nothing marks the prefix hot), "off" to none (the hot prefix stays);
    anything else is refused."""
    pods = [Pod(PodSpec(f"http://{c}:1")) for c in "abcd"]
    for p in pods[:3]:
        p.inflight_requests = 12
    hits = {p.url: 32 for p in pods[:3]}
    hot = {p.url for p in pods[:3]}
    assert score_pods(pods, hits, 544, BS, ScoringWeights(hot_limit_scope="all"), ref_len=544).pod is pods[3]
    assert score_pods(pods, hits, 544, BS, ScoringWeights(hot_limit_scope="off"), ref_len=544, hot=hot).pod in pods[:3]
    with pytest.raises(ValueError, match="hot_limit_scope"):
        ScoringWeights(hot_limit_scope="some")


def test_affinity_keeps_a_short_follow_up_unless_its_pod_is_queued():
    """A short follow-up mostly cached on a: against a typical prompt its hit is small and a's larger
    routing share alone would send it away (affinity 0); the affinity term keeps it on a. Seconds of
    queued prefill on a still send it elsewhere (starting sooner beats recomputing 80 tokens)."""
    a, b = Pod(PodSpec("http://a:1")), Pod(PodSpec("http://b:1"))
    a.recent, b.recent = 30.0, 10.0
    a.recent_t = b.recent_t = 0.0
    short = {"http://a:1": 5, "http://b:1": 1}  # 80 of a 96-token prompt on a
    assert score_pods([a, b], short, 96, BS, ScoringWeights(affinity=0.0), now=0.0, ref_len=640).pod is b
    assert ScoringWeights().affinity == 0.2
    d = score_pods([a, b], short, 96, BS, ScoringWeights(), now=0.0, ref_len=640)
    assert d.pod is a and d.hit_tokens == 80
    a.inflight_tokens = 4000
    assert score_pods([a, b], short, 96, BS, ScoringWeights(), now=0.0, ref_len=640).pod is b


def test_private_follow_up_passes_the_balance_guard():
    """A long conversation's follow-up stays with its pod past the balance limit (up to private_guard
    times it); a hot prefix that concurrent requests share, a short hit, or a pod past the hard limit
    does not."""
    a, b, c = (Pod(PodSpec(f"http://{x}:1")) for x in "abc")
    a.inflight_requests, b.inflight_requests, c.inflight_requests = 6, 1, 1  # limit 1.25 * 8/3 + 2 = 5.33
    hashes = list(range(100, 120))
    hits = {"http://a:1": 19, "http://b:1": 1, "http://c:1": 1}  # a holds 304 of 320 tokens
    w = ScoringWeights()
    assert w.private_guard == 2.0
    private = shared_hits([a, b, c], hits, hashes)[0]
    assert private == {"http://a:1", "http://b:1", "http://c:1"}  # nothing in flight shares anything yet
    d = score_pods([a, b, c], hits, 320, BS, w, private=private)
    assert d.pod is a and d.hit_tokens == 304 and d.reason == "private_follow_up"
    # exemption off, or not passed: the guard moves it
    assert score_pods([a, b, c], hits, 320, BS, ScoringWeights(private_guard=1.0), private=private).pod is not a
    assert score_pods([a, b, c], hits, 320, BS, w).pod is not a
    # the conversation's previous turn still in flight on a: still private
    a.inflight_blocks.update(hashes[:19])
    assert "http://a:1" in shared_hits([a, b, c], hits, hashes)[0]
    # a second concurrent sharer: a hot prefix, the guard applies
    a.inflight_blocks.update(hashes[:19])
    assert shared_hits([a, b, c], hits, hashes)[0] == {"http://b:1", "http://c:1"}
    assert score_pods([a, b, c], hits, 320, BS, w, private=shared_hits([a, b, c], hits, hashes)[0]).pod is not a
    # under half the prompt cached: not a follow-up
    short = {"http://a:1": 9, "http://b:1": 1, "http://c:1": 1}
    assert score_pods([a, b, c], short, 320, BS, w, private={"http://a:1"}).pod is not a
    # past private_guard x limit (load 40 > 2 x (1.25 * 42/3 + 2) = 39)
    a.inflight_requests = 40
    assert score_pods([a, b, c], hits, 320, BS, w, private={"http://a:1"}).pod is not a


def test_router_tracks_blocks_in_flight_per_pod():
    from kvmesh.services.router.app import Router
    from kvmesh.services.router.testing import IdTokenizer

    r = Router(RouterConfig(block_size=BS), tokenizer=IdTokenizer())
    r.add_pod(PodSpec("http://a:1"))
    pod = r.pods["http://a:1"]
    d = score_pods([pod], {}, 64, BS, ScoringWeights())
    f1 = r._begin(d, [1, 2, 3, 4], 64)
    f2 = r._begin(d, [1, 2, 9], 48)
    assert pod.inflight_blocks == {1: 2, 2: 2, 3: 1, 4: 1, 9: 1}
    r._end(f1)
    r._end(f1)  # ending twice changes nothing
    assert pod.inflight_blocks == {1: 1, 2: 1, 9: 1}
    r._end(f2)
    assert not pod.inflight_blocks and pod.inflight_requests == 0


def test_load_is_own_inflight_plus_other_clients():
    """A scrape counts the router's own requests too: only the excess is other clients' load, and a
    request that has ended no longer counts although the last scrape still saw it."""
    p = Pod(PodSpec("http://a:1"))
    p.inflight_requests, p.routed = 3, 3
    p.observe_scrape(3.0, 0.0, 0.1, inflight_before=3, routed_before=3)
    assert p.external == 0 and p.load == 3
    p.inflight_requests = 0  # all three finished before the next scrape
    assert p.load == 0
    p.routed = 4  # one routed while the scrape was on the wire: the pod may count it as well
    p.inflight_requests = 1
    p.observe_scrape(6.0, 1.0, None, inflight_before=0, routed_before=3)
    assert p.external == 6 and p.load == 7 and p.kv_usage == 0.1


def test_share_decays_and_places_new_work_evenly():
    w = ScoringWeights()
    a, b = Pod(PodSpec("http://a:1")), Pod(PodSpec("http://b:1"))
    for _ in range(8):
        a.note_routed(100.0, w.share_halflife_s)
    b.note_routed(100.0, w.share_halflife_s)
    assert a.share(100.0 + w.share_halflife_s, w.share_halflife_s) == pytest.approx(4.0)
    # a new conversation: both pods hold only the shared first block -> the less used pod
    d = score_pods([a, b], {"http://a:1": 1, "http://b:1": 1}, 320, BS, w, now=100.0)
    assert d.pod is b
    # a follow-up whose history is on the busier pod still goes there
    d = score_pods([a, b], {"http://a:1": 18, "http://b:1": 1}, 320, BS, w, now=100.0)
    assert d.pod is a and d.reason == "kv_hit"


def test_eviction_pressure_from_events_steers_new_prefixes_only():
    """BlockRemoved events build a decayed per-pod eviction count (a cleared pod starts over); a new
    prefix avoids the pod that evicts, a follow-up whose prefix that pod still holds stays there."""
    idx = PrefixIndex(evict_halflife=60.0)
    idx.stored("http://a:1", "m", range(100))
    idx.removed("http://a:1", "m", range(40))
    idx.removed("http://b:1", "m", [7])
    got = idx.eviction_pressure(["http://a:1", "http://b:1", "http://c:1"])
    assert got["http://a:1"] == pytest.approx(40, rel=1e-3) and got["http://b:1"] == pytest.approx(1, rel=1e-3)
    assert got["http://c:1"] == 0
    idx._evicted["http://a:1"] = (40.0, idx._evicted["http://a:1"][1] - 60.0)  # one half-life ago
    assert idx.eviction_pressure(["http://a:1"])["http://a:1"] == pytest.approx(20, rel=1e-3)
    idx.clear_pod("http://a:1")
    assert idx.eviction_pressure(["http://a:1"])["http://a:1"] == 0

    w = ScoringWeights(share=0.0, evict=0.3)
    a, b = Pod(PodSpec("http://a:1")), Pod(PodSpec("http://b:1"))
    b.inflight_requests = 1  # b is a little busier: without pressure the new prefix goes to a
    new = {"http://a:1": 1, "http://b:1": 1}  # only the shared first block
    assert score_pods([a, b], new, 320, BS, w).pod is a
    pressure = {"http://a:1": 300.0, "http://b:1": 0.0}
    assert score_pods([a, b], new, 320, BS, w, pressure=pressure).pod is b
    assert score_pods([a, b], new, 320, BS, ScoringWeights(share=0.0, evict=0.0), pressure=pressure).pod is a
    warm = {"http://a:1": 15, "http://b:1": 1}  # a follow-up: most of the prompt is cached on a
    assert score_pods([a, b], warm, 320, BS, w, pressure=pressure).pod is a


def test_hit_value_is_measured_against_a_typical_prompt():
    """A short prompt's few cached blocks save little prefill: with a typical prompt of 640 tokens they
    no longer outweigh a request-share surplus; a long prompt's cached prefix still does. (The scores
    alone, without the affinity term, which values a hit against the prompt itself.)"""
    w = ScoringWeights(affinity=0.0)
    a, b = Pod(PodSpec("http://a:1")), Pod(PodSpec("http://b:1"))
    a.recent, b.recent = 30.0, 10.0
    a.recent_t = b.recent_t = 0.0
    short = {"http://a:1": 3, "http://b:1": 1}  # 3 of a 4-block prompt on a
    assert score_pods([a, b], short, 64, BS, w, now=0.0).pod is a  # no scale: 75 % of the prompt
    assert score_pods([a, b], short, 64, BS, w, now=0.0, ref_len=640).pod is b
    long = {"http://a:1": 39, "http://b:1": 1}
    assert score_pods([a, b], long, 640, BS, w, now=0.0, ref_len=640).pod is a


def test_pending_prefill_tokens_released_at_first_byte():
    from kvmesh.services.router.app import Flight

    p = Pod(PodSpec("http://a:1"))
    p.inflight_tokens = 500
    f = Flight(p, 500)
    f.prefilled()
    f.prefilled()  # once only
    assert p.inflight_tokens == 0 and f.tokens == 0


@pytest.fixture
def pods():
    ps = [FakePod(delay=0.3).start() for _ in range(4)]
    yield ps
    for p in ps:
        p.stop()


def test_hot_prefix_spreads(pods):
    """64 concurrent requests share a 512-token system prompt: no pod gets more than 1.5x the mean."""
    cfg = RouterConfig(port=free_port(), block_size=BS, pods=tuple(PodSpec(p.url) for p in pods),
                       health_interval=0.5)
    srv, router = start_router(cfg, TOK)
    try:
        system = list(range(1000, 1512))

        # request 0 carries a longer history of its own (256 tokens), like a conversation's first turn
        own = lambda i: [50000 + i] * (256 if i == 0 else 32)  # noqa: E731

        def one(i):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": system + own(i), "max_tokens": 4},
                           timeout=30)
            assert r.status_code == 200, r.text
            return r.headers["x-kvmesh-pod"]

        with cf.ThreadPoolExecutor(64) as ex:
            got = list(ex.map(one, range(64)))
        counts = [got.count(p.url) for p in pods]
        assert max(counts) / (64 / len(pods)) <= 1.5 and min(counts) > 0, counts
        # a follow-up of request 0's conversation goes where request 0 went (history/predicted index)
        time.sleep(1.2)  # let a scrape see the pods idle again
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": system + own(0) + list(range(40)),
                                                           "max_tokens": 1}, timeout=30)
        assert r.headers["x-kvmesh-pod"] == got[0]
        m = httpx.get(srv.url + "/metrics").text
        assert "kvmesh:router_routing_decisions_total" in m and "kvmesh:router_index_drift_tokens" in m
    finally:
        srv.stop()


def test_dead_pod_is_retried_and_taken_out(pods):
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = RouterConfig(port=free_port(), block_size=BS, policy="round-robin",
                       pods=(PodSpec(dead), PodSpec(pods[0].url)), health_interval=60)
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
    cfg = RouterConfig(port=free_port(), block_size=BS, pods=(PodSpec(slow.url),), health_interval=60,
                       read_timeout=0.3)
    srv, router = start_router(cfg, TOK)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, timeout=30)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["type"] == "server_error" and "ReadTimeout" in r.json()["error"]["message"]
        assert router.pods[slow.url].healthy  # slow is not gone: no retry, no marking down
        assert router.pods[slow.url].inflight_requests == 0
        r = httpx.post(srv.url + "/v1/completions", content=b"{not json", timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    finally:
        srv.stop()
        slow.stop()
    assert router.upstream.session is None  # shutdown closed the session and its pooled connections


def test_stream_is_relayed_chunk_by_chunk():
    """Each SSE event reaches the client when the pod sends it, not when the stream ends: the pod
    sends its later events only after the client has received the first one (a relay that
    buffered would make it give up waiting and say so in the stream)."""
    import asyncio
    import threading

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from kvmesh.services.router.testing import ThreadServer

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
        with httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": [1, 2], "stream": True},
                          timeout=60) as r:
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
    cfg = RouterConfig(port=free_port(), block_size=BS, pd_min_uncached=64, health_interval=60,
                       pods=(PodSpec(pre.url, "prefill"), PodSpec(dec.url, "decode", ep, rep)))
    srv, router = start_router(cfg, TOK)
    try:
        prompt = list(range(500, 500 + 320))  # 20 blocks
        # nothing cached on decode: prefill first, then decode with the returned params
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5}, timeout=30)
        assert r.status_code == 200
        assert pre.bodies[-1]["max_tokens"] == 1 and pre.bodies[-1]["kv_transfer_params"] == {"do_remote_decode": True}
        assert dec.bodies[-1]["kv_transfer_params"]["remote_engine_id"] == "fake"
        assert dec.bodies[-1]["max_tokens"] == 5
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
        # prefill pod dies: decode recomputes, the client still gets its answer
        pre.stop()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": list(range(3000, 3400)), "max_tokens": 2,
                                                           "stream": True}, timeout=30)
        assert r.status_code == 200 and "[DONE]" in r.text
        assert "kv_transfer_params" not in dec.bodies[-1]
        assert "fallback_prefill_unavailable" in httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
        pub.close()
        dec.stop()


def test_endpoint_slice_parsing_and_metrics_scrape():
    from kvmesh.services.router.app import parse_vllm_metrics
    from kvmesh.services.router.discovery import endpoints_from_slice

    sl = {"ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
          "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                        {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                        {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
                        {"addresses": ["10.0.0.4"]}]}
    assert endpoints_from_slice(sl, "http") == {("10.0.0.1", 8000), ("10.0.0.4", 8000)}
    text = ('# HELP x\nvllm:num_requests_running{model_name="a"} 2.0\nvllm:num_requests_running{model_name="b"} 1.0\n'
            'vllm:num_requests_waiting{model_name="a"} 3.0\nvllm:kv_cache_usage_perc{model_name="a"} 0.5\n')
    assert parse_vllm_metrics(text) == {"running": 3.0, "waiting": 3.0, "kv_usage": 0.5}


@pytest.mark.parametrize("predicted, reported", [(32, 0), (0, 48), (16, 16)])
def test_index_drift_is_recorded_in_both_directions(predicted: int, reported: int) -> None:
    """A pod reporting more cached tokens than predicted is drift too, not an error (a counter
    cannot go down, so each direction has its own)."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from kvmesh.services.router.app import Router
    from kvmesh.services.router.metrics import RouterMetrics

    router = SimpleNamespace(metrics=RouterMetrics())
    Router.observe_usage(router, SimpleNamespace(hit_tokens=predicted),
                         {"prompt_tokens_details": {"cached_tokens": reported}})
    text = generate_latest(router.metrics.registry).decode()
    assert f"kvmesh:router_index_overpredicted_tokens_total {float(max(0, predicted - reported))}" in text
    assert f"kvmesh:router_index_underpredicted_tokens_total {float(max(0, reported - predicted))}" in text
