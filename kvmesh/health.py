"""Waiting for a started server to be ready: `kvmesh up`, the test and benchmark harnesses.

A wait has a deadline and watches what it waits for, so a server that died while loading
fails the wait at once (with its exit code) instead of after the whole timeout.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx

POLL_S = 0.3


class NotReadyError(RuntimeError):
    """The server died, or was not ready by the deadline."""


def exited(proc: subprocess.Popen) -> Callable[[], str | None]:
    """A ``gone`` check for `wait_until`: why ``proc`` is no longer running, or None while it is."""
    return lambda: None if proc.poll() is None else f"exited with code {proc.returncode}"


def wait_until(
    ready: Callable[[], bool],
    timeout: float,
    what: str,
    gone: Callable[[], str | None] | None = None,
    poll: float = POLL_S,
) -> None:
    """Call ``ready`` until it is true; `NotReadyError` once ``gone`` names a reason, or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        why = gone() if gone is not None else None
        if why is not None:
            raise NotReadyError(f"{what} {why}")
        if ready():
            return
        if time.monotonic() >= deadline:
            raise NotReadyError(f"{what} not ready in {timeout:g} s")
        time.sleep(poll)


def wait_healthy(
    url: str, timeout: float, proc: subprocess.Popen | None = None, what: str | None = None, path: str = "/health"
) -> None:
    """Wait until GET ``url + path`` answers 200, while ``proc`` (if given) keeps running."""

    def ok() -> bool:
        try:
            return httpx.get(url + path, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ok, timeout, what or url, exited(proc) if proc is not None else None)
