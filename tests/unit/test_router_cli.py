"""`kvmesh router` flags: generated from RouterConfig and ScoringWeights, read back by field name."""

from __future__ import annotations

import pytest

from kvmesh.cli import build_parser
from kvmesh.services.router.config import PodSpec, RouterConfig, ScoringWeights
from kvmesh.services.router.entry import config_from_args

pytestmark = pytest.mark.unit


def test_defaults_are_the_dataclass_defaults() -> None:
    cfg = config_from_args(build_parser().parse_args(["router", "--worker", "http://a:1"]))
    assert cfg == RouterConfig(pods=(PodSpec("http://a:1", "both"),))


def test_every_flag_reaches_the_config(tmp_path) -> None:
    keys, up = tmp_path / "keys.json", tmp_path / "up"
    keys.write_text('[{"key": "k3", "tenant": "t"}]')
    up.write_text("internal\n")
    secret = tmp_path / "kv-auth-key"
    secret.write_text("s3cret-kv-path-secret\n")
    argv = [
        "router",
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
        "--model",
        "/m",
        "--served-model-name",
        "m",
        "--block-size",
        "32",
        "--kv-events-port",
        "5557",
        "--kv-replay-port",
        "5558",
        "--kv-auth-key-file",
        str(secret),
        "--policy",
        "least-load",
        "--pd-min-uncached",
        "64",
        "--discovery",
        "k8s",
        "--namespace",
        "ns",
        "--port-name",
        "web",
        "--prefill-selector",
        "a=b",
        "--decode-selector",
        "c=d",
        "--health-interval",
        "1.5",
        "--connect-timeout",
        "3",
        "--read-timeout",
        "60",
        "--max-retries",
        "1",
        "--log-level",
        "info",
        "--shutdown-timeout",
        "20",
        "--weight-hit",
        "0.9",
        "--weight-load",
        "0.3",
        "--weight-tokens",
        "0.4",
        "--weight-kv",
        "0.5",
        "--weight-share",
        "0.6",
        "--share-halflife",
        "60",
        "--weight-evict",
        "0.7",
        "--evict-halflife",
        "30",
        "--weight-share-new",
        "0.1",
        "--private-guard",
        "1.5",
        "--weight-affinity",
        "0.25",
        "--balance-abs",
        "3",
        "--balance-rel",
        "1.5",
        "--hot-limit-scope",
        "all",
        "--api-key",
        "k1",
        "--api-key",
        "k2",
        "--api-keys-file",
        str(keys),
        "--upstream-api-key-file",
        str(up),
        "--max-concurrent-requests",
        "8",
        "--queue-size",
        "16",
        "--queue-timeout",
        "5",
    ]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg == RouterConfig(
        host="127.0.0.1",
        port=9000,
        model="/m",
        served_model_name="m",
        block_size=32,
        kv_events_port=5557,
        kv_replay_port=5558,
        kv_auth_key_file=str(secret),
        policy="least-load",
        pd_min_uncached=64,
        discovery="k8s",
        k8s_namespace="ns",
        k8s_port_name="web",
        k8s_selectors=(("prefill", "a=b"), ("decode", "c=d")),
        health_interval=1.5,
        connect_timeout=3.0,
        read_timeout=60.0,
        max_retries=1,
        log_level="info",
        shutdown_timeout=20.0,
        api_keys=("k1", "k2"),
        api_keys_file=str(keys),
        upstream_api_key_file=str(up),
        max_concurrent_requests=8,
        queue_size=16,
        queue_timeout=5.0,
        weights=ScoringWeights(
            hit=0.9,
            load=0.3,
            tokens=0.4,
            kv=0.5,
            share=0.6,
            share_halflife_s=60.0,
            evict=0.7,
            evict_halflife_s=30.0,
            share_new=0.1,
            private_guard=1.5,
            affinity=0.25,
            balance_abs=3.0,
            balance_rel=1.5,
            hot_limit_scope="all",
        ),
    )


def test_a_missing_keys_file_is_a_config_error(tmp_path) -> None:
    for flag in ("--api-keys-file", "--upstream-api-key-file"):
        args = build_parser().parse_args(["router", "--worker", "http://a:1", flag, str(tmp_path / "none")])
        with pytest.raises(ValueError, match="none"):
            config_from_args(args)


def test_unreadable_kv_auth_key_file_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "empty").write_text("")
    for path, why in ((tmp_path / "missing", "No such file"), (tmp_path / "empty", "is empty")):
        argv = ["router", "--worker", "http://a:1", "--kv-auth-key-file", str(path)]
        with pytest.raises(ValueError, match=why):
            config_from_args(build_parser().parse_args(argv))


def test_choices_are_checked_by_the_parser() -> None:
    for bad in (["--policy", "random"], ["--hot-limit-scope", "some"], ["--discovery", "dns"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["router", *bad])
