"""services/auth.py: key files, lookup, reloading on change, env fallbacks, the admin key."""

from __future__ import annotations

import json
import os

import pytest

from kvmesh.common.env import Env
from kvmesh.services.auth import APIKey, KeyStore, SecretFile, admin_key_source, parse_keys_file

pytestmark = pytest.mark.unit


def test_keys_file_entries_and_their_errors():
    keys = parse_keys_file(json.dumps([{"key": "a", "tenant": "t", "priority": 2, "rpm": 5, "tpm": None}]))
    assert keys == (APIKey("a", "t", 2, 5, None),)
    assert parse_keys_file('[{"key": "b"}]') == (APIKey("b", "default"),)
    for text, fragment in [
        ("{", "not JSON"),
        ('{"key": "a"}', "JSON list"),
        ('[{"tenant": "t"}]', "no key"),
        ('[{"key": "a", "tier": 1}]', "unknown fields"),
        ('[{"key": ""}]', "non-empty"),
        ('[{"key": "a", "rpm": 0}]', "rpm"),
        ('[{"key": "a", "priority": "high"}]', "priority"),
        ('["a"]', "not an object"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            parse_keys_file(text)


def test_lookup_needs_the_bearer_scheme_and_an_exact_key():
    store = KeyStore(["one", "two"])
    assert store.configured and store.lookup("Bearer two") == APIKey("two")
    assert store.lookup("bearer one") == APIKey("one")
    for bad in (None, "", "one", "Bearer on", "Bearer one1", "Basic one", "Bearer "):
        assert store.lookup(bad) is None, bad
    assert not KeyStore().configured


def test_env_fallbacks():
    env = Env.from_environ({"KVMESH_API_KEY": "x, y,", "KVMESH_UPSTREAM_API_KEY": " up "})
    assert KeyStore.from_config((), None, env).lookup("Bearer y") == APIKey("y")
    assert KeyStore.from_config(("z",), None, env).lookup("Bearer x") is None  # flags win over the env
    assert SecretFile(None, env.upstream_api_key).get() == "up"
    assert SecretFile(None, Env.from_environ({}).upstream_api_key).get() is None


def test_keys_file_reloads_on_change_at_most_once_a_second(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"key": "old", "tenant": "a"}]))
    now = [0.0]
    store = KeyStore(path=str(path), clock=lambda: now[0])
    assert store.lookup("Bearer old").tenant == "a"
    path.write_text(json.dumps([{"key": "new", "tenant": "b", "rpm": 3}]))
    os.utime(path, ns=(10**9, 10**9))
    now[0] = 0.5
    assert store.lookup("Bearer new") is None  # not checked again yet
    now[0] = 1.5
    assert store.lookup("Bearer new") == APIKey("new", "b", 0, 3) and store.lookup("Bearer old") is None
    assert store.tenants() == ["b"]
    path.write_text("[{broken")  # a bad or vanished file keeps the keys loaded before
    os.utime(path, ns=(2 * 10**9, 2 * 10**9))
    now[0] = 3.0
    assert store.lookup("Bearer new") is not None
    path.unlink()
    now[0] = 5.0
    assert store.lookup("Bearer new") is not None


def test_a_missing_or_bad_file_fails_at_start(tmp_path):
    with pytest.raises(ValueError, match="nope.json"):
        KeyStore(path=str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ValueError, match="entry 0"):
        KeyStore(path=str(tmp_path / "bad.json"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        SecretFile(str(tmp_path / "empty"), None)


def test_admin_key_from_the_flag_a_file_or_the_env(tmp_path):
    env = Env.from_environ({"KVMESH_ADMIN_KEY": " from-env "})
    assert admin_key_source("flag", None, env).get() == "flag"  # the flag wins over the env
    assert admin_key_source(None, None, env).get() == "from-env"
    assert admin_key_source(None, None, Env.from_environ({})).get() is None
    path = tmp_path / "admin"
    path.write_text("from-file\n")
    assert admin_key_source(None, str(path), env).get() == "from-file"
    with pytest.raises(ValueError, match="not both"):
        admin_key_source("flag", str(path), env)
    with pytest.raises(ValueError, match="missing"):
        admin_key_source(None, str(tmp_path / "missing"), env)
    assert "from-env" not in repr(env)  # a secret: never in a logged snapshot
