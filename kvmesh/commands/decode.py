"""`kvmesh decode`: `kvmesh serve --role decode` (the same engine and API server, another role;
what a decode pod does is services/decode/)."""

from __future__ import annotations

from kvmesh.engine.args import EngineArgs

from .serve import add_server_args, run


def register(sub) -> None:
    p = sub.add_parser("decode", help="run the decode role of the engine behind an OpenAI-compatible API")
    add_server_args(p, default_role="decode")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)
