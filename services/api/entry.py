"""The API server's entry point, in every role: flags generated from `ServerConfig` and `EngineArgs`,
the two processes' configurations from the flags, then run (API process + engine-core process over ZMQ).

`kvmesh serve` is `add_parser(sub, "serve", ...)`; a role's room (services/prefill/, services/decode/)
adds its own command with its role as the default. The CLI (kvmesh/cli.py) only lists the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from kvmesh.common.fields import add_arguments, values_from
from kvmesh.common.kv_auth import load_kv_auth_key
from kvmesh.engine.args import EngineArgs


def add_server_args(p: argparse.ArgumentParser, default_role: str = "both") -> None:
    """Server flags (the fields of `ServerConfig`), shared with the prefill/decode entry points (they
    differ by role and connector)."""
    from kvmesh.services.api.config import ADDRESS, ServerConfig

    g = p.add_argument_group("server")
    add_arguments(g, ServerConfig, section=ADDRESS)  # --host, --port, --ready-file
    EngineArgs.add_cli_args(g, section="server")  # --role, --max-waiting, --engine-id
    p.set_defaults(role=default_role)
    add_arguments(g, ServerConfig)


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulation (no model weights: real scheduler/cache/events/API, modelled latency)")
    g.add_argument(
        "--simulate",
        action="store_true",
        help="replace the forward pass with a latency model and deterministic tokens "
        "(tokenizer only; --num-kv-blocks defaults to 2048); see engine/runner/sim_runner.py",
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
        "--sim-kv-move-ms-per-token",
        type=float,
        default=None,
        help="cost per token of a KV tier's block copies (host-tier offloads and loads, disk moves), charged "
        "to the step that waits for them (default 0.0049: a host-tier load measured on an H100)",
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
    if args.sim_kv_move_ms_per_token is not None:
        kw["kv_move_ms_per_token"] = args.sim_kv_move_ms_per_token
    if args.sim_vocab is not None:
        kw["vocab"] = args.sim_vocab
    return kw


def add_parser(sub, name: str, help: str, role: str = "both", simulate: bool = False) -> argparse.ArgumentParser:
    """The command ``name`` (a subparser of ``sub``): server flags, engine flags, ``--role`` defaulting
    to ``role``; the ``--simulate`` flags with ``simulate``."""
    p = sub.add_parser(name, help=help)
    add_server_args(p, default_role=role)
    EngineArgs.add_cli_args(p)
    if simulate:
        add_simulate_args(p)
    p.set_defaults(func=run)
    return p


def register(sub) -> None:
    """`kvmesh serve`."""
    add_parser(sub, "serve", "run an OpenAI-compatible server", simulate=True)


def configs_from_args(args: argparse.Namespace):
    from kvmesh.services.api.config import ServerConfig
    from kvmesh.services.api.engine_proc import EngineProcConfig
    from kvmesh.services.api.launcher import engine_addresses

    cfg = ServerConfig(**values_from(args, ServerConfig), role=args.role)
    if cfg.ready_file and not os.path.isdir(os.path.dirname(os.path.abspath(cfg.ready_file))):
        raise ValueError(f"--ready-file {cfg.ready_file}: no such directory")  # now, not after the model loaded
    from kvmesh.services.auth import KeyStore, admin_key_source

    if cfg.api_keys_file:  # a missing or malformed keys file fails now, not after the model loaded
        KeyStore(path=cfg.api_keys_file)
    admin_key_source(cfg.admin_key, cfg.admin_key_file)  # both flags, or a missing admin key file, fail now too
    addrs = engine_addresses(cfg)
    # The engine process gets the model and role as fields of its own; the rest by EngineArgs field name.
    kw = {k: v for k, v in asdict(EngineArgs.from_cli_args(args)).items() if k not in ("model", "role")}
    sim = simulate_kwargs(args)
    if sim is not None:
        kw["simulate"] = sim
    try:
        connector_cfg = json.loads(cfg.kv_connector_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-connector-config is not JSON: {e}") from e
    if cfg.redis_url:
        if cfg.kv_connector != "redis":
            raise ValueError("--redis-url needs --kv-connector redis")
        connector_cfg.setdefault("url", cfg.redis_url)
    if cfg.kv_events_endpoint:
        load_kv_auth_key(cfg.kv_auth_key_file)  # a missing or empty file fails here, before any process starts
    for flag, key, value in (
        ("--redis-password-file", "password_file", cfg.redis_password_file),
        ("--redis-tls", "tls", cfg.redis_tls or None),
        ("--redis-tls-ca-file", "tls_ca_file", cfg.redis_tls_ca_file),
    ):
        if value is not None:
            if cfg.kv_connector != "redis":
                raise ValueError(f"{flag} needs --kv-connector redis")
            connector_cfg.setdefault(key, value)
    if cfg.kv_connector == "nixl":
        from kvmesh.common.kv_auth import missing_key_message

        # Fail here, before any process starts, rather than in the engine process.
        if "auth_key" not in connector_cfg and load_kv_auth_key(cfg.kv_auth_key_file) is None:
            raise ValueError(missing_key_message("--kv-connector nixl"))
        if cfg.kv_auth_key_file:
            connector_cfg.setdefault("auth_key_file", cfg.kv_auth_key_file)
    proc_cfg = EngineProcConfig(
        input_addr=addrs.input_addr,
        output_addr=addrs.output_addr,
        model=args.model,
        engine_kwargs=kw,
        role=args.role,
        kv_connector=cfg.kv_connector,
        kv_connector_config=connector_cfg,
        kv_events_endpoint=cfg.kv_events_endpoint,
        kv_events_replay_endpoint=cfg.kv_events_replay_endpoint,
        kv_auth_key_file=cfg.kv_auth_key_file,
        stats_interval=cfg.stats_interval,
        parent_pid=os.getpid(),
    )
    return cfg, proc_cfg


def run(args: argparse.Namespace) -> int:
    from kvmesh.common.env import env
    from kvmesh.common.python_child import exit_with_parent
    from kvmesh.services.api.launcher import run as run_server

    try:
        cfg, proc_cfg = configs_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    exit_with_parent(env().parent_pid)
    return run_server(cfg, proc_cfg)
