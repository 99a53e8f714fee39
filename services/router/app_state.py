"""The router app's state: the `Router` itself, kept on ``app.state.router`` by `build_app`, and the
dependency its route modules (``routes_*.py``) read it through, instead of closures over `build_app`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .router import Router


async def current_router(request: Request) -> Router:
    """The app's `Router` (async: FastAPI would run a plain function in its thread pool)."""
    return request.app.state.router


AppRouter = Annotated[Router, Depends(current_router)]
