"""The API server's state, one typed object its route modules share.

`build_app` makes one `ServerState` and keeps it on ``app.state.server``; each route module
(``routes_*.py``) reads it with `server_state`. So the routes are plain module-level functions
grouped by concern, not closures over `build_app`'s locals, and the app can still be built around
any engine client (the unit tests build it around a fake one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from . import wire
from .engine_client import EngineClient
from .metrics import ServerMetrics
from .serving import Serving


@dataclass
class ServerState:
    client: EngineClient
    serving: Serving
    tokenizer: Any
    metrics: ServerMetrics
    ready: wire.Ready  # the engine's announcement: model name, context length, number formats
    served: list[str]  # the model names /v1/models lists and requests may name
    # POST /drain sets it: /health answers 503 so routers stop sending new work; DELETE /drain clears it.
    draining: bool = False

    def unavailable(self) -> str:
        """The message of a 503 while the engine is down or still loading."""
        return f"engine is not available: {self.client.dead_reason or 'starting'}"


def server_state(request: Request) -> ServerState:
    """The app's `ServerState`. A route takes the `Request` and calls this: as a FastAPI dependency
    (``Depends``) the same attribute read costs about 15 µs a request."""
    return request.app.state.server
