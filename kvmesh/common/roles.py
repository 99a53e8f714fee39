"""The roles a kvmesh worker serves: one engine, three ways of finishing a request.

``both`` runs prefill and decode; ``prefill`` keeps a finished prompt's blocks for a decode worker
to read; ``decode`` loads them. The engine, the API server, the router and the CLI all name them.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[str, ...] = ("both", "prefill", "decode")
