"""Router logic without sockets: scoring, the balance guards, in-flight accounting, the prefix index's
eviction pressure, config and EndpointSlice parsing, drift metrics (the loopback HTTP/ZMQ tests are in
the integration tier)."""

from __future__ import annotations

import pytest

from kvmesh.services.router.config import PodSpec, RouterConfig, ScoringWeights, parse_pod_spec
from kvmesh.services.router.index import PrefixIndex
from kvmesh.services.router.policy import Pod, score_pods, shared_hits

pytestmark = pytest.mark.unit
BS = 16


def test_parse_pod_spec():
    s = parse_pod_spec("http://10.0.0.1:8000,replay=tcp://10.0.0.1:9", "decode", events_port=5557)
    assert s == PodSpec("http://10.0.0.1:8000", "decode", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:9")
    with pytest.raises(ValueError):
        parse_pod_spec("http://x:1,bogus=1", "both")
    with pytest.raises(ValueError):
        RouterConfig(policy="nope")


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
    from kvmesh.services.router.router import Router
    from kvmesh.testing.pods import IdTokenizer

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
    from kvmesh.services.router.router import Flight

    p = Pod(PodSpec("http://a:1"))
    p.inflight_tokens = 500
    f = Flight(p, 500)
    f.prefilled()
    f.prefilled()  # once only
    assert p.inflight_tokens == 0 and f.tokens == 0


def test_endpoint_slice_parsing_and_metrics_scrape():
    from kvmesh.services.router.discovery import endpoints_from_slice
    from kvmesh.services.router.scrape import parse_vllm_metrics

    sl = {
        "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
        "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
            {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
            {"addresses": ["10.0.0.4"]},
        ],
    }
    assert endpoints_from_slice(sl, "http") == {("10.0.0.1", 8000), ("10.0.0.4", 8000)}
    text = (
        '# HELP x\nvllm:num_requests_running{model_name="a"} 2.0\nvllm:num_requests_running{model_name="b"} 1.0\n'
        'vllm:num_requests_waiting{model_name="a"} 3.0\nvllm:kv_cache_usage_perc{model_name="a"} 0.5\n'
    )
    assert parse_vllm_metrics(text) == {"running": 3.0, "waiting": 3.0, "kv_usage": 0.5}


@pytest.mark.parametrize("predicted, reported", [(32, 0), (0, 48), (16, 16)])
def test_index_drift_is_recorded_in_both_directions(predicted: int, reported: int) -> None:
    """A pod reporting more cached tokens than predicted is drift too, not an error (a counter
    cannot go down, so each direction has its own)."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from kvmesh.services.router.metrics import RouterMetrics
    from kvmesh.services.router.router import Router

    router = SimpleNamespace(metrics=RouterMetrics())
    Router.observe_usage(
        router, SimpleNamespace(hit_tokens=predicted), {"prompt_tokens_details": {"cached_tokens": reported}}
    )
    text = generate_latest(router.metrics.registry).decode()
    assert f"kvmesh:router_index_overpredicted_tokens_total {float(max(0, predicted - reported))}" in text
    assert f"kvmesh:router_index_underpredicted_tokens_total {float(max(0, reported - predicted))}" in text


def test_host_tier_events_keep_their_own_residency_and_score_between_a_hit_and_a_miss():
    """CPU-medium events (a pod's host-memory tier) fill a second map, never the device's, and are no
    eviction pressure; a host hit after the device hit scores ``host_hit`` of a device hit."""
    idx = PrefixIndex()
    a, b, c = "http://a:1", "http://b:1", "http://c:1"
    idx.stored(a, "m", range(2))  # a: two blocks on the device
    idx.stored(a, "m", range(2, 10), "CPU")  # then eight in its host tier
    idx.stored(b, "m", range(10), "GPU")  # b: all ten on the device
    idx.removed(a, "m", [9], "CPU")
    assert idx.match("m", list(range(10)), [a, b, c]) == {a: 2, b: 10, c: 0}  # device residency unchanged
    assert idx.match_host("m", list(range(10)), {a: 2, b: 10, c: 0}) == {a: 7, b: 0, c: 0}
    assert idx.eviction_pressure([a])[a] == 0
    assert idx.pod_tiers(a, "m") == {"GPU": {0, 1}, "CPU": set(range(2, 9))}
    idx.clear_pod(a)
    assert idx.pod_tiers(a, "m") == {"GPU": set(), "CPU": set()}

    w = ScoringWeights(share=0.0)
    pa, pb, pc = Pod(PodSpec(a)), Pod(PodSpec(b)), Pod(PodSpec(c))
    hits, host = {a: 2, b: 0, c: 0}, {a: 0, b: 8, c: 0}  # b: nothing on the device, eight blocks on the host
    pa.inflight_requests = 1  # a is a little busier
    d = score_pods([pa, pb, pc], hits, 200, BS, w, host_hits=host)
    assert d.pod is pb and d.hit_tokens == 8 * BS  # what b will report cached (the index's drift compares it)
    assert score_pods([pa, pb, pc], hits, 200, BS, w).pod is pa  # without the tier's view: a's device hit
    # a host hit is worth less than the same device hit, more than a miss
    dev = {a: 0, b: 10, c: 0}
    pb.inflight_requests = pc.inflight_requests = 0
    pa.inflight_requests = 0
    both = score_pods([pb, pc], {b: 0, c: 10}, 200, BS, w, host_hits={b: 10, c: 0})
    assert both.pod is pc and score_pods([pa, pb], dev, 200, BS, w, host_hits={a: 10, b: 0}).pod is pb
    assert score_pods([pa, pc], {a: 0, c: 0}, 200, BS, w, host_hits={a: 10, c: 0}).pod is pa


def test_disk_tier_events_keep_their_own_residency_and_score_below_a_host_hit():
    """DISK-medium events (the disk tier under a pod's host tier) fill a third map; `match_host` walks
    the chain after the device hit through host or disk, as the pod does, and a disk block scores
    ``disk_hit`` of a device block: below the same block on the host, above a miss."""
    idx = PrefixIndex()
    a, b, c = "http://a:1", "http://b:1", "http://c:1"
    idx.stored(a, "m", range(2))
    idx.stored(a, "m", range(2, 5), "CPU")
    idx.stored(a, "m", range(5, 10), "DISK")
    idx.stored(b, "m", range(10), "DISK")
    idx.removed(a, "m", [9], "DISK")
    assert idx.match("m", list(range(10)), [a, b, c]) == {a: 2, b: 0, c: 0}
    m = idx.match_host("m", list(range(10)), {a: 2, b: 0, c: 0})
    assert m == {a: 3, b: 0, c: 0} and m.disk == {a: 4, b: 10, c: 0}
    assert idx.eviction_pressure([a])[a] == 0
    assert idx.pod_tiers(a, "m") == {"GPU": {0, 1}, "CPU": {2, 3, 4}, "DISK": set(range(5, 9))}
    idx.clear_pod(a)
    assert idx.pod_tiers(a, "m") == {"GPU": set(), "CPU": set()}

    w = ScoringWeights(share=0.0)
    assert 0 < w.disk_hit < w.host_hit
    pb, pc = Pod(PodSpec(b)), Pod(PodSpec(c))
    on_host = idx.match_host("m", [], {})
    on_host.update({b: 10, c: 0})
    on_host.disk.update({b: 0, c: 10})
    d = score_pods([pb, pc], {b: 0, c: 0}, 200, BS, w, host_hits=on_host)
    assert d.pod is pb and d.hit_tokens == 10 * BS  # the host's blocks beat the same blocks on disk
    on_disk = idx.match_host("m", [], {})
    on_disk.update({b: 0, c: 0})
    on_disk.disk.update({b: 0, c: 10})
    d = score_pods([pb, pc], {b: 0, c: 0}, 200, BS, w, host_hits=on_disk)
    assert d.pod is pc and d.hit_tokens == 10 * BS  # a disk hit beats a miss, and counts as cached


def test_a_conversation_in_its_pods_host_tier_is_a_private_follow_up():
    """A conversation whose blocks its pod pushed down to the host tier (none left on the device) is the
    pod's private follow-up as one on its device is: a few requests over the balance limit, it stays
    where loading its KV back costs a fraction of recomputing it elsewhere; and its prefix shared
    on the device by two requests in flight there (a hot system prompt) does not make the
    conversation's deeper blocks hot. Without the tiers' view (``--weight-host-hit 0``) the guard
    moves it."""
    from kvmesh.services.router.router import Router
    from kvmesh.testing.pods import IdTokenizer

    def router(**weights) -> Router:
        r = Router(RouterConfig(block_size=BS, weights=ScoringWeights(**weights)), tokenizer=IdTokenizer())
        for x in "abc":
            r.add_pod(PodSpec(f"http://{x}:1"))
        a, b, c = r.pods.values()
        a.inflight_requests, b.inflight_requests, c.inflight_requests = 6, 1, 1  # limit 1.25 * 8/3 + 2
        r.index.stored(a.url, r.ns, hashes[19:])  # an unrelated block, so the device map knows the model
        r.index.stored(a.url, r.ns, hashes[:19], "CPU")  # 304 of the 320-token prompt in a's host tier
        return r

    hashes = list(range(500, 520))
    r = router()
    assert r.cfg.weights.host_hit * 304 * 2 >= 320  # the host-held share counts as a follow-up
    a = r.pods["http://a:1"]
    d = r.pick(list(r.pods.values()), hashes, 320)
    assert d.pod is a and d.reason == "private_follow_up" and d.hit_blocks == 0 and d.hit_tokens == 304
    # the first two blocks also on a's device, held by two requests in flight there (a shared system prompt)
    r.index.stored(a.url, r.ns, hashes[:2])
    a.inflight_blocks.update({h: 2 for h in hashes[:2]})
    d = r.pick(list(r.pods.values()), hashes, 320)
    assert d.pod is a and d.reason == "private_follow_up" and d.hit_blocks == 2 and d.hit_tokens == 304
    r = router(host_hit=0.0)
    assert r.pick(list(r.pods.values()), hashes, 320).pod is not r.pods["http://a:1"]
