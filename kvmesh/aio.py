"""Run a server's coroutine on uvloop when it is installed (``uvicorn[standard]`` brings it).

The router and the API server spend their CPU in the event loop (HTTP parsing, socket
reads and writes, timers); uvloop's libuv loop does that work in C. ``KVMESH_UVLOOP=0``
keeps the standard asyncio loop (comparisons, debugging).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from kvmesh.common.env import env


def run(main: Coroutine[Any, Any, Any]) -> Any:
    if env().uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)
