"""The `kvmesh` command. Each subcommand's module exposes ``register(subparsers)``: the serving roles'
in their rooms (services/api/, services/prefill/, services/decode/), the rest in `kvmesh.commands`;
commands import their heavy dependencies only when run."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "generate": "kvmesh.commands.generate",
    "serve": "kvmesh.services.api.entry",
    "prefill": "kvmesh.services.prefill.entry",
    "decode": "kvmesh.services.decode.entry",
    "router": "kvmesh.services.router.entry",
    "rank": "kvmesh.commands.rank",
    "up": "kvmesh.commands.up",
    "bench": "kvmesh.commands.bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="Kubernetes-native LLM serving")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    for module in COMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from kvmesh import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
