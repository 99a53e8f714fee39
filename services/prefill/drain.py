"""A prefill pod's drain rule: hold on until the blocks it keeps for readers are gone.

By the time this runs the API server has stopped taking requests and finished its open ones. What is
left is a prefill pod's promise to decode pods: a finished prompt's blocks stay in its KV pool, under
a lease, until a decode pod has READ them (engine/connectors/nixl_leases.py). Leaving now would pull
the source out from under a decode pod mid-read, and that pod would recompute the prompt. So the
engine keeps stepping (a step collects READ notifications, releases and lease expiries) until
nothing is held or the drain deadline, the rest of the pod's grace period, passes.

A decode pod has no such rule: its streams are its open requests, and the API server finishes them
before the engine is asked to stop (`RolePolicy.drain_waits_for_leases` is False for it).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def hand_over(step: Callable[[], None], held: Callable[[], bool], deadline: float, pause_s: float = 0.005) -> bool:
    """Call ``step`` while ``held()`` says blocks are still held and ``time.monotonic()`` is before
    ``deadline``; True when nothing is held any more, False when the deadline cut the wait short."""
    while held() and time.monotonic() < deadline:
        step()
        time.sleep(pause_s)
    return not held()
