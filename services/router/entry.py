"""`kvmesh router`: the router's entry point: flags from `RouterConfig` and `ScoringWeights`, the pods
and selectors from --worker/--prefill/--decode, then serve (services/router/app.py)."""

from __future__ import annotations

import argparse
import sys

from kvmesh.common.env import env
from kvmesh.common.fields import add_arguments, values_from


def register(sub) -> None:
    p = sub.add_parser("router", help="run the KV-aware router in front of kvmesh pods")
    from kvmesh.services.router.config import RouterConfig, ScoringWeights

    add_arguments(p, RouterConfig)
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL[,events=EP][,replay=EP]",
        help="a pod that does prefill and decode (repeatable)",
    )
    p.add_argument("--prefill", action="append", default=[], metavar="URL[,events=EP][,replay=EP]")
    p.add_argument("--decode", action="append", default=[], metavar="URL[,events=EP][,replay=EP]")
    p.add_argument("--selector", default=None, help="label selector of worker EndpointSlices (k8s)")
    p.add_argument("--prefill-selector", default=None)
    p.add_argument("--decode-selector", default=None)
    add_arguments(p.add_argument_group("scoring (kv-aware)"), ScoringWeights)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The flags as a `RouterConfig`; ``--worker``/``--selector`` name pods of the engine's role "both"."""
    from kvmesh.common.kv_auth import load_kv_auth_key
    from kvmesh.common.roles import Role
    from kvmesh.services.router.config import RouterConfig, ScoringWeights, parse_pod_spec

    urls: tuple[tuple[Role, list[str]], ...] = (
        ("both", args.worker),
        ("prefill", args.prefill),
        ("decode", args.decode),
    )
    pods = tuple(parse_pod_spec(s, role, args.kv_events_port, args.kv_replay_port) for role, lst in urls for s in lst)
    named: tuple[tuple[Role, str | None], ...] = (
        ("both", args.selector),
        ("prefill", args.prefill_selector),
        ("decode", args.decode_selector),
    )
    selectors = tuple((r, s) for r, s in named if s)
    if args.discovery == "static" and not pods:
        raise ValueError("give --worker/--prefill/--decode URLs, or --discovery k8s --selector ...")
    if args.discovery == "k8s" and not selectors:
        raise ValueError("--discovery k8s needs --selector (and/or --prefill-selector/--decode-selector)")
    weights = ScoringWeights(**values_from(args, ScoringWeights))
    cfg = RouterConfig(**values_from(args, RouterConfig), weights=weights, pods=pods, k8s_selectors=selectors)
    from kvmesh.services.auth import KeyStore, SecretFile, admin_key_source

    if cfg.api_keys_file:  # a missing or malformed file is a start-up error, not a traceback later
        KeyStore(path=cfg.api_keys_file)
    admin_key_source(cfg.admin_key, cfg.admin_key_file)
    if cfg.upstream_api_key_file:
        SecretFile(cfg.upstream_api_key_file, env().upstream_api_key)
    load_kv_auth_key(cfg.kv_auth_key_file)  # a missing or empty secret file fails here, with the reason
    return cfg


def run(args: argparse.Namespace) -> int:
    from kvmesh import aio
    from kvmesh.common.logs import setup_logging

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging("router")
    from kvmesh.common.env import env
    from kvmesh.common.python_child import exit_with_parent
    from kvmesh.services.router.app import serve

    exit_with_parent(env().parent_pid)

    try:
        return aio.run(serve(cfg))
    except KeyboardInterrupt:
        return 0
