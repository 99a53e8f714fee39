"""KV-event stream choices that need no socket: the CURVE keys derived from the shared secret
(the wire format, replay and who may connect are in the integration tier)."""

from __future__ import annotations

import pytest
import zmq

from kvmesh.common.env import env
from kvmesh.common.kv_auth import load_kv_auth_key
from kvmesh.common.kv_events_auth import CurveKeys, RouterOnly

pytestmark = pytest.mark.unit


def test_keys_are_derived_deterministically_and_differ_per_secret_and_role():
    a, a2, b = (
        CurveKeys.derive(b"s3cret-kv-path-secret"),
        CurveKeys.derive(b"s3cret-kv-path-secret"),
        CurveKeys.derive(b"other"),
    )
    assert a == a2  # every pod and router replica derives the same pairs: nothing to distribute
    assert a.server_public != b.server_public and a.client_public != b.client_public
    assert len({a.server_public, a.server_secret, a.client_public, a.client_secret}) == 4
    assert zmq.curve_public(a.client_secret) == a.client_public and len(a.client_public) == 40  # Z85 of 32 bytes
    with pytest.raises(ValueError, match="empty"):
        CurveKeys.derive(b"")


def test_zap_check_admits_only_the_router_key():
    keys = CurveKeys.derive(b"s3cret-kv-path-secret")
    check = RouterOnly(keys)
    assert check.callback("d", keys.client_public)
    stranger = zmq.curve_keypair()[0]
    assert not check.callback("d", stranger) and not check.callback("d", keys.server_public)
    assert check.refused == 2


def test_secret_from_file_or_env(tmp_path, monkeypatch):
    monkeypatch.delenv("KVMESH_KV_AUTH_KEY", raising=False)
    assert load_kv_auth_key() is None
    monkeypatch.setenv("KVMESH_KV_AUTH_KEY", " from-env-kv-path-secret\n")
    env.cache_clear()  # the process's variables are read once
    assert load_kv_auth_key() == b"from-env-kv-path-secret"
    f = tmp_path / "kv-auth-key"
    f.write_text("from-file-kv-path-secret\n")
    assert load_kv_auth_key(str(f)) == b"from-file-kv-path-secret"  # the file wins over the environment
    f.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_kv_auth_key(str(f))
    with pytest.raises(ValueError, match="missing"):
        load_kv_auth_key(str(tmp_path / "missing"))
