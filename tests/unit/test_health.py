"""The one readiness wait: a deadline, and a dead process ends the wait at once (in a thread or an event loop)."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvmesh.health import NotReadyError, wait_until, wait_until_async

pytestmark = pytest.mark.unit


def test_wait_until_returns_once_ready():
    calls = iter([False, False, True])
    wait_until(lambda: next(calls), 5, "thing", poll=0.001)


def test_a_gone_process_ends_the_wait_before_the_deadline():
    asked = []
    with pytest.raises(NotReadyError, match="server exited with code 3"):
        wait_until(lambda: asked.append(1) or False, 60, "server", lambda: "exited with code 3")
    assert asked == []  # the dead process is seen before the first readiness poll, not at the deadline


def test_the_deadline_ends_the_wait():
    with pytest.raises(NotReadyError, match="not ready in 0.05 s"):
        wait_until(lambda: False, 0.05, "server", lambda: None, poll=0.01)


def test_the_async_wait_is_the_same_wait():
    """`wait_until_async` (servers waiting inside their event loop) checks as `wait_until` does."""
    calls = iter([False, False, True])
    asyncio.run(wait_until_async(lambda: next(calls), 5, "thing", poll=0.001))
    asked = []
    with pytest.raises(NotReadyError, match="engine exited with code 3"):
        asyncio.run(wait_until_async(lambda: asked.append(1) or False, 60, "engine", lambda: "exited with code 3"))
    assert asked == []
    with pytest.raises(NotReadyError, match="not ready in 0.05 s"):
        asyncio.run(wait_until_async(lambda: False, 0.05, "engine", poll=0.01))


def test_a_wait_without_deadline_still_ends_when_ready():
    calls = iter([False, True])
    wait_until(lambda: next(calls), math.inf, "thing", poll=0.001)
