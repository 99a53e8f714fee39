"""`kvmesh decode`: the API server and engine with ``--role decode`` (what that role does: this package)."""

from __future__ import annotations

from kvmesh.services.api.entry import add_parser


def register(sub) -> None:
    add_parser(sub, "decode", "run the decode role of the engine behind an OpenAI-compatible API", role="decode")
