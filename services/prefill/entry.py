"""`kvmesh prefill`: the API server and engine with ``--role prefill`` (what that role does: this package)."""

from __future__ import annotations

from kvmesh.services.api.entry import add_parser


def register(sub) -> None:
    add_parser(sub, "prefill", "run the prefill role of the engine behind an OpenAI-compatible API", role="prefill")
