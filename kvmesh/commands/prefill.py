"""`kvmesh prefill`: `kvmesh serve --role prefill` (the same engine and API server, another role;
what a prefill pod does is services/prefill/)."""

from __future__ import annotations

from kvmesh.engine.args import EngineArgs

from .serve import add_server_args, run


def register(sub) -> None:
    p = sub.add_parser("prefill", help="run the prefill role of the engine behind an OpenAI-compatible API")
    add_server_args(p, default_role="prefill")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)
