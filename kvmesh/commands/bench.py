"""`kvmesh bench serve` (load a live server), `kvmesh bench offline` (the engine in-process) and
`kvmesh bench router` (a trace through several routers against simulated instances) and
`kvmesh bench autoscale` (a load ramp under the planner, a static pool and the HPA on CPU) and
`kvmesh bench fuzz` (schemathesis and malformed requests against a live server and router)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_command")

    s = bsub.add_parser("serve", help="load an OpenAI-compatible server and report latency percentiles")
    from kvmesh import bench_serve  # light: heavy imports (httpx, tqdm, matplotlib) happen in run()

    bench_serve.add_args(s)
    s.set_defaults(func=_run_serve)

    o = bsub.add_parser("offline", help="throughput of the engine in-process")
    from kvmesh import bench_offline

    bench_offline.register_args(o)
    o.set_defaults(func=bench_offline.run)
    r = bsub.add_parser("router", help="replay a Mooncake trace against simulated instances through several routers")
    from kvmesh import bench_router  # light: heavy imports happen in run()

    bench_router.add_args(r)
    r.set_defaults(func=_run_router)
    a = bsub.add_parser(
        "autoscale", help="one load ramp through simulated workers under the planner, a static pool and the HPA"
    )
    from kvmesh import bench_autoscale  # light: heavy imports happen in run()

    bench_autoscale.add_args(a)
    a.set_defaults(func=_run_autoscale)
    f = bsub.add_parser("fuzz", help="schemathesis and malformed requests against a live server and router")
    from kvmesh import bench_fuzz  # light: schemathesis is imported in run()

    bench_fuzz.add_args(f)
    f.set_defaults(func=_run_fuzz)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _run_autoscale(args: argparse.Namespace) -> int:
    from kvmesh import bench_autoscale

    return bench_autoscale.run(args)


def _run_fuzz(args: argparse.Namespace) -> int:
    from kvmesh import bench_fuzz

    return bench_fuzz.run(args)


def _run_router(args: argparse.Namespace) -> int:
    from kvmesh import bench_router

    return bench_router.run(args)


def _run_serve(args: argparse.Namespace) -> int:
    from kvmesh import bench_serve

    return bench_serve.run(args)
