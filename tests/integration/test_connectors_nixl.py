"""NIXL connector between two engine processes: real agents, a real READ, exact tokens, no leaks.

One prefill and one decode engine, each in its own spawned process with its own
NIXL agent and KV pool. The prefill answers ``max_tokens=1`` requests with
``do_remote_decode``; the decode receives the returned ``kv_transfer_params``,
pulls the blocks and continues. Its answer must equal a single engine's on the
same weights, and its computed-token counter must show that the pulled tokens
were not recomputed. Failure cases must still answer exactly, by recomputing.
Every side-channel message is MAC'd with the shared secret ``KEY``: messages without a valid MAC,
replayed or over-reaching ones are refused and counted, and a side channel the params name that
is not the prefill (the probe's fake one) makes the decode read nothing and cache nothing foreign.
The prefill-kill test is last because it consumes the prefill process.
"""

from __future__ import annotations

import math
import secrets
import threading
import time

import msgspec
import pytest
import zmq
from connector_procs import EngineProc

from kvmesh.common.hashing import block_hashes_for
from kvmesh.engine.connectors.nixl_side_channel import REPLY, REQUEST, Signer, request, seal_request

pytestmark = pytest.mark.integration

KEY = "test-kv-auth-key-" + secrets.token_hex(8)

BS = 16
MAX_NEW = 8
TEXT = (
    "Photosynthesis converts light energy into chemical energy. Plants, algae and some bacteria capture "
    "sunlight with chlorophyll, split water, release oxygen and fix carbon dioxide into sugars that feed "
    "nearly every food chain on Earth. "
)


def test_registry_and_param_checks():
    from kvmesh.engine.connectors import check_kv_transfer_params, make_connector
    from kvmesh.engine.connectors.base import KVConnector

    assert type(make_connector("none")) is KVConnector and type(make_connector(None)) is KVConnector
    with pytest.raises(ValueError, match="unknown KV connector"):
        make_connector("lmcache")
    ok = {
        "do_remote_prefill": True,
        "remote_engine_id": "p",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_request_id": "r",
        "remote_transfer_id": "t",
        "remote_block_ids": [3, 4],
        "remote_block_size": 16,
    }
    assert check_kv_transfer_params(ok) is None
    assert check_kv_transfer_params({"do_remote_decode": True}) is None
    assert check_kv_transfer_params(dict(ok, remote_block_ids=[])) is None  # nothing to pull is fine
    bad = [
        "not a dict",
        {"do_remote_decode": "yes"},
        dict(ok, do_remote_decode=True),
        dict(ok, remote_block_ids="3,4"),
        dict(ok, remote_block_ids=[3, -1]),
        dict(ok, remote_block_ids=[3, 3]),
        dict(ok, remote_block_ids=[True]),
        dict(ok, remote_port=0),
        dict(ok, remote_port="5600"),
        dict(ok, remote_host=""),
        dict(ok, remote_engine_id=None),
        dict(ok, remote_block_size=0),
        dict(ok, remote_block_hash="xyz"),
    ]
    for p in bad:
        assert check_kv_transfer_params(p) is not None, p


# The prefill's lease is far longer than any test (a loaded CI machine can take minutes per test);
# the lease test shortens it explicitly.
@pytest.fixture(scope="module")
def procs():
    made: list[EngineProc] = []
    try:
        prefill = EngineProc(
            {
                "role": "prefill",
                "connector": "nixl",
                "engine_id": "prefill-0",
                "connector_opts": {"lease_s": 600.0, "auth_key": KEY},
            }
        )
        made.append(prefill)
        decode = EngineProc(
            {
                "role": "decode",
                "connector": "nixl",
                "engine_id": "decode-0",
                "connector_opts": {"handshake_timeout_s": 5.0, "transfer_timeout_s": 60.0, "auth_key": KEY},
            }
        )
        made.append(decode)
        yield prefill, decode
    finally:
        for p in made:
            p.close()
        for p in made:  # no leaked processes
            assert not p.proc.is_alive()


@pytest.fixture(scope="module")
def prompts(procs):
    _, decode = procs
    ids = decode.call("tokenize", TEXT * 12)
    assert len(ids) > 475
    # Disjoint slices, one per use: no prompt is a prefix of another, and no test finds a block
    # that an earlier test left in the decode engine's prefix cache.
    return {
        "long": ids[:45],  # 2 full blocks + 13
        "exact": ids[50:98],  # exactly 3 blocks: the last one is recomputed for its logits
        "short": ids[100:110],  # less than a block: nothing to pull
        "extra": ids[120:170],
        "lease": ids[180:225],
        "bad": ids[230:275],
        "killed": ids[280:328],
        "auth": ids[330:375],
        "victim": ids[380:425],
        "attacker": ids[430:475],
    }


@pytest.fixture(scope="module")
def reference(procs, prompts):
    _, decode = procs
    return {k: decode.call("ref", f"ref-{k}", p, MAX_NEW)["tokens"] for k, p in prompts.items()}


def _loadable(n: int, n_remote_blocks: int) -> int:
    return min(n_remote_blocks, (n - 1) // BS) * BS


def _assert_drained(proc: EngineProc) -> dict:
    s = proc.call("drain", 30.0)
    assert s["free"] == s["total"], f"blocks leaked: {s}"
    assert s["held"] == 0 and s["delayed_free"] == 0, s
    return s


@pytest.mark.parametrize("kind", ["long", "exact", "short"])
def test_pd_transfer_matches_single_engine(procs, prompts, reference, kind):
    prefill, decode = procs
    p = prompts[kind]
    sent_before = prefill.call("stats")["connector"]
    first = prefill.call("gen", f"pd-{kind}", p, 1, {"do_remote_decode": True})
    assert first["tokens"] == reference[kind][:1]
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prefill-0"
    assert len(params["remote_block_ids"]) == len(p) // BS  # full blocks only
    held = prefill.call("stats")
    if params["remote_block_ids"]:
        assert held["held"] == 1 and held["free"] < held["total"]  # kept for the reader
    out = decode.call("gen", f"pd-{kind}", p, MAX_NEW, params)
    assert out["tokens"] == reference[kind]
    loaded = _loadable(len(p), len(params["remote_block_ids"]))
    assert out["computed"] == len(p) - loaded + MAX_NEW - 1  # pulled tokens were not recomputed
    d = decode.call("stats")
    assert d["free"] == d["total"]
    s = _assert_drained(prefill)
    if params["remote_block_ids"]:
        assert s["connector"]["sends_done"] == sent_before["sends_done"] + 1  # freed by the reader's notification


def test_local_prefix_hit_pulls_only_the_rest(procs, prompts, reference):
    prefill, decode = procs
    p = prompts["extra"]  # 50 tokens: 3 full blocks
    decode.call("gen", "warm", p[: BS + 3], 1)  # decode now holds block 0 in its prefix cache
    before = decode.call("stats")["connector"]["blocks_loaded"]
    first = prefill.call("gen", "hit-part", p, 1, {"do_remote_decode": True})
    out = decode.call("gen", "hit-part", p, MAX_NEW, first["kv_transfer_params"])
    assert out["tokens"] == reference["extra"]
    assert decode.call("stats")["connector"]["blocks_loaded"] == before + 2
    assert out["computed"] == len(p) - 3 * BS + MAX_NEW - 1
    _assert_drained(prefill)

    # Everything pullable is already local: nothing is read, and the prefill is told to release at once.
    released = prefill.call("stats")["connector"]["sends_released"]
    first = prefill.call("gen", "hit-full", p, 1, {"do_remote_decode": True})
    out = decode.call("gen", "hit-full", p, MAX_NEW, first["kv_transfer_params"])
    assert out["tokens"] == reference["extra"]
    assert decode.call("stats")["connector"]["blocks_loaded"] == before + 2
    s = _assert_drained(prefill)
    assert s["connector"]["sends_released"] == released + 1
    assert s["connector"]["leases_expired"] == 0


def test_lease_expiry_frees_unread_blocks(procs, prompts, reference):
    prefill, decode = procs
    expired = prefill.call("stats")["connector"]["leases_expired"]  # before: the lease may end any moment
    prefill.call("set", "lease_s", 1.0)
    try:
        first = prefill.call("gen", "lease", prompts["lease"], 1, {"do_remote_decode": True})
    finally:
        prefill.call("set", "lease_s", 600.0)
    assert first["kv_transfer_params"]["remote_block_ids"]
    s = _assert_drained(prefill)  # no reader comes: the lease, not a notification, frees the blocks
    assert s["connector"]["leases_expired"] == expired + 1
    # A reader arriving after expiry is refused and computes locally, still exactly.
    failed = decode.call("stats")["connector"]["loads_failed"]
    out = decode.call("gen", "lease", prompts["lease"], MAX_NEW, first["kv_transfer_params"])
    assert out["tokens"] == reference["lease"]
    assert out["computed"] == len(prompts["lease"]) + MAX_NEW - 1
    d = decode.call("stats")
    assert d["connector"]["loads_failed"] == failed + 1 and d["free"] == d["total"]


def test_bad_params_recompute_exactly(procs, prompts, reference):
    """Params that pass admission but cannot be pulled (expired transfer, other blocks or prompt): recompute."""
    prefill, decode = procs
    p = prompts["bad"]
    first = prefill.call("gen", "bad", p, 1, {"do_remote_decode": True})
    good = first["kv_transfer_params"]
    cases = {
        "unknown transfer": dict(good, remote_transfer_id="0" * 32),
        "block ids not held": dict(good, remote_block_ids=[g + 1 for g in good["remote_block_ids"]]),
        "another prompt": dict(good, remote_block_hash="ab" * 32),
        "no block hash": {k: v for k, v in good.items() if k != "remote_block_hash"},
    }
    for i, (what, params) in enumerate(cases.items()):
        assert decode.call("reset_cache")  # each case starts cold (and nothing is in use)
        out = decode.call("gen", f"bad-{i}", p, MAX_NEW, params)
        assert out["tokens"] == reference["bad"], what
        assert out["computed"] == len(p) + MAX_NEW - 1, what
    d = decode.call("stats")
    assert d["free"] == d["total"]
    # The genuine transfer is still held (nothing above freed it) and still works.
    assert prefill.call("stats")["held"] == 1
    assert decode.call("reset_cache")
    out = decode.call("gen", "bad-good", p, MAX_NEW, good)
    assert out["tokens"] == reference["bad"]
    assert out["computed"] == len(p) - 2 * BS + MAX_NEW - 1
    _assert_drained(prefill)


def test_invalid_params_are_rejected_before_admission(procs, prompts, reference):
    """Wrong types, an engine that does not answer or is another engine, block ids beyond the remote pool:
    ``add_request`` raises ValueError (the API answers 400) and nothing is allocated or left behind."""
    prefill, decode = procs
    p = prompts["bad"]
    first = prefill.call("gen", "rej", p, 1, {"do_remote_decode": True})
    good = first["kv_transfer_params"]
    n_remote = prefill.call("stats")["total"]
    cases = {
        "wrong types": (dict(good, remote_block_ids="0,1"), "remote_block_ids must be a list of integers"),
        "unreachable side channel": (dict(good, remote_port=1), "did not answer the side-channel handshake"),
        "another engine's side channel": (dict(good, remote_engine_id="prefill-9"), "belongs to engine 'prefill-0'"),
        "block ids out of range": (dict(good, remote_block_ids=[0, n_remote]), "remote_block_ids out of range"),
        "other block size": (dict(good, remote_block_size=BS * 2), "remote_block_size"),
    }
    before = decode.call("stats")
    for i, (what, (params, fragment)) in enumerate(cases.items()):
        with pytest.raises(RuntimeError, match="ValueError") as ei:
            decode.call("gen", f"rej-{i}", p, MAX_NEW, params)
        assert fragment in str(ei.value), (what, str(ei.value))
        d = decode.call("stats")
        assert d["free"] == d["total"] and not d["unfinished"] and d["delayed_free"] == 0, (what, d)
    d = decode.call("stats")
    assert d["connector"]["loads_started"] == before["connector"]["loads_started"]  # nothing was pulled
    assert d["connector"]["params_rejected"] == before["connector"]["params_rejected"] + len(cases)
    # The genuine params still work afterwards, and pulling frees the prefill's held blocks.
    assert decode.call("reset_cache")
    out = decode.call("gen", "rej-good", p, MAX_NEW, good)
    assert out["tokens"] == reference["bad"]
    assert out["computed"] == len(p) - 2 * BS + MAX_NEW - 1
    _assert_drained(prefill)
    _assert_drained(decode)


def _raw(ctx: zmq.Context, port: int, frame: bytes):
    """One REQ round trip with the prefill's side channel, the reply decoded but not opened."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(frame)
        assert sock.poll(30_000), "the side channel did not answer"
        return sock.recv()
    finally:
        sock.close(0)


def test_side_channel_refuses_what_is_not_authentic(procs, prompts):
    """No MAC, a wrong MAC or key, a replayed or stale message: refused with an unsigned error, counted.
    Authentic claims that over-reach (blocks not held, a guessed transfer, timeout_s=inf or < 0) are
    refused and counted too; an unauthenticated release frees nothing; an authentic one frees it all."""
    prefill, _ = procs
    port = prefill.info["port"]
    first = prefill.call("gen", "auth", prompts["auth"], 1, {"do_remote_decode": True})
    good = first["kv_transfer_params"]
    xid, ids = good["remote_transfer_id"], good["remote_block_ids"]
    assert len(xid) == 32 and len(ids) == 2
    before = prefill.call("stats")["connector"]
    signer = Signer(KEY.encode())
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    ctx = zmq.Context()
    try:
        # An authentic meta request works, and its reply is sealed and bound to it.
        frame, nonce = seal_request(signer, {"op": "meta"})
        reply = signer.open(REPLY, _raw(ctx, port, frame))
        assert reply["ok"] and reply["re"] == nonce and reply["meta"]["engine_id"] == "prefill-0"

        payload, mac = dec.decode(seal_request(signer, {"op": "meta"})[0])
        refused = {
            "no MAC (the old protocol)": enc.encode({"op": "meta"}),
            "another key": seal_request(Signer(b"not-the-deployment-key"), {"op": "meta"})[0],
            "flipped MAC": enc.encode([payload, bytes([mac[0] ^ 1]) + mac[1:]]),
            "MAC of a request used on a reply direction": signer.seal(REPLY, dec.decode(payload)),
            "replayed": frame,
            "stale": signer.seal(REQUEST, {"op": "meta", "ts": time.time() - 3600, "nonce": secrets.token_hex(16)}),
            "release without MAC": enc.encode({"op": "release", "transfer_id": xid}),
            "not msgpack": b"\xc1garbage",
        }
        for what, f in refused.items():
            out = dec.decode(_raw(ctx, port, f))
            assert isinstance(out, dict) and out["ok"] is False and "meta" not in out, what
        s = prefill.call("stats")
        assert s["connector"]["auth_rejected"] == before["auth_rejected"] + len(refused)
        assert s["held"] == 1  # the unauthenticated release freed nothing

        def claim(**kw) -> dict:
            msg = {"op": "claim", "transfer_id": xid, "block_ids": ids, "timeout_s": 5.0, **kw}
            return request(ctx, "127.0.0.1", port, msg, 30.0, signer)

        over = [
            claim(block_ids=ids[:1]),  # a subset is not the blocks held for it
            claim(block_ids=[*ids, ids[-1] + 1]),
            claim(block_ids=[0, 1, 2, 3]),
            claim(transfer_id=secrets.token_hex(16)),  # a guessed transfer
            claim(timeout_s=math.inf),
            claim(timeout_s=-1.0),
            claim(timeout_s=math.nan),
            claim(timeout_s=True),
        ]
        assert all(r["ok"] is False for r in over), over
        s = prefill.call("stats")
        assert s["connector"]["claims_refused"] == before["claims_refused"] + len(over)
        assert s["connector"]["auth_rejected"] == before["auth_rejected"] + len(refused)  # these were authentic
        assert s["held"] == 1

        ok = claim()  # the exact blocks: the reply carries their chained hashes
        assert ok["ok"] and ok["block_hashes"] == [h.hex() for h in _hashes(ok["meta"], prompts["auth"])[:2]]
        assert request(ctx, "127.0.0.1", port, {"op": "release", "transfer_id": xid}, 30.0, signer)["ok"]
        _assert_drained(prefill)

        # A huge finite timeout_s extends the lease to at most twice the lease: the blocks are freed anyway.
        prefill.call("set", "lease_s", 5.0)
        try:
            held = prefill.call("gen", "auth-2", prompts["auth"], 1, {"do_remote_decode": True})
        finally:
            prefill.call("set", "lease_s", 600.0)
        p2 = held["kv_transfer_params"]
        expired = prefill.call("stats")["connector"]["leases_expired"]
        r = claim(transfer_id=p2["remote_transfer_id"], block_ids=p2["remote_block_ids"], timeout_s=1e9)
        assert r["ok"]
        s = _assert_drained(prefill)
        assert s["connector"]["leases_expired"] == expired + 1
    finally:
        ctx.term()


def _hashes(meta: dict, tokens: list[int]) -> list[bytes]:
    return block_hashes_for(tokens, BS, meta["model_identity"])


class FakeSideChannel:
    """The probe's fake side channel: a real ROUTER socket on loopback that either relays every frame to
    the real prefill (valid MACs, the victim's blocks) or answers with the real prefill's meta, unsigned."""

    def __init__(self, prefill_port: int, meta: dict, attacker_hashes: list[str], relay: bool) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.prefill_port, self.relay = prefill_port, relay
        self.forged = msgspec.msgpack.encode({"ok": True, "meta": meta, "block_hashes": attacker_hashes})
        self.seen = 0
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop_event.is_set():
            if not self.sock.poll(50):
                continue
            ident, _, frame = self.sock.recv_multipart()
            self.seen += 1
            out = _raw(self.ctx, self.prefill_port, frame) if self.relay else self.forged
            self.sock.send_multipart([ident, b"", out])

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(10)
        self.sock.close(0)
        self.ctx.term()


def test_fake_side_channel_reads_nothing_and_poisons_nothing(procs, prompts, reference):
    """security_probe 4b+: params naming a fake side channel with the victim's transfer and blocks, and the
    attacker prompt's own last-block hash (so they pass the early check). Forged replies are refused at
    admission; relayed authentic ones reach the claim, whose block hashes are the victim's: nothing is
    read, the attacker gets the honest tokens, and the decode's prefix cache holds only honest blocks."""
    prefill, decode = procs
    victim, attacker = prompts["victim"], prompts["attacker"]
    v = prefill.call("gen", "victim", victim, 1, {"do_remote_decode": True})["kv_transfer_params"]
    ctx = zmq.Context()
    try:
        meta = request(ctx, "127.0.0.1", v["remote_port"], {"op": "meta"}, 30.0, Signer(KEY.encode()))["meta"]
    finally:
        ctx.term()
    mine = [h.hex() for h in _hashes(meta, attacker)[:2]]
    assert mine[1] != v["remote_block_hash"]
    before = decode.call("stats")["connector"]
    for relay in (False, True):
        fake = FakeSideChannel(v["remote_port"], meta, mine, relay)
        try:
            params = dict(v, remote_port=fake.port, remote_block_hash=mine[1])
            assert decode.call("reset_cache")
            if not relay:  # an unsigned answer is no answer: refused before anything is allocated
                with pytest.raises(RuntimeError, match="unsigned message"):
                    decode.call("gen", "steal-forged", attacker, MAX_NEW, params)
            else:
                out = decode.call("gen", "steal-relayed", attacker, MAX_NEW, params)
                assert out["tokens"] == reference["attacker"]
                assert out["computed"] == len(attacker) + MAX_NEW - 1  # recomputed: nothing was read
            assert fake.seen >= 1  # the decode did talk to it
        finally:
            fake.close()
    d = decode.call("stats")
    assert d["connector"]["blocks_loaded"] == before["blocks_loaded"]
    assert d["connector"]["hash_mismatches"] == before["hash_mismatches"] + 1
    assert d["connector"]["auth_rejected"] >= before["auth_rejected"] + 1
    assert d["free"] == d["total"]
    # A plain request with the attacker's prompt: its prefix-cache hit holds the honest blocks.
    again = decode.call("gen", "plain-after", attacker, MAX_NEW)
    assert again["tokens"] == reference["attacker"]
    assert again["num_cached_tokens"] == 2 * BS and again["computed"] == len(attacker) - 2 * BS + MAX_NEW - 1
    # The victim's own transfer is untouched and still works.
    out = decode.call("gen", "victim", victim, MAX_NEW, v)
    assert out["tokens"] == reference["victim"]
    assert out["computed"] == len(victim) - 2 * BS + MAX_NEW - 1
    _assert_drained(prefill)
    _assert_drained(decode)


@pytest.fixture(scope="module")
def fp8_procs():
    """A prefill and a decode engine with an FP8 KV cache (``kv_cache_dtype="fp8"``)."""
    made: list[EngineProc] = []
    try:
        for role in ("prefill", "decode"):
            opts = {"auth_key": KEY, "lease_s": 600.0} if role == "prefill" else {"auth_key": KEY}
            spec = {"role": role, "connector": "nixl", "engine_id": f"{role}-fp8", "kv_cache_dtype": "fp8"}
            made.append(EngineProc({**spec, "connector_opts": opts}))
        yield made[0], made[1]
    finally:
        for p in made:
            p.close()
        for p in made:
            assert not p.proc.is_alive()


def test_fp8_blocks_move_between_fp8_engines_and_are_refused_from_another_dtype(procs, fp8_procs, prompts):
    """fp8 prefill -> fp8 decode: the FP8 blocks are pulled, not recomputed, and the tokens are a
    single fp8 engine's. float32 prefill -> fp8 decode: admitted, the blocks refused (counted as
    kv_layout), released to the prefill at once, and the prompt recomputed to the same tokens."""
    prefill, _ = procs
    p8, d8 = fp8_procs
    ref = {k: d8.call("ref", f"ref8-{k}", prompts[k], MAX_NEW)["tokens"] for k in ("long", "exact")}
    p = prompts["long"]
    first = p8.call("gen", "fp8-long", p, 1, {"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["remote_kv_layout"].startswith("float8_e4m3fn|")  # the dtype travels with the params
    out = d8.call("gen", "fp8-long", p, MAX_NEW, params)
    assert out["tokens"] == ref["long"]
    loaded = _loadable(len(p), len(params["remote_block_ids"]))
    assert loaded == 2 * BS and out["computed"] == len(p) - loaded + MAX_NEW - 1
    _assert_drained(p8)

    q = prompts["exact"]
    before = prefill.call("stats")["connector"]
    first = prefill.call("gen", "fp8-refused", q, 1, {"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["remote_kv_layout"].startswith("float32|") and params["remote_block_ids"]
    assert d8.call("validate", params) is None  # another dtype is no reason to fail the request
    out = d8.call("gen", "fp8-refused", q, MAX_NEW, params)
    assert out["tokens"] == ref["exact"] and out["finish_reason"] == "length"
    assert out["computed"] == len(q) + MAX_NEW - 1  # recomputed: nothing read
    c = d8.call("stats")["connector"]
    assert c["kv_layout_refused"] == 1 and c["blocks_loaded"] == 2 and c["loads_failed"] == 0
    s = _assert_drained(prefill)  # the refused transfer's blocks went back to the prefill
    assert s["connector"]["sends_released"] == before["sends_released"] + 1
    assert s["connector"]["leases_expired"] == before["leases_expired"]  # released, not left to the lease
    _assert_drained(d8)


def test_prefill_killed_before_pull_recomputes(procs, prompts, reference):
    prefill, decode = procs
    first = prefill.call("gen", "killed", prompts["killed"], 1, {"do_remote_decode": True})
    # The decode knows this prefill (an earlier handshake is cached), as it would in a running
    # deployment; a side channel it never reached would be rejected at admission instead.
    assert decode.call("validate", first["kv_transfer_params"]) is None
    prefill.kill()
    assert not prefill.proc.is_alive()
    out = decode.call("gen", "killed", prompts["killed"], MAX_NEW, first["kv_transfer_params"])
    assert out["tokens"] == reference["killed"]
    assert out["computed"] == len(prompts["killed"]) + MAX_NEW - 1
    d = decode.call("stats")
    assert d["free"] == d["total"] and d["unfinished"] is False
