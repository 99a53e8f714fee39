"""The local disaggregated topology (`kvmesh up`): router -> prefill -> decode, both connectors.

Every process is real (redis-server, two engine servers with their engine
processes, the router) on loopback. Greedy outputs must equal the offline
engine's; the decode pod must report the transferred tokens as not computed by
it; the prefill pod must end with every block free.
"""

from __future__ import annotations

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
    import json

    import msgspec
    import zmq

    prefill = next(w for w in topo.workers if w.role == "prefill")
    argv = next(p.args for name, p in topo.procs if name == "prefill-0")
    port = json.loads(argv[argv.index("--kv-connector-config") + 1])["side_channel_port"]
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
