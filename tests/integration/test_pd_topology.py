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
TENANT_KEYS = {"alpha": "alpha-key", "beta": "beta-key"}  # the router's clients (tenants)
ROUTER_AUTH = {"Authorization": "Bearer alpha-key"}
ADMIN_KEY = "admin-key-of-the-run"  # the router's /pods takes it, never a tenant's key
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
WORKER_ARGS = ("--max-model-len", "1024", "--num-kv-blocks", "256", "--block-size", str(BS))


@pytest.fixture(scope="module", params=["nixl", "redis"])
def topo(request, tmp_path_factory, monkeypatch_module):
    if request.param == "nixl":
        pytest.importorskip("nixl")
    from kvmesh.topology import Topology, TopologyConfig, free_port

    monkeypatch_module.setenv("KVMESH_CPU_THREADS", "1")
    keys = tmp_path_factory.mktemp(f"keys-{request.param}") / "keys.json"
    keys.write_text(json.dumps([{"key": k, "tenant": t} for t, k in TENANT_KEYS.items()]))
    cfg = TopologyConfig(
        port=free_port(),
        kv_connector=request.param,
        engine_args=WORKER_ARGS,
        router_args=("--pd-min-uncached", "0", "--block-size", str(BS)),
        log_dir=str(tmp_path_factory.mktemp(f"up-{request.param}")),
        startup_timeout_s=600,
        api_keys_file=str(keys),
        admin_key=ADMIN_KEY,
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
            topo.router_url + "/v1/completions",
            json={"prompt": ids, "max_tokens": 8, "temperature": 0},
            headers=ROUTER_AUTH,
            timeout=600,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == reference[name], name
        # Everything but the block holding the last prompt token came from the prefill pod.
        received = ((len(ids) - 1) // BS) * BS
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == received, name
    # Both pods export one KV layout id, the same: the router pairs them (services/router/scrape.py)
    from kvmesh.services.router.scrape import parse_kv_layout

    layouts = {parse_kv_layout(httpx.get(w.url + "/metrics", timeout=30).text) for w in (prefill, decode)}
    assert len(layouts) == 1 and "" not in layouts, layouts
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
    r = _worker_post(
        topo,
        decode.url + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 2, "kv_transfer_params": params},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["param"] == "kv_transfer_params"


def _worker_post(topo, url: str, **kw) -> httpx.Response:
    """A request straight to a worker, with the router's credential (the only key `kvmesh up` workers accept)."""
    return httpx.post(url, headers={"Authorization": f"Bearer {topo.upstream_key}"}, **kw)


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
        r = _worker_post(
            topo,
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
    first = _worker_post(
        topo,
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
            r = _worker_post(
                topo,
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
    r = _worker_post(
        topo,
        decode.url + "/v1/completions",
        json={"prompt": ids, "max_tokens": 8, "temperature": 0, "kv_transfer_params": good},
        timeout=600,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference["long"]
    assert _wait_metric_zero(prefill.url, "vllm:kv_cache_usage_perc", 120) == 0
    assert _wait_metric_zero(decode.url, "vllm:kv_cache_usage_perc", 60) == 0


def test_tenants_never_share_blocks_through_pd(topo, smol):
    """The same long prompt from alpha twice, then from beta, through router -> prefill -> decode:
    alpha's second prefill hits the prefill pod's cache, beta's hits nothing there; the router's
    index predicts nothing for beta; without keys at the workers, a tenant key is refused there."""
    prefill = next(w for w in topo.workers if w.role == "prefill")
    decode = next(w for w in topo.workers if w.role == "decode")
    ids = smol.tokenizer(" ".join(f"private{j} note of tenant alpha" for j in range(30))).input_ids[:150]
    hits, queries, predicted = (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "kvmesh:router_predicted_hit_tokens_total",
    )

    def send(tenant: str) -> dict:
        q0, dq0 = _metric(prefill.url, queries), _metric(decode.url, queries)
        r = httpx.post(
            topo.router_url + "/v1/completions",
            json={"prompt": ids, "max_tokens": 2, "temperature": 0},
            headers={"Authorization": f"Bearer {TENANT_KEYS[tenant]}"},
            timeout=600,
        )
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60  # the pods' counters follow their stats interval
        while time.monotonic() < deadline and (
            _metric(prefill.url, queries) < q0 + len(ids) or _metric(decode.url, queries) < dq0 + len(ids)
        ):
            time.sleep(0.2)
        return r.json()["usage"]

    d0 = _metric(decode.url, hits)
    send("alpha")
    d_alpha = _metric(decode.url, hits) - d0  # a prompt new to the decode pod: what came from the prefill pod
    h0, p0 = _metric(prefill.url, hits), _metric(topo.router_url, predicted)
    send("alpha")
    assert _metric(prefill.url, hits) - h0 >= (len(ids) - 1) // BS * BS - BS  # alpha's own blocks hit
    assert _metric(topo.router_url, predicted) > p0
    h1, p1, d1 = _metric(prefill.url, hits), _metric(topo.router_url, predicted), _metric(decode.url, hits)
    send("beta")
    assert _metric(prefill.url, hits) == h1  # no hit on alpha's blocks in the prefill pod's cache
    assert _metric(topo.router_url, predicted) == p1  # nor in the router's index
    # the decode pod counts for beta what it counted for alpha's first request (new to it), no hit on alpha's
    assert _metric(decode.url, hits) - d1 == d_alpha
    r = httpx.post(prefill.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=ROUTER_AUTH)
    assert r.status_code == 401  # a tenant's key is not the workers' key
    assert _wait_metric_zero(prefill.url, "vllm:kv_cache_usage_perc", 120) == 0
    assert _wait_metric_zero(decode.url, "vllm:kv_cache_usage_perc", 60) == 0


def test_kv_events_feed_the_router_exact_index_and_nobody_else(topo, smol):
    """`kvmesh up` wires KV events as a cluster does (workers bind, the router connects) under the run's
    secret: every worker's stream is connected and its batches counted; blocks a worker cached behind the
    router's back are predicted as a hit from its events alone; sockets without the secret on the same ports
    get no batch and no replay."""
    import zmq

    from kvmesh.common.kv_events_auth import CurveKeys
    from kvmesh.testing.pods import handshake_refused, kv_event_outsider, wait_for

    router, decode = topo.router_url, next(w for w in topo.workers if w.role == "decode")
    server_public = CurveKeys.derive(topo.kv_auth_key.encode()).server_public
    ctx = zmq.Context()
    outsiders = [
        kv_event_outsider(ctx, kind, ep, who, server_public)
        for w in topo.workers
        for kind, ep in ((zmq.SUB, w.events), (zmq.DEALER, w.replay))
        for who in ("plain", "stranger")
    ]

    def pods() -> dict[str, dict]:
        return {p["url"]: p for p in httpx.get(router + "/pods", headers=ADMIN_AUTH, timeout=30).json()["pods"]}

    def batches(url: str) -> float:
        return _metric(router, f'kvmesh:router_kv_event_batches_total{{pod="{url}"}}')

    try:
        for _, m in outsiders:
            assert handshake_refused(m)
        before = {w.url: batches(w.url) for w in topo.workers}
        text = "Lighthouses guide ships along rocky coasts at night, each with a light pattern of its own. "
        r = httpx.post(
            router + "/v1/completions",
            json={"prompt": text * 4, "max_tokens": 2, "temperature": 0},
            headers=ROUTER_AUTH,
            timeout=600,
        )
        assert r.status_code == 200, r.text
        assert wait_for(lambda: all(batches(w.url) > before[w.url] for w in topo.workers), 120, 0.5)
        seen = pods()
        for w in topo.workers:
            assert _metric(router, f'kvmesh:router_kv_events_connected{{pod="{w.url}"}}') == 1, w.role
            ev = seen[w.url]["events"]
            assert ev["connected"] and ev["batches"] > 0 and ev["handshake_failures"] == 0, (w.role, ev)
            assert seen[w.url]["exact"] and seen[w.url]["indexed_blocks"] > 0, (w.role, seen[w.url])
        # A prompt the router never routed, sent straight to the decode pod: only its events tell the router.
        ids = smol.tokenizer("Glaciers carve valleys slowly over many thousands of years. " * 12).input_ids[:100]
        held = seen[decode.url]["indexed_blocks"]
        # salted as the router salts tenant alpha's requests, so its blocks hash like alpha's
        body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "cache_salt": "alpha"}
        r = _worker_post(topo, decode.url + "/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        expected = ((len(ids) - 1) // BS) * BS  # the engine never counts the last prompt token as cached
        assert wait_for(lambda: pods()[decode.url]["indexed_blocks"] >= held + expected // BS, 120, 0.5)
        hit0 = _metric(router, "kvmesh:router_predicted_hit_tokens_total")
        r = httpx.post(
            router + "/v1/completions",
            json={"prompt": ids, "max_tokens": 2, "temperature": 0},
            headers=ROUTER_AUTH,
            timeout=600,
        )
        assert r.status_code == 200, r.text
        assert _metric(router, "kvmesh:router_predicted_hit_tokens_total") - hit0 == expected
        for s, _ in outsiders:  # all those batches (and the replay asked for) never reached them
            assert s.poll(0) == 0
    finally:
        for s, m in outsiders:
            s.disable_monitor()
            m.close(linger=0)
            s.close(linger=0)
        ctx.term()


def _listening(session_ids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets listening in any process of the given sessions (from /proc)."""
    import os

    inodes: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                sid = int(f.read().rsplit(")", 1)[1].split()[3])
            if sid not in session_ids:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    out.append(cols[1])
    return out


def _is_loopback(hex_addr: str) -> bool:
    ip = hex_addr.split(":")[0]
    if len(ip) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return ip.endswith("7F")
    return ip == "00000000000000000000000001000000" or (ip[:24] == "0000000000000000FFFF0000" and ip.endswith("7F"))


def test_every_worker_listens_on_loopback_only(topo):
    """security_probe row 5: in the local topology NIXL's UCX listened on the machine's other interfaces."""
    sessions = {p.pid for name, p in topo.procs if name != "redis"}  # each child leads its own session
    addrs = _listening(sessions)
    assert len(addrs) >= 3, addrs  # router, prefill and decode HTTP at least
    assert all(_is_loopback(a) for a in addrs), addrs


def test_unauthenticated_side_channel_message_is_refused_and_counted(topo):
    """NIXL: the prefill's side channel answers a message without the run's secret with an error and
    nothing else, and its /metrics count the refusal (kvmesh:kv_transfer_refused_total{reason="auth"})."""
    if topo.config.kv_connector != "nixl":
        return  # Redis has no side channel (its AUTH is test_connectors_redis.py's)

    import msgspec
    import zmq

    prefill = next(w for w in topo.workers if w.role == "prefill")
    first = _worker_post(  # a prompt under one block: the answer names the port, no block is held
        topo,
        prefill.url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=600,
    )
    port = first.json()["kv_transfer_params"]["remote_port"]  # the side channel advertises the port it bound
    name = "kvmesh:kv_transfer_refused_total"
    before = _metric(prefill.url, name)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(msgspec.msgpack.encode({"op": "meta"}))  # the probe's request, without a MAC
        assert sock.poll(30_000)
        reply = msgspec.msgpack.decode(sock.recv())
    finally:
        sock.close(0)
        ctx.term()
    assert reply["ok"] is False and "meta" not in reply
    deadline = time.monotonic() + 30
    while _metric(prefill.url, name) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _metric(prefill.url, name) == before + 1
    import os

    assert topo.config.log_dir is not None
    with open(os.path.join(topo.config.log_dir, "prefill-0.log"), errors="replace") as f:
        assert "NIXL side channel: refused a message: unsigned message" in f.read()  # and logged


def test_private_redis_requires_the_run_password(topo):
    """Redis: `kvmesh up`'s own redis-server refuses a client without this run's password (the workers,
    which hold it in $KVMESH_REDIS_PASSWORD, are the ones that served the tests above)."""
    if topo.config.kv_connector != "redis":
        return  # NIXL runs no Redis (its side channel's secret is the test above's)
    import redis

    anonymous = redis.Redis.from_url(topo.redis_url, socket_timeout=10)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    with redis.Redis.from_url(topo.redis_url, password=topo.redis_password, socket_timeout=10) as client:
        assert client.ping() and client.dbsize() > 0  # the prefill pod stored blocks with the password


def test_structured_outputs_and_tools_through_pd(topo):
    """`parse()` through the router's P/D path (the prefill pod's token obeys the grammar, the decode
    pod's grammar starts from the prompt) returns what the decode pod answers alone, greedy, streamed
    and not; a required tool call too. The router passes response_format, tools and tool_choice on."""
    from openai import OpenAI
    from structured_schemas import MAX_TOKENS, SCHEMAS

    decode = next(w for w in topo.workers if w.role == "decode")
    via_pd = OpenAI(base_url=topo.router_url + "/v1", api_key=TENANT_KEYS["alpha"], max_retries=0, timeout=600)
    alone = OpenAI(base_url=decode.url + "/v1", api_key=topo.upstream_key, max_retries=0, timeout=600)
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
