"""The one readiness wait: `kvmesh up`, the servers themselves, the test and benchmark harnesses.

A wait has a deadline and watches what it waits for, so a server that died while loading
fails the wait at once (with its exit code) instead of after the whole timeout. `wait_until`
blocks its thread; `wait_until_async` is the same wait inside an event loop, which keeps serving
while it sleeps. `wait_healthy` waits for a server's ``/health``.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable

POLL_S = 0.3


class NotReadyError(RuntimeError):
    """The server died, or was not ready by the deadline."""


def exited(proc: subprocess.Popen) -> Callable[[], str | None]:
    """A ``gone`` check for `wait_until`: why ``proc`` is no longer running, or None while it is."""
    return lambda: None if proc.poll() is None else f"exited with code {proc.returncode}"


def _settled(
    ready: Callable[[], bool], gone: Callable[[], str | None] | None, what: str, deadline: float, timeout: float
) -> bool:
    """One look: True once ``ready``, `NotReadyError` once ``gone`` names a reason or the deadline passed."""
    why = gone() if gone is not None else None
    if why is not None:
        raise NotReadyError(f"{what} {why}")
    if ready():
        return True
    if time.monotonic() >= deadline:
        raise NotReadyError(f"{what} not ready in {timeout:g} s")
    return False


def wait_until(
    ready: Callable[[], bool],
    timeout: float,
    what: str,
    gone: Callable[[], str | None] | None = None,
    poll: float = POLL_S,
) -> None:
    """Call ``ready`` until it is true; `NotReadyError` once ``gone`` names a reason, or at the deadline
    (``timeout`` may be ``math.inf``)."""
    deadline = time.monotonic() + timeout
    while not _settled(ready, gone, what, deadline, timeout):
        time.sleep(poll)


async def wait_until_async(
    ready: Callable[[], bool],
    timeout: float,
    what: str,
    gone: Callable[[], str | None] | None = None,
    poll: float = POLL_S,
) -> None:
    """`wait_until` in an event loop: the same checks, sleeping with asyncio between them."""
    deadline = time.monotonic() + timeout
    while not _settled(ready, gone, what, deadline, timeout):
        await asyncio.sleep(poll)


def wait_healthy(
    url: str, timeout: float, proc: subprocess.Popen | None = None, what: str | None = None, path: str = "/health"
) -> None:
    """Wait until GET ``url + path`` answers 200, while ``proc`` (if given) keeps running."""
    import httpx  # the serve extra's: importing this module must not need it

    def ok() -> bool:
        try:
            return httpx.get(url + path, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ok, timeout, what or url, exited(proc) if proc is not None else None)
