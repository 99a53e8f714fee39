"""The `kvmesh` command. Each subcommand lives in `kvmesh.commands.<name>` and exposes
``register(subparsers)``; commands import their heavy dependencies only when run."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("generate", "serve", "prefill", "decode", "router", "up", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="Kubernetes-native LLM serving")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"kvmesh.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"kvmesh.commands.{name}":
                continue  # not built yet
            raise
        mod.register(sub)
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
