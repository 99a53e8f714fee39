"""`kvmesh up`: the full local topology (prefill, decode, router; redis-server with the Redis connector)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import TYPE_CHECKING

from kvmesh.common.env import env

if TYPE_CHECKING:
    from kvmesh.topology import TopologyConfig


def register(sub) -> None:
    p = sub.add_parser("up", help="run router + prefill + decode locally with the embedded model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's port (the OpenAI endpoint)")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--kv-connector", choices=["nixl", "redis"], default="nixl")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--model", default=None)
    p.add_argument("--log-dir", default=None, help="write each process's output to DIR/NAME.log")
    p.add_argument("--worker-arg", action="append", default=[], help="extra flag for every worker (repeatable)")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="clients' API key at the router (repeatable; default: $KVMESH_API_KEY; none: open)",
    )
    p.add_argument("--api-keys-file", default=None, help="JSON keys file for the router (tenants, limits)")
    p.add_argument(
        "--admin-key",
        default=None,
        help="admin key of the router (/pods, x-kvmesh-pod) and the workers (/drain, /reset_prefix_cache); "
        "default: $KVMESH_ADMIN_KEY; none while client keys are given: those endpoints are refused",
    )
    p.add_argument("--router-arg", action="append", default=[], help="extra flag for the router (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.topology import Topology

    try:
        cfg = _config(args)
    except ValueError as e:  # a setting no topology can start with: say which, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    topo = Topology(cfg)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"kvmesh up: starting {cfg.num_prefill} prefill + {cfg.num_decode} decode ({cfg.kv_connector}) ...", flush=True
    )
    try:
        topo.start()
    except RuntimeError as e:  # redis-server missing, or a process died or was not ready in time
        print(f"error: {e}", file=sys.stderr)
        return 1
    for w in topo.workers:
        print(f"  {w.role:8s} {w.url}  events {w.events}", flush=True)
    if topo.redis_url:
        print(f"  redis    {topo.redis_url}", flush=True)
    if not (cfg.api_keys or cfg.api_keys_file or env().api_key):
        print("  the router takes requests without a key (give --api-key or --api-keys-file)", flush=True)
    print("  workers accept only the router's key (generated for this run)", flush=True)
    if cfg.admin_key or env().admin_key:
        print("  /pods, x-kvmesh-pod and the workers' /drain and /reset_prefix_cache take the admin key", flush=True)
    else:
        print("  the workers' /drain and /reset_prefix_cache are refused (no --admin-key)", flush=True)
    print(f"ready: OpenAI endpoint {topo.router_url}/v1  (Ctrl-C stops everything)", flush=True)
    try:
        while not stop.wait(1.0):  # a child that exits is started again; the others keep serving
            try:
                for line in topo.supervise():
                    print(f"kvmesh up: {line}", file=sys.stderr, flush=True)
            except RuntimeError as e:
                print(f"error: {e}; stopping", file=sys.stderr)
                return 1
    finally:
        print("kvmesh up: stopping", flush=True)
        topo.stop()
    return 0


def _config(args: argparse.Namespace) -> TopologyConfig:
    """The topology the flags ask for (ValueError names a setting none can start with)."""
    from kvmesh.topology import TopologyConfig

    return TopologyConfig(
        host=args.host,
        port=args.port,
        num_prefill=args.prefill,
        num_decode=args.decode,
        kv_connector=args.kv_connector,
        model=args.model,
        redis_url=args.redis_url,
        engine_args=tuple(args.worker_arg),
        router_args=tuple(args.router_arg),
        api_keys=tuple(args.api_key),
        api_keys_file=args.api_keys_file,
        admin_key=args.admin_key,
        log_dir=args.log_dir,
    )
