"""`kvmesh router`: the KV-aware OpenAI router (kvmesh.services.router)."""
from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser("router", help="run the KV-aware router in front of kvmesh pods")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--model", default=None, help="the pods' model (tokenizer + hash identity); default: embedded")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--block-size", type=int, default=16, help="must equal the pods' --block-size")
    p.add_argument("--worker", action="append", default=[], metavar="URL[,events=EP][,replay=EP]",
                   help="a pod that does prefill and decode (repeatable)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL[,events=EP][,replay=EP]")
    p.add_argument("--decode", action="append", default=[], metavar="URL[,events=EP][,replay=EP]")
    p.add_argument("--kv-events-port", type=int, default=None,
                   help="pods publish KV events on tcp://HOST:PORT (for pods without events=)")
    p.add_argument("--kv-replay-port", type=int, default=None)
    p.add_argument("--policy", choices=["kv-aware", "round-robin", "least-load"], default="kv-aware")
    from kvmesh.services.router.config import ScoringWeights

    w = ScoringWeights()  # one set of defaults (see its docstring)
    p.add_argument("--weight-hit", type=float, default=w.hit)
    p.add_argument("--weight-load", type=float, default=w.load)
    p.add_argument("--weight-tokens", type=float, default=w.tokens)
    p.add_argument("--weight-kv", type=float, default=w.kv)
    p.add_argument("--weight-share", type=float, default=w.share,
                   help="weight of the pod's share of recently routed requests")
    p.add_argument("--share-halflife", type=float, default=w.share_halflife_s,
                   help="seconds over which a routed request's share decays by half")
    p.add_argument("--weight-evict", type=float, default=w.evict,
                   help="weight of the pod's eviction pressure (from KV events) for the uncached part of a request")
    p.add_argument("--evict-halflife", type=float, default=w.evict_halflife_s,
                   help="seconds over which a reported eviction's weight decays by half")
    p.add_argument("--weight-share-new", type=float, default=w.share_new,
                   help="extra share weight, scaled by the part of the prompt no pod holds")
    p.add_argument("--private-guard", type=float, default=w.private_guard,
                   help="a follow-up whose cached prefix no other in-flight request shares may go to its pod "
                        "up to this multiple of the balance limit (1: off)")
    p.add_argument("--weight-affinity", type=float, default=w.affinity,
                   help="weight of the fraction of the request's own prompt that the pod holds")
    p.add_argument("--balance-abs", type=float, default=w.balance_abs)
    p.add_argument("--balance-rel", type=float, default=w.balance_rel)
    p.add_argument("--hot-limit-scope", choices=["hot", "all", "off"], default=w.hot_limit_scope,
                   help="which pods get the stricter balance limit max(rel * mean, mean + abs): those whose "
                        "matched prefix other in-flight requests share (hot), every pod, or none")
    p.add_argument("--pd-min-uncached", type=int, default=256,
                   help="selective P/D: skip the prefill pod when decode would compute fewer tokens than this")
    p.add_argument("--discovery", choices=["static", "k8s"], default="static")
    p.add_argument("--namespace", default="default")
    p.add_argument("--selector", default=None, help="label selector of worker EndpointSlices (k8s)")
    p.add_argument("--prefill-selector", default=None)
    p.add_argument("--decode-selector", default=None)
    p.add_argument("--port-name", default="http", help="EndpointSlice port name of the pods' HTTP port")
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--connect-timeout", type=float, default=2.0)
    p.add_argument("--read-timeout", type=float, default=600.0)
    p.add_argument("--max-retries", type=int, default=2)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let requests in flight finish before exiting "
                        "(keep it below the pod's grace period)")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The flags as a `RouterConfig`; ``--worker``/``--selector`` name pods of the engine's role "both"."""
    from kvmesh.services.router.config import RouterConfig, ScoringWeights, parse_pod_spec

    pods = tuple(parse_pod_spec(s, role, args.kv_events_port, args.kv_replay_port)
                 for role, lst in (("both", args.worker), ("prefill", args.prefill), ("decode", args.decode))
                 for s in lst)
    selectors = tuple((r, s) for r, s in (("both", args.selector), ("prefill", args.prefill_selector),
                                          ("decode", args.decode_selector)) if s)
    if args.discovery == "static" and not pods:
        raise ValueError("give --worker/--prefill/--decode URLs, or --discovery k8s --selector ...")
    if args.discovery == "k8s" and not selectors:
        raise ValueError("--discovery k8s needs --selector (and/or --prefill-selector/--decode-selector)")
    w = ScoringWeights(hit=args.weight_hit, load=args.weight_load, tokens=args.weight_tokens, kv=args.weight_kv,
                       share=args.weight_share, share_halflife_s=args.share_halflife,
                       evict=args.weight_evict, evict_halflife_s=args.evict_halflife,
                       affinity=args.weight_affinity, share_new=args.weight_share_new,
                       private_guard=args.private_guard,
                       balance_abs=args.balance_abs, balance_rel=args.balance_rel,
                       hot_limit_scope=args.hot_limit_scope)
    return RouterConfig(host=args.host, port=args.port, model=args.model, served_model_name=args.served_model_name,
                        block_size=args.block_size, policy=args.policy, weights=w,
                        pd_min_uncached=args.pd_min_uncached, pods=pods, discovery=args.discovery,
                        k8s_namespace=args.namespace, k8s_selectors=selectors, k8s_port_name=args.port_name,
                        kv_events_port=args.kv_events_port, kv_replay_port=args.kv_replay_port,
                        health_interval=args.health_interval, connect_timeout=args.connect_timeout,
                        read_timeout=args.read_timeout, max_retries=args.max_retries, log_level=args.log_level,
                        shutdown_timeout=args.shutdown_timeout)


def run(args: argparse.Namespace) -> int:
    import logging
    import os

    from kvmesh import aio

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=os.environ.get("KVMESH_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s [router] %(name)s: %(message)s")
    from kvmesh.services.router.app import serve

    try:
        return aio.run(serve(cfg))
    except KeyboardInterrupt:
        return 0
