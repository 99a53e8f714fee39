"""The KV-path secret and the NIXL side channel's message authentication, without sockets."""

from __future__ import annotations

import secrets
import time

import pytest

from kvmesh.common.env import Env, env
from kvmesh.common.kv_auth import KV_AUTH_KEY_ENV, load_kv_auth_key
from kvmesh.engine.connectors.nixl_leases import HeldBlocks
from kvmesh.engine.connectors.nixl_side_channel import (
    MAX_SKEW_S,
    REPLY,
    REQUEST,
    AuthError,
    ReplayGuard,
    Signer,
    seal_request,
)

pytestmark = pytest.mark.unit
KEY = b"unit-test-kv-auth-key"


def test_key_from_file_or_env_and_too_short_refused(tmp_path):
    f = tmp_path / "key"
    f.write_text("  file-secret-0123456789\n")
    assert load_kv_auth_key(str(f), environ=Env(kv_auth_key="env-secret-0123456789")) == b"file-secret-0123456789"
    assert load_kv_auth_key(None, environ=Env(kv_auth_key="env-secret-0123456789")) == b"env-secret-0123456789"
    assert load_kv_auth_key(None, environ=Env()) is None
    with pytest.raises(ValueError, match="at least"):
        load_kv_auth_key(None, environ=Env(kv_auth_key="short"))
    with pytest.raises(ValueError, match="kv-auth-key-file"):
        load_kv_auth_key(str(tmp_path / "missing"), environ=Env())


def test_nixl_connector_refuses_to_start_without_the_secret(monkeypatch):
    from kvmesh.engine.connectors import make_connector

    monkeypatch.delenv(KV_AUTH_KEY_ENV, raising=False)
    with pytest.raises(ValueError, match=KV_AUTH_KEY_ENV):
        make_connector("nixl")
    monkeypatch.setenv(KV_AUTH_KEY_ENV, KEY.decode())
    env.cache_clear()  # the process's variables are read once
    assert make_connector("nixl").name == "nixl"


def test_serve_refuses_nixl_without_the_secret(monkeypatch, tmp_path):
    from kvmesh.cli import build_parser
    from kvmesh.services.api.entry import configs_from_args

    monkeypatch.delenv(KV_AUTH_KEY_ENV, raising=False)
    argv = ["prefill", "--kv-connector", "nixl"]
    with pytest.raises(ValueError, match=KV_AUTH_KEY_ENV):
        configs_from_args(build_parser().parse_args(argv))
    f = tmp_path / "kv-auth-key"
    f.write_text(KEY.decode())
    _, proc = configs_from_args(build_parser().parse_args([*argv, "--kv-auth-key-file", str(f)]))
    assert proc.kv_connector_config == {"auth_key_file": str(f)}  # the path travels, never the secret


def test_seal_and_open_refuse_forgeries():
    s = Signer(KEY)
    frame, nonce = seal_request(s, {"op": "meta"})
    msg = s.open(REQUEST, frame)
    assert msg["op"] == "meta" and msg["nonce"] == nonce
    for bad in (Signer(b"another-key-of-the-same-size"), s):
        direction = REQUEST if bad is not s else REPLY  # the same MAC does not open the other direction
        with pytest.raises(AuthError):
            bad.open(direction, frame)
    import msgspec

    with pytest.raises(AuthError, match="unsigned"):
        s.open(REPLY, msgspec.msgpack.encode({"ok": True, "meta": {}}))


def test_replay_guard_refuses_stale_replayed_and_unnonced():
    g = ReplayGuard()
    now = time.time()
    fresh = {"ts": now, "nonce": secrets.token_hex(16)}
    assert g.check(fresh, now) is None
    assert "replayed" in g.check(fresh, now + 1)
    assert "stale" in g.check({"ts": now - MAX_SKEW_S - 1, "nonce": secrets.token_hex(16)}, now)
    assert "stale" in g.check({"ts": float("nan"), "nonce": secrets.token_hex(16)}, now)
    assert g.check({"ts": now}, now) is not None


def test_claim_names_exact_blocks_and_extension_is_capped():
    stats = {"claims_refused": 0, "sends_done": 0, "sends_released": 0, "leases_expired": 0}
    held = HeldBlocks(stats)
    held.hold("x" * 32, "r", [4, 5], ["aa", "bb"], lease_s=10.0)
    claim = {"op": "claim", "transfer_id": "x" * 32, "block_ids": [4, 5]}
    for bad in ([4], [5, 4], [4, 5, 6]):
        assert not held.answer({**claim, "block_ids": bad, "timeout_s": 1.0}, {})["ok"]
    for t in (float("inf"), -1.0, float("nan"), None, "5"):
        assert not held.answer({**claim, "timeout_s": t}, {})["ok"]
    assert stats["claims_refused"] == 8
    ok = held.answer({**claim, "timeout_s": 1e12}, {"m": 1})
    assert ok == {"ok": True, "meta": {"m": 1}, "block_hashes": ["aa", "bb"]}
    h = held._held["x" * 32]
    assert h.deadline <= h.since + 20.0  # never past twice the lease
