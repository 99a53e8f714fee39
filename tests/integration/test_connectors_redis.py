"""Redis connector against a real redis-server: exact tokens, real loads, failures fall back to recompute.

Engines here share one process (they share nothing but the loaded weights and the
Redis server, exactly like two pods sharing a store). "Loaded, not recomputed" is
proved by the engine's own counter of tokens run through the model.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

import pytest
import torch
from connector_procs import run_request

from kvmesh.common.env import env
from kvmesh.engine.args import EngineArgs
from kvmesh.engine.connectors import make_connector
from kvmesh.engine.connectors.redis_connector import BlockFormatError, decode_block, encode_block
from kvmesh.engine.core.engine_core import EngineCore
from kvmesh.health import NotReadyError, exited, wait_until
from kvmesh.topology import free_port as _free_port

pytestmark = pytest.mark.integration

BS = 16
MAX_NEW = 8
TEXT = (
    "The history of computing spans centuries, from mechanical calculators and punched cards to "
    "vacuum tubes, transistors and integrated circuits. Each step made machines smaller, faster and "
    "cheaper, and each opened new uses that their inventors had not imagined. "
)


class RedisServer:
    """A throwaway redis-server: random port, no persistence, killed at teardown."""

    def __init__(self, password: str | None = None, tls: dict[str, str] | None = None) -> None:
        """``tls``: ``{"cert", "key", "ca"}`` file paths: the server speaks TLS only (no plain port)."""
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (scripts/install.sh installs it)")
        self.port = _free_port()
        self.tls = tls
        ports = ["--port", str(self.port)]
        if tls:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", tls["cert"]]
            ports += ["--tls-key-file", tls["key"], "--tls-ca-cert-file", tls["ca"], "--tls-auth-clients", "no"]
        self.proc = subprocess.Popen(
            [
                exe,
                *ports,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                *(["--requirepass", password] if password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        ssl = {"ssl": True, "ssl_ca_certs": tls["ca"]} if tls else {}
        self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, password=password, **ssl)

        def answers() -> bool:
            try:
                return bool(self.client.ping())
            except Exception:
                return False

        try:
            wait_until(answers, 20, "redis-server", exited(self.proc), poll=0.05)
        except NotReadyError as e:
            self.stop()
            raise RuntimeError(f"redis-server did not start: {e}") from None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.client.close()


@pytest.fixture(scope="module")
def one_thread():
    """Engines in this process use one OpenMP thread (2 shared cores); restored afterwards."""
    before_env, before_n = os.environ.get("KVMESH_CPU_THREADS"), torch.get_num_threads()
    os.environ["KVMESH_CPU_THREADS"] = "1"
    yield
    torch.set_num_threads(before_n)
    if before_env is None:
        os.environ.pop("KVMESH_CPU_THREADS", None)
    else:
        os.environ["KVMESH_CPU_THREADS"] = before_env


@pytest.fixture
def redis_server():
    srv = RedisServer()
    yield srv
    srv.stop()
    assert srv.proc.poll() is not None  # no leaked server


@pytest.fixture(scope="module")
def prompts(smol):
    ids = smol.tokenizer(TEXT * 4).input_ids
    assert len(ids) > 140
    return {  # disjoint slices, so no prompt is a prefix of another
        "long": ids[:53],  # 3 full blocks + 5 tokens
        "exact": ids[60:108],  # exactly 3 blocks: the last block is recomputed for its logits
        "short": ids[120:131],  # less than one block: nothing to store or load
    }


@pytest.fixture(scope="module")
def reference(smol, one_thread, prompts):
    eng, _ = EngineCore.from_model(EngineArgs(num_kv_blocks=32), loaded=smol)
    return {k: run_request(eng, f"ref-{k}", p, MAX_NEW)["tokens"] for k, p in prompts.items()}


def _engine(smol, url, role="both", loaded=None, kv_cache_dtype=None, speculative_config=None, **opts):
    conn = make_connector("redis", None, url=url, ttl_s=600, **opts)
    args = EngineArgs(num_kv_blocks=32, role=role, kv_cache_dtype=kv_cache_dtype, speculative_config=speculative_config)
    eng, _ = EngineCore.from_model(args, connector=conn, loaded=loaded or smol)
    return eng


def _assert_no_leak(*engines):
    for e in engines:
        e.check_integrity()
        s = e.stats()
        assert s.num_free_blocks == s.num_total_blocks, "blocks leaked"
        assert not e.has_unfinished() and not e.has_pending_transfers()


def _loadable(n_tokens: int) -> int:
    return min(n_tokens // BS, (n_tokens - 1) // BS) * BS


def test_block_format_rejects_every_kind_of_damage():
    sig, h = b"float32|2x2x16x1x4", bytes(range(32))
    payload = os.urandom(2 * 2 * 16 * 4 * 4)
    v = encode_block(sig, h, payload)
    assert bytes(decode_block(v, sig, h, len(payload))) == payload
    flipped = bytearray(v)
    flipped[-7] ^= 0x01
    bad = {
        "payload bit flip": bytes(flipped),
        "truncated": v[:-1],
        "empty": b"",
        "foreign": b"not a block at all",
    }
    for val in bad.values():
        with pytest.raises(BlockFormatError):
            decode_block(val, sig, h, len(payload))
    with pytest.raises(BlockFormatError):
        decode_block(v, b"bfloat16|2x2x16x1x4", h, len(payload))  # another layout
    with pytest.raises(BlockFormatError):
        decode_block(v, sig, bytes(32), len(payload))  # stored under another hash


def test_prefill_saves_decode_loads_exact_tokens(smol, one_thread, redis_server, prompts, reference):
    prefill = _engine(smol, redis_server.url, role="prefill")
    decode = _engine(smol, redis_server.url, role="decode")
    for k, p in prompts.items():
        first = run_request(prefill, f"p-{k}", p, 1, {"do_remote_decode": True})
        assert first["tokens"] == reference[k][:1]
    # Content addressing: one key per full prompt block, under this model's namespace only.
    keys = redis_server.client.keys("kvmesh:*")
    assert len(keys) == sum(len(p) // BS for p in prompts.values())
    assert all(k.decode().startswith(prefill.connector.prefix) for k in keys)
    ttl = redis_server.client.ttl(keys[0])
    assert 0 < ttl <= 600

    for k, p in prompts.items():
        out = run_request(decode, f"d-{k}", p, MAX_NEW)
        assert out["tokens"] == reference[k], k
        # Only the tokens not loaded ran through the model: prompt tail + all but the last new token.
        assert out["computed"] == len(p) - _loadable(len(p)) + MAX_NEW - 1, k
    st = decode.connector.stats
    assert st["blocks_loaded"] == sum(_loadable(len(p)) // BS for p in prompts.values())
    assert st["loads_failed"] == 0 and st["blocks_saved"] == 0  # decode role does not write by default
    _assert_no_leak(prefill, decode)
    prefill.shutdown()
    decode.shutdown()


def test_decode_pod_speculates(smol, one_thread, redis_server, prompts, reference):
    """P/D with speculative decoding on the decode pod (engine/spec/): n-gram lookup, and SmolLM2 as
    its own draft, whose KV the decode pod builds itself (only the model's KV travels). The prompt's
    blocks are loaded, the tokens are those without speculation, nothing leaks."""
    import json

    prefill = _engine(smol, redis_server.url, role="prefill")
    for k, p in prompts.items():
        run_request(prefill, f"p-{k}", p, 1, {"do_remote_decode": True})
    specs = [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        {"method": "draft_model", "model": "embedded", "num_speculative_tokens": 2},
    ]
    for i, spec in enumerate(specs):
        decode = _engine(smol, redis_server.url, role="decode", speculative_config=json.dumps(spec))
        for k, p in prompts.items():
            assert run_request(decode, f"d{i}-{k}", p, MAX_NEW)["tokens"] == reference[k], (spec["method"], k)
        assert decode.connector.stats["blocks_loaded"] == sum(_loadable(len(p)) // BS for p in prompts.values())
        assert decode.speculator is not None and decode.speculator.num_accepted_tokens > 0
        _assert_no_leak(decode)
        decode.shutdown()
    _assert_no_leak(prefill)
    prefill.shutdown()


def test_shared_prefix_across_instances_and_isolation(smol, one_thread, redis_server, prompts, reference):
    a = _engine(smol, redis_server.url)
    run_request(a, "a-long", prompts["long"], MAX_NEW)
    # Another instance with a prompt sharing the first 2 blocks, then diverging: loads exactly those 2.
    b = _engine(smol, redis_server.url)
    branch = prompts["long"][: 2 * BS] + prompts["short"] + prompts["long"][:9]
    ref_b, _ = EngineCore.from_model(EngineArgs(num_kv_blocks=32), loaded=smol)
    want = run_request(ref_b, "ref-branch", branch, MAX_NEW)["tokens"]
    out = run_request(b, "b-branch", branch, MAX_NEW)
    assert out["tokens"] == want
    assert b.connector.stats["blocks_loaded"] == 2
    assert out["computed"] == len(branch) - 2 * BS + MAX_NEW - 1

    # A tenant salt changes every block hash: no hit across tenants, hits within one.
    run_request(a, "a-salted", prompts["long"], MAX_NEW, None, "tenant-a")
    c = _engine(smol, redis_server.url)
    out = run_request(c, "c-other-tenant", prompts["long"], MAX_NEW, None, "tenant-b")
    assert out["tokens"] == reference["long"]
    assert c.connector.stats["lookup_hit_blocks"] == 0 and c.connector.stats["blocks_loaded"] == 0
    out = run_request(c, "c-same-tenant", prompts["long"], MAX_NEW, None, "tenant-a")
    assert out["tokens"] == reference["long"] and c.connector.stats["blocks_loaded"] == 3

    # Another model on the same Redis (different identity, same shapes) never sees these blocks.
    other = dataclasses.replace(smol, config=dataclasses.replace(smol.config, name="another-model"))
    d = _engine(smol, redis_server.url, loaded=other)
    assert d.connector.prefix != a.connector.prefix
    run_request(d, "d-long", prompts["long"], MAX_NEW)
    assert d.connector.stats["lookup_hit_blocks"] == 0 and d.connector.stats["blocks_loaded"] == 0
    _assert_no_leak(a, b, c, d)
    for e in (a, b, c, d, ref_b):
        e.shutdown()


def test_corrupt_or_missing_value_recomputes(smol, one_thread, redis_server, prompts, reference):
    prefill = _engine(smol, redis_server.url, role="prefill")
    p = prompts["long"]
    run_request(prefill, "p", p, 1, {"do_remote_decode": True})
    keys = sorted(redis_server.client.keys("kvmesh:*"))
    assert len(keys) == 3
    # Flip one payload byte of one block: the checksum must reject it and the decode recompute everything.
    victim = keys[1]
    n = redis_server.client.strlen(victim)
    byte = redis_server.client.getrange(victim, n - 100, n - 100)
    redis_server.client.setrange(victim, n - 100, bytes([byte[0] ^ 0xFF]))
    decode = _engine(smol, redis_server.url, role="decode")
    out = run_request(decode, "d", p, MAX_NEW)
    assert out["tokens"] == reference["long"]
    assert decode.connector.stats["corrupt_blocks"] == 1 and decode.connector.stats["loads_failed"] == 1
    assert out["computed"] == len(p) + MAX_NEW - 1  # nothing was taken from the damaged load
    _assert_no_leak(decode)

    # A missing key in the middle of the chain: only the blocks before the gap are loadable.
    redis_server.client.flushall()
    prefill2 = _engine(smol, redis_server.url, role="prefill")  # the first one would hit its local cache
    run_request(prefill2, "p2", p, 1, {"do_remote_decode": True})
    assert len(redis_server.client.keys("kvmesh:*")) == 3
    h1 = decode.connector.key(decode_block_hashes(smol, p)[1])
    assert redis_server.client.delete(h1) == 1
    fresh = _engine(smol, redis_server.url, role="decode")
    out = run_request(fresh, "d2", p, MAX_NEW)
    assert out["tokens"] == reference["long"]
    assert fresh.connector.stats["blocks_loaded"] == 1
    assert out["computed"] == len(p) - BS + MAX_NEW - 1
    _assert_no_leak(prefill, prefill2, fresh)
    for e in (prefill, prefill2, decode, fresh):
        e.shutdown()


def decode_block_hashes(smol, prompt):
    from kvmesh.common.hashing import block_hashes_for

    return block_hashes_for(prompt, BS, smol.config.identity())


def test_fp8_blocks_through_redis_and_refused_from_another_dtype(smol, one_thread, redis_server, prompts):
    """fp8 prefill -> fp8 decode (the prefill's params passed on, as the router does): FP8 blocks
    loaded, not recomputed, tokens of a single fp8 engine. float32 prefill -> fp8 decode: its blocks
    (another namespace, another header layout) are refused by the params' layout, counted, and the
    prompt recomputed to the same tokens; nothing leaks."""
    p = prompts["long"]
    single, _ = EngineCore.from_model(EngineArgs(num_kv_blocks=32, kv_cache_dtype="fp8"), loaded=smol)
    ref = run_request(single, "ref8", p, MAX_NEW)["tokens"]
    p8 = _engine(smol, redis_server.url, role="prefill", kv_cache_dtype="fp8")
    d8 = _engine(smol, redis_server.url, role="decode", kv_cache_dtype="fp8")
    first = run_request(p8, "p8", p, 1, {"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["remote_kv_layout"].startswith("float8_e4m3fn|") and first["tokens"] == ref[:1]
    keys = redis_server.client.keys("kvmesh:*")
    assert len(keys) == len(p) // BS and all(k.decode().startswith(p8.connector.prefix) for k in keys)
    assert b"float8_e4m3fn|" in redis_server.client.get(keys[0])[:80]  # the header names the dtype
    out = run_request(d8, "d8", p, MAX_NEW, params)
    assert out["tokens"] == ref
    assert out["computed"] == len(p) - _loadable(len(p)) + MAX_NEW - 1
    assert d8.connector.stats["blocks_loaded"] == _loadable(len(p)) // BS

    pf = _engine(smol, redis_server.url, role="prefill")  # float32 (auto on the CPU)
    first = run_request(pf, "pf", p, 1, {"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["remote_kv_layout"].startswith("float32|") and pf.connector.prefix != p8.connector.prefix
    d8.kv.pool.reset_prefix_cache()  # no local hit: the refusal alone decides
    out = run_request(d8, "d8-refused", p, MAX_NEW, params)
    assert out["tokens"] == ref and out["computed"] == len(p) + MAX_NEW - 1
    st = d8.connector.stats
    assert st["kv_layout_refused"] == 1 and st["loads_failed"] == 0
    assert d8.stats().kv_transfer_refused == {"kv_layout": 1}
    _assert_no_leak(single, p8, d8, pf)
    for e in (single, p8, d8, pf):
        e.shutdown()


def test_redis_stopped_mid_run_recomputes(smol, one_thread, prompts, reference):
    srv = RedisServer()
    try:
        prefill = _engine(smol, srv.url, role="prefill", socket_timeout_s=1.0)
        decode = _engine(smol, srv.url, role="decode", socket_timeout_s=1.0)
        p = prompts["long"]
        run_request(prefill, "p", p, 1, {"do_remote_decode": True})
        assert decode.connector.stats["lookups"] == 0
        # Stop redis-server right after the decode's lookup found the blocks and before it reads them.
        lookup = decode.connector.get_num_new_matched_tokens

        def lookup_then_stop(req, n):
            res = lookup(req, n)
            srv.stop()
            return res

        decode.connector.get_num_new_matched_tokens = lookup_then_stop
        out = run_request(decode, "d", p, MAX_NEW)
        assert out["tokens"] == reference["long"]
        st = decode.connector.stats
        assert st["lookup_hit_blocks"] == 3 and st["loads_failed"] == 1 and st["blocks_loaded"] == 0
        assert out["computed"] == len(p) + MAX_NEW - 1
        # With the server gone, saves fail quietly and answers stay exact.
        out = run_request(prefill, "p-down", prompts["exact"], MAX_NEW)
        assert out["tokens"] == reference["exact"]
        assert prefill.connector.stats["save_errors"] >= 1
        _assert_no_leak(prefill, decode)
        prefill.shutdown()
        decode.shutdown()
    finally:
        srv.stop()


@pytest.mark.parametrize("chunk_blocks", [1, 2, 64])
def test_save_and_load_store_exact_bytes_in_any_chunking(redis_server, chunk_blocks):
    """What one connector saves (pipelined SETs, any chunk size, on a non-zero db) another loads exactly,
    in any order and chunking; both a flipped payload byte and a missing key fail the load, after which
    the connection still works."""
    from types import SimpleNamespace

    from kvmesh.engine.connectors.base import ConnectorMetadata
    from kvmesh.engine.connectors.redis_connector import RedisConnector

    cfg = SimpleNamespace(role="prefill", model=SimpleNamespace(identity=lambda: "chunking-test"))
    n = 7
    src = torch.randn(n, 2, 2, BS, 2, 8)
    url = redis_server.url[:-1] + "3"  # db 3: SELECT on the connector's connection
    block_bytes = src[0].numel() * src.element_size()
    saver = RedisConnector(cfg, url=url, ttl_s=60, max_batch_bytes=chunk_blocks * block_bytes)
    saver.register_kv_cache(src)
    hashes = [os.urandom(32) for _ in range(n)]
    saver.save_kv(ConnectorMetadata(saves={"r": {"block_ids": list(range(n)), "hashes": hashes}}))
    assert saver.stats["save_errors"] == 0 and saver.stats["blocks_saved"] == n
    import redis

    db3 = redis.Redis(port=redis_server.port, db=3)
    assert db3.dbsize() == n and redis_server.client.dbsize() == 0
    assert 0 < db3.ttl(saver.key(hashes[0])) <= 60
    # A plain client's decode of what was stored, and the connector's load, both give the source bytes.
    for h, b in zip(hashes, range(n)):
        payload = decode_block(db3.get(saver.key(h)), saver._sig, h, saver.layout.block_bytes)
        assert bytes(payload) == src[b].numpy().tobytes()
    dst = torch.zeros_like(src)
    c = RedisConnector(cfg, url=url, max_batch_bytes=chunk_blocks * block_bytes)
    c.register_kv_cache(dst)
    order = [3, 0, 6, 1, 5, 2, 4]
    c._load(order, [hashes[i] for i in order])
    assert torch.equal(dst, src)
    # A flipped payload byte fails the checksum; a missing key fails as KeyError; the connection recovers.
    db3.setrange(saver.key(hashes[2]), 200, b"\xff\x00")
    with pytest.raises(BlockFormatError):
        c._load([0, 1, 2, 3], hashes[:4])
    db3.delete(saver.key(hashes[2]))
    with pytest.raises(KeyError):
        c._load([0, 1, 2, 3], hashes[:4])
    dst.zero_()
    c._load([4, 5, 6], hashes[4:])
    assert torch.equal(dst[4:], src[4:])
    c.close()
    saver.close()
    db3.close()


def test_redis_auth_password_required(smol, one_thread, prompts, reference, monkeypatch, tmp_path):
    """A redis-server with --requirepass: without the password, or with a wrong one, the connector fails at
    start naming Redis AUTH; with it (env or file) prefill saves and decode loads exactly."""
    password = "redis-test-" + os.urandom(8).hex()
    srv = RedisServer(password=password)
    try:
        monkeypatch.delenv("KVMESH_REDIS_PASSWORD", raising=False)
        for opts in ({}, {"password": "wrong-password"}):
            with pytest.raises(RuntimeError, match="Redis AUTH failed"):
                _engine(smol, srv.url, role="prefill", **opts)
        monkeypatch.setenv("KVMESH_REDIS_PASSWORD", password)
        env.cache_clear()  # the process's variables are read once
        prefill = _engine(smol, srv.url, role="prefill")
        monkeypatch.delenv("KVMESH_REDIS_PASSWORD")
        env.cache_clear()
        f = tmp_path / "redis-password"
        f.write_text(password + "\n")
        decode = _engine(smol, srv.url, role="decode", password_file=str(f))
        p = prompts["long"]
        run_request(prefill, "auth-p", p, 1, {"do_remote_decode": True})
        out = run_request(decode, "auth-d", p, MAX_NEW)
        assert out["tokens"] == reference["long"]
        assert out["computed"] == len(p) - _loadable(len(p)) + MAX_NEW - 1
        assert decode.connector.stats["redis_errors"] == 0
        _assert_no_leak(prefill, decode)
        prefill.shutdown()
        decode.shutdown()
    finally:
        srv.stop()
    assert srv.proc.poll() is not None


def _test_ca(d) -> dict[str, str]:
    """A private CA and a server certificate it signs for 127.0.0.1, made by the openssl CLI."""
    f = {k: str(d / n) for k, n in (("ca", "ca.crt"), ("ca_key", "ca.key"), ("cert", "srv.crt"), ("key", "srv.key"))}

    def ossl(*a: str) -> None:
        subprocess.run(["openssl", *a], check=True, capture_output=True)

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvmesh test CA",
         "-keyout", f["ca_key"], "-out", f["ca"])  # fmt: skip
    csr, ext = str(d / "srv.csr"), d / "ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", f["key"], "-out", csr)
    ossl("x509", "-req", "-in", csr, "-CA", f["ca"], "-CAkey", f["ca_key"], "-CAcreateserial", "-days", "2",
         "-extfile", str(ext), "-out", f["cert"])  # fmt: skip
    return f


def test_redis_tls_verified_against_a_private_ca(smol, one_thread, prompts, reference, tmp_path):
    """A TLS-only redis-server whose certificate a private CA signed: without that CA the connector
    fails at start naming TLS (not a silent stream of recomputes); with ``tls_ca_file`` prefill saves
    over TLS and decode loads exactly."""
    certs = _test_ca(tmp_path)
    srv = RedisServer(tls=certs)
    try:
        assert srv.url.startswith("rediss://")
        with pytest.raises(RuntimeError, match="Redis TLS handshake"):
            _engine(smol, srv.url, role="prefill")
        prefill = _engine(smol, srv.url, role="prefill", tls_ca_file=certs["ca"])
        decode = _engine(smol, srv.url.replace("rediss://", "redis://"), role="decode", tls_ca_file=certs["ca"])
        assert decode.connector.tls  # the CA file alone turns TLS on
        p = prompts["long"]
        run_request(prefill, "tls-p", p, 1, {"do_remote_decode": True})
        out = run_request(decode, "tls-d", p, MAX_NEW)
        assert out["tokens"] == reference["long"]
        assert out["computed"] == len(p) - _loadable(len(p)) + MAX_NEW - 1
        assert prefill.connector.stats["blocks_saved"] > 0 and decode.connector.stats["redis_errors"] == 0
        _assert_no_leak(prefill, decode)
        prefill.shutdown()
        decode.shutdown()
    finally:
        srv.stop()
