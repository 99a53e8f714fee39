"""`kvmesh serve`: an OpenAI-compatible server (API process + engine-core process over ZMQ)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from kvmesh.common.kv_auth import load_kv_auth_key
from kvmesh.engine.args import EngineArgs
from kvmesh.services.http_server import DEFAULT_HEADER_TIMEOUT


def add_server_args(p: argparse.ArgumentParser, default_role: str = "both") -> None:
    """Server flags, shared with the prefill/decode entry points (they differ by role and connector)."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0")
    g.add_argument("--port", type=int, default=8000, help="0: a free port the kernel picks (see --ready-file)")
    g.add_argument(
        "--ready-file",
        default=None,
        metavar="PATH",
        help='once listening, write {"url", "port", "pid"} here (atomically; removed on exit): '
        "how a parent learns the port of --port 0",
    )
    EngineArgs.add_cli_args(g, section="server")  # --role, --max-waiting, --engine-id
    p.set_defaults(role=default_role)
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in `model` (default: the model's name)",
    )
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require `Authorization: Bearer KEY` on all endpoints but /health, /live and /metrics "
        "(repeatable; default: $KVMESH_API_KEY, comma-separated)",
    )
    g.add_argument(
        "--api-keys-file",
        default=None,
        help="JSON list of {key, tenant, priority, rpm, tpm}, re-read when it changes (default: $KVMESH_API_KEYS_FILE)",
    )
    g.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    g.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        default=None,
        help="how tool calls are read from a model's output with tool_choice auto (default: from the chat template)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds for a request body to arrive in full; a slower client gets 408",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        help="seconds for a request's headers to arrive; a slower client gets 408, an idle connection is closed",
    )
    g.add_argument(
        "--engine-restarts",
        type=int,
        default=3,
        help="times a dead engine process is started again (in-flight requests get 503); "
        "past that /health stays 503 so the pod's liveness probe restarts it",
    )
    g.add_argument("--engine-ipc-dir", default=None, help="directory for the engine's ipc sockets (default: temp)")
    g.add_argument("--engine-input-addr", default=None, help="ZMQ endpoint for requests (instead of ipc)")
    g.add_argument("--engine-output-addr", default=None, help="ZMQ endpoint for outputs (instead of ipc)")
    g.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="bind a ZMQ PUB socket here for KV cache events, e.g. tcp://*:5557 (routers connect to it)",
    )
    g.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="bind a ZMQ ROUTER socket here that replays missed KV-event sequences, e.g. tcp://*:5558",
    )
    g.add_argument(
        "--kv-connector",
        default="none",
        help="KV connector name, resolved by kvmesh.engine.connectors.make_connector (none: no connector)",
    )
    g.add_argument("--kv-connector-config", default="{}", help="JSON options for the KV connector")
    g.add_argument("--redis-url", default=None, help="Redis for --kv-connector redis (same as config key `url`)")
    g.add_argument(
        "--redis-password-file",
        default=None,
        help="file holding the Redis AUTH password (default: $KVMESH_REDIS_PASSWORD)",
    )
    g.add_argument("--redis-tls", action="store_true", help="talk TLS to Redis (same as a rediss:// URL)")
    g.add_argument(
        "--redis-tls-ca-file",
        default=None,
        help="PEM bundle of the CA that signed Redis' certificate (implies --redis-tls; default: the system's CAs)",
    )
    g.add_argument(
        "--kv-auth-key-file",
        default=None,
        help="file holding the KV-path secret shared by the workers and the router (default: $KVMESH_KV_AUTH_KEY): "
        "it MACs the NIXL side channel (required with --kv-connector nixl) and the KV-event sockets then admit "
        "only the router (CURVE; without it: plain sockets, with a warning)",
    )
    g.add_argument("--stats-interval", type=float, default=0.5, help="seconds between engine stats snapshots")
    g.add_argument("--log-level", default="warning", help="uvicorn's log level")
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to finish open requests and hand over KV blocks held for "
        "remote readers before exiting (keep it below the pod's grace period)",
    )


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulation (no model weights: real scheduler/cache/events/API, modelled latency)")
    g.add_argument(
        "--simulate",
        action="store_true",
        help="replace the forward pass with a latency model and deterministic tokens "
        "(tokenizer only; --num-kv-blocks defaults to 2048); see engine/sim_runner.py",
    )
    g.add_argument(
        "--sim-prefill-ms-per-token",
        type=float,
        default=None,
        help="prefill cost per uncached prompt token (default 0.035: Llama-3-8B on an H200)",
    )
    g.add_argument(
        "--sim-decode-ms",
        default=None,
        metavar="BASE,PER_SEQ",
        help="step cost = BASE + PER_SEQ x sequences (default 4.73,0.0143: Llama-3-8B on an H200)",
    )
    g.add_argument(
        "--sim-vocab",
        type=int,
        default=None,
        help="emitted tokens come from this many ordinary token ids (default 4096)",
    )


def simulate_kwargs(args: argparse.Namespace) -> dict | None:
    """SimulatedRunner options from the --sim-* flags, or None without --simulate."""
    if not getattr(args, "simulate", False):
        return None
    kw: dict = {}
    if args.sim_prefill_ms_per_token is not None:
        kw["prefill_ms_per_token"] = args.sim_prefill_ms_per_token
    if args.sim_decode_ms:
        try:
            base, per = (float(x) for x in args.sim_decode_ms.split(","))
        except ValueError:
            raise ValueError(f"--sim-decode-ms wants BASE,PER_SEQ in ms, got {args.sim_decode_ms!r}") from None
        kw.update(decode_base_ms=base, decode_per_seq_ms=per)
    if args.sim_vocab is not None:
        kw["vocab"] = args.sim_vocab
    return kw


def register(sub) -> None:
    p = sub.add_parser("serve", help="run an OpenAI-compatible server")
    add_server_args(p)
    EngineArgs.add_cli_args(p)
    add_simulate_args(p)
    p.set_defaults(func=run)


def configs_from_args(args: argparse.Namespace):
    from kvmesh.services.api.config import ServerConfig
    from kvmesh.services.api.engine_proc import EngineProcConfig
    from kvmesh.services.api.launcher import engine_addresses

    cfg = ServerConfig(
        host=args.host,
        port=args.port,
        ready_file=args.ready_file,
        role=args.role,
        served_model_names=tuple(args.served_model_name or ()),
        api_keys=tuple(args.api_key),
        api_keys_file=args.api_keys_file,
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout,
        header_timeout=args.header_timeout,
        engine_restarts=args.engine_restarts,
        ipc_dir=args.engine_ipc_dir,
        engine_input_addr=args.engine_input_addr,
        engine_output_addr=args.engine_output_addr,
        uvicorn_log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout,
        tool_call_parser=args.tool_call_parser,
    )
    if cfg.ready_file and not os.path.isdir(os.path.dirname(os.path.abspath(cfg.ready_file))):
        raise ValueError(f"--ready-file {cfg.ready_file}: no such directory")  # now, not after the model loaded
    if cfg.api_keys_file:  # a missing or malformed keys file fails now, not after the model loaded
        from kvmesh.services.auth import KeyStore

        KeyStore(path=cfg.api_keys_file)
    addrs = engine_addresses(cfg)
    # The engine process gets the model and role as fields of its own; the rest by EngineArgs field name.
    kw = {k: v for k, v in asdict(EngineArgs.from_cli_args(args)).items() if k not in ("model", "role")}
    sim = simulate_kwargs(args)
    if sim is not None:
        kw["simulate"] = sim
    try:
        connector_cfg = json.loads(args.kv_connector_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-connector-config is not JSON: {e}") from e
    if getattr(args, "redis_url", None):
        if args.kv_connector != "redis":
            raise ValueError("--redis-url needs --kv-connector redis")
        connector_cfg.setdefault("url", args.redis_url)
    if args.kv_events_endpoint:
        load_kv_auth_key(args.kv_auth_key_file)  # a missing or empty file fails here, before any process starts
    for flag, key, value in (
        ("--redis-password-file", "password_file", args.redis_password_file),
        ("--redis-tls", "tls", args.redis_tls or None),
        ("--redis-tls-ca-file", "tls_ca_file", args.redis_tls_ca_file),
    ):
        if value is not None:
            if args.kv_connector != "redis":
                raise ValueError(f"{flag} needs --kv-connector redis")
            connector_cfg.setdefault(key, value)
    if args.kv_connector == "nixl":
        from kvmesh.common.kv_auth import missing_key_message

        # Fail here, before any process starts, rather than in the engine process.
        if "auth_key" not in connector_cfg and load_kv_auth_key(args.kv_auth_key_file) is None:
            raise ValueError(missing_key_message("--kv-connector nixl"))
        if args.kv_auth_key_file:
            connector_cfg.setdefault("auth_key_file", args.kv_auth_key_file)
    proc_cfg = EngineProcConfig(
        input_addr=addrs.input_addr,
        output_addr=addrs.output_addr,
        model=args.model,
        engine_kwargs=kw,
        role=args.role,
        kv_connector=args.kv_connector,
        kv_connector_config=connector_cfg,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_auth_key_file=args.kv_auth_key_file,
        stats_interval=args.stats_interval,
        parent_pid=os.getpid(),
    )
    return cfg, proc_cfg


def run(args: argparse.Namespace) -> int:
    from kvmesh.services.api.launcher import run as run_server

    try:
        cfg, proc_cfg = configs_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_server(cfg, proc_cfg)
