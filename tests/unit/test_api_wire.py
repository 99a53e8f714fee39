"""The API <-> engine process boundary without a model: message encoding, configuration and flags (the engine
loop over real sockets is in the integration tier)."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.engine.core.messages import EngineCoreOutput, EngineCoreRequest, EngineStats
from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.services.api import wire
from kvmesh.services.api.engine_proc import EngineProcConfig

pytestmark = pytest.mark.unit


def test_messages_round_trip():
    req = EngineCoreRequest(
        "r1",
        [1, 2, 3],
        SamplingParams(n=2, stop=("x",), seed=3, logprobs=2),
        cache_salt="s",
        kv_transfer_params={"do_remote_decode": True},
    )
    for msg in (
        wire.AddRequest(req),
        wire.Abort(["a", "b"]),
        wire.AbortSequence("a", 1),
        wire.Shutdown(),
        wire.ResetPrefixCache(7),
    ):
        assert wire.to_engine_decoder.decode(wire.encoder.encode(msg)) == msg
    out = wire.Outputs([EngineCoreOutput("r1", 1, [5], [(-0.1, [(5, -0.1), (6, -2.0)])], "stop", ".")], {"r1": 0.25})
    for msg in (
        out,
        wire.Stats(EngineStats(num_running=2), 1.0),
        wire.Rejected("r", "queue_full", "full"),
        wire.Ready(1, "m", 512, 16, 100, "decode"),
        wire.ResetDone(7, False),
        wire.Fatal("boom"),
    ):
        assert wire.from_engine_decoder.decode(wire.encoder.encode(msg)) == msg


def test_add_request_repr_hides_prompt():
    req = EngineCoreRequest("r1", [11, 22, 33], SamplingParams())
    assert "22" not in repr(wire.AddRequest(req))


def test_invalid_params_rejected_at_decode():
    bad = msgspec.msgpack.encode(
        {"type": "add", "request": {"request_id": "r", "prompt_token_ids": [1], "params": {"n": 0}}}
    )
    with pytest.raises(msgspec.ValidationError, match="n must be"):
        wire.to_engine_decoder.decode(bad)


def test_config_validation_and_json():
    cfg = EngineProcConfig("ipc://a", "ipc://b", engine_kwargs={"block_size": 16}, role="prefill")
    assert EngineProcConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError):
        EngineProcConfig("ipc://a", "ipc://b", role="sideways")


def test_serve_flags_reach_engine_config(monkeypatch):
    from kvmesh.cli import build_parser
    from kvmesh.services.api.entry import configs_from_args

    monkeypatch.setenv("KVMESH_KV_AUTH_KEY", "unit-test-kv-auth-key")  # the nixl connector requires it

    args = build_parser().parse_args(
        [
            "serve",
            "--role",
            "decode",
            "--max-waiting",
            "3",
            "--port",
            "9001",
            "--kv-connector",
            "nixl",
            "--kv-connector-config",
            '{"lease_s": 5}',
            "--engine-input-addr",
            "tcp://127.0.0.1:7001",
            "--engine-output-addr",
            "tcp://127.0.0.1:7002",
            "--num-kv-blocks",
            "64",
        ]
    )
    cfg, proc = configs_from_args(args)
    assert cfg.role == proc.role == "decode" and cfg.port == 9001
    assert proc.engine_kwargs["max_waiting"] == 3 and proc.engine_kwargs["num_kv_blocks"] == 64
    assert (proc.input_addr, proc.output_addr) == ("tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002")
    assert proc.kv_connector == "nixl" and proc.kv_connector_config == {"lease_s": 5}


def test_kv_auth_key_file_reaches_the_engine_as_a_path(tmp_path):
    """The engine process gets the secret's path (its config travels on a command line), never the secret;
    a missing file is refused before any process starts."""
    from kvmesh.cli import build_parser
    from kvmesh.services.api.entry import configs_from_args

    secret = tmp_path / "kv-auth-key"
    secret.write_text("s3cret-kv-path-secret")
    ev = ["serve", "--kv-events-endpoint", "tcp://*:5557", "--kv-auth-key-file"]
    _, proc = configs_from_args(build_parser().parse_args([*ev, str(secret)]))
    assert proc.kv_auth_key_file == str(secret) and "s3cret-kv-path-secret" not in proc.to_json()
    with pytest.raises(ValueError, match="No such file"):
        configs_from_args(build_parser().parse_args([*ev, str(tmp_path / "missing")]))


def test_connector_factory_uses_registry(monkeypatch):
    from kvmesh.engine import connectors
    from kvmesh.services.api.engine_proc import default_connector_factory

    cfg = EngineProcConfig(
        "ipc://a",
        "ipc://b",
        role="prefill",
        kv_connector="redis",
        kv_connector_config={"url": "redis://x"},
        engine_kwargs={"engine_id": "p-0"},
    )
    assert default_connector_factory(EngineProcConfig("ipc://a", "ipc://b")) is None  # none: no registry needed
    calls = []
    monkeypatch.setattr(
        connectors,
        "make_connector",
        lambda name, config, **kw: calls.append((name, config, kw)) or "conn",
        raising=False,
    )
    assert default_connector_factory(cfg) == "conn"
    # Options pass as keywords; role and engine id reach the connector from the engine (configure()).
    assert calls == [("redis", None, {"url": "redis://x"})]
