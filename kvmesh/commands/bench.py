"""`kvmesh bench <name>`: the benchmarks of `kvmesh.bench` (the repository's bench/ folder).

`kvmesh bench serve` (load a live server), `kvmesh bench offline` (the engine in-process),
`kvmesh bench router` (a trace through several routers against simulated or real instances, or the
routers' own cost), `kvmesh bench autoscale` (a load ramp under the planner, a static pool and the HPA
on CPU), `kvmesh bench fuzz` (schemathesis and malformed requests against a live server and router)
and `kvmesh bench tp` (tensor-parallel sizes side by side).

Every command of the CLI is registered on each start (`kvmesh.cli`), so a benchmark's module is
imported only once its name is on the command line: `kvmesh router` and the rest never load the
benchmarks (or need them installed).
"""

from __future__ import annotations

import argparse
import importlib

# name (of the `kvmesh.bench` module too) -> help; each module has add_args(parser) and run(args) -> int.
BENCHES = {
    "serve": "load an OpenAI-compatible server and report latency percentiles",
    "offline": "throughput of the engine in-process",
    "router": "replay a Mooncake trace against simulated (or real) instances through several routers, or measure "
    "the routers' own cost",
    "autoscale": "one load ramp through simulated workers under the planner, a static pool and the HPA",
    "fuzz": "schemathesis and malformed requests against a live server and router",
    "tp": "one model on 1 and on N tensor-parallel ranks: step times side by side, tokens checked equal",
}


class _BenchParser(argparse.ArgumentParser):
    """One benchmark's parser: its flags and entry point come from its module, imported when argparse
    hands this parser its arguments, i.e. only when that benchmark was named."""

    def __init__(self, *args, module: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._module: str | None = module

    def parse_known_args(self, args=None, namespace=None):
        if self._module is not None:
            mod = importlib.import_module(f"kvmesh.bench.{self._module}")
            self._module = None
            mod.add_args(self)
            self.set_defaults(func=mod.run)
        return super().parse_known_args(args, namespace)


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_command", parser_class=_BenchParser)
    for name, help in BENCHES.items():
        bsub.add_parser(name, help=help, module=name)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
