"""Shedding: how long new work would wait, from what is queued ahead and measured rates.

A server that queues everything answers a flood with minutes of latency and no signal to slow
down; one that refuses what it cannot start within a deadline answers at once, with a
``Retry-After`` that says when the queue will have drained enough. Both the engine process (the
pod's scheduler queue, services/api/engine_proc.py) and the router (its admission queue,
services/router/admission.py) estimate the wait the same way: work ahead divided by the rate at
which it has been done lately, an exponentially weighted mean (`RateMeter`).

Before any rate is measured (a cold pod hit by a burst) there is nothing to divide by; then the
pod admits while its waiting queue is at most one batch (``max_num_seqs``) deep, which a pod
always starts within a few steps, and the router falls back to its queue's count bound.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

# A rate is an EWMA over windows of at least this many seconds (shorter ones are noise: one
# engine step, one burst of finishes), each window weighing ``ALPHA`` against the history.
WINDOW_S = 0.5
ALPHA = 0.3


class RateMeter:
    """Events per second (tokens computed, requests finished), measured only while busy.

    `add` counts events; the rate is folded into the EWMA once a window of busy time has passed.
    Idle time is left out (`idle` ends a window without counting the gap), so a pod that was quiet
    for an hour still knows how fast it serves. `rate` is None until a first window closed."""

    __slots__ = ("_clock", "_count", "_start", "rate")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._count = 0.0
        self._start: float | None = None
        self.rate: float | None = None

    def add(self, n: float = 1.0) -> None:
        now = self._clock()
        if self._start is None:
            self._start = now
        self._count += n
        self._fold(now)

    def tick(self) -> None:
        """A busy moment with nothing counted (a step that finished no request)."""
        now = self._clock()
        if self._start is None:
            self._start = now
        self._fold(now)

    def idle(self) -> None:
        """Nothing is in flight: close the current window now, so the idle gap is not counted."""
        if self._start is not None:
            self._fold(self._clock(), force=True)
        self._start = None
        self._count = 0.0

    def _fold(self, now: float, force: bool = False) -> None:
        assert self._start is not None
        dt = now - self._start
        if dt < WINDOW_S and not (force and dt > 0 and self._count > 0):
            return
        if dt <= 0 or (self.rate is None and self._count == 0):
            return  # the first rate waits for a first event: a busy start is no evidence of a zero rate
        r = self._count / dt
        self.rate = r if self.rate is None else (1 - ALPHA) * self.rate + ALPHA * r
        self._start, self._count = now, 0.0


def retry_after(wait_s: float, deadline_s: float) -> int:
    """Seconds until a queue estimated at ``wait_s`` has drained below ``deadline_s`` (>= 1): what
    a refused client should wait before it tries again, computed from the queue, never a constant."""
    return max(1, math.ceil(wait_s - deadline_s))


@dataclass(frozen=True)
class PodLoad:
    """What the engine holds when a new request arrives (the scheduler's own counts)."""

    waiting: int  # requests queued ahead (not scheduled yet)
    running: int
    max_num_seqs: int
    max_num_batched_tokens: int  # a step's token budget (--max-num-batched-tokens)
    prompt_tokens_pending: int  # prompt tokens still to compute over waiting and running requests
    free_blocks: int
    total_blocks: int
    blocks_needed: int  # blocks the waiting requests' and this request's prompts need to start


def estimate_pod_wait(load: PodLoad, token_rate: float | None, finish_rate: float | None) -> float | None:
    """Seconds before a request arriving now is first scheduled, or None while no rate is measured.

    Three things hold it back, and it waits for the slowest (they drain at the same time):

    - the prefill backlog ahead of it: the scheduler fills each step's token budget with the running
      requests, then the waiting ones in order, so a request arriving now starts in the first step the
      backlog leaves room in. The prompt tokens of the full steps before that one, over ``token_rate``
      (tokens computed per second, prefill and decode: a step's budget is shared); a backlog that the
      next step takes delays it by no step. (The whole backlog over the rate made a prompt that a
      decode pod took over from a dead peer read as tens of seconds, its rate measured over one-token
      decode steps, and it shed new work at two requests in flight.)
    - a sequence slot: past ``max_num_seqs`` running, each request ahead needs one request to
      finish, ``(waiting + 1 - free slots) / finish_rate``;
    - KV capacity: blocks the queue needs beyond the free ones come back as running requests
      finish, each freeing its share of the used blocks (``used / running``).
    """
    waits = [0.0]
    room = max(1, load.max_num_batched_tokens - load.running)  # prompt tokens a step takes (1 per running seq)
    ahead = load.prompt_tokens_pending // room * room  # in the full steps before the one it starts in
    if ahead > 0:
        if not token_rate:
            return None
        waits.append(ahead / token_rate)
    slots_short = load.waiting + 1 - max(0, load.max_num_seqs - load.running)
    blocks_short = load.blocks_needed - load.free_blocks
    if slots_short > 0 or blocks_short > 0:
        if not finish_rate:
            return None
        if slots_short > 0:
            waits.append(slots_short / finish_rate)
        if blocks_short > 0:
            per_request = max(1.0, (load.total_blocks - load.free_blocks) / max(1, load.running))
            waits.append(blocks_short / per_request / finish_rate)
    return max(waits)


@dataclass(frozen=True)
class Shed:
    """A refusal: the estimated wait and the ``Retry-After`` it implies."""

    wait_s: float
    retry_after_s: int
    message: str


class PodAdmission:
    """The engine process's deadline check, with the rates it measures from its own steps.

    ``deadline_s`` 0 turns it off. `check` is called before a request enters the scheduler;
    `observe_step` after each engine step with the tokens it computed and requests it finished."""

    def __init__(self, deadline_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.deadline_s = deadline_s
        self.tokens = RateMeter(clock)
        self.finishes = RateMeter(clock)
        self.refused = 0

    def busy(self) -> None:
        """A step starts: the rates' windows run from here (its own counts come with `observe_step`)."""
        self.tokens.tick()
        self.finishes.tick()

    def observe_step(self, tokens: int, finished: int) -> None:
        self.tokens.add(tokens)
        self.finishes.add(finished) if finished else self.finishes.tick()

    def idle(self) -> None:
        self.tokens.idle()
        self.finishes.idle()

    def estimate(self, load: PodLoad) -> float | None:
        return estimate_pod_wait(load, self.tokens.rate, self.finishes.rate)

    def check(self, load: PodLoad, budget_s: float | None = None) -> Shed | None:
        """None: admit. Otherwise the refusal (HTTP 503 with its ``Retry-After``). ``budget_s``: what is
        left of the request's deadline after the router held it (services/errors.QUEUE_BUDGET_HEADER),
        which lowers this pod's own for it."""
        if self.deadline_s <= 0:
            return None
        deadline = self.deadline_s if budget_s is None else min(self.deadline_s, max(0.0, budget_s))
        wait = self.estimate(load)
        if wait is None:
            # No rate yet: admit a batch's worth of waiters, which the pod starts within a few steps.
            if load.waiting < max(1, load.max_num_seqs):
                return None
            self.refused += 1
            return Shed(
                self.deadline_s,
                max(1, math.ceil(WINDOW_S)),  # a rate is measured within a window
                f"the engine has measured no rate yet and {load.waiting} requests wait (one batch, "
                f"--max-num-seqs {load.max_num_seqs}, is what it admits before it can estimate a wait)",
            )
        if wait <= deadline:
            return None
        self.refused += 1
        return Shed(
            wait,
            retry_after(wait, deadline),
            f"the engine estimates a wait of {wait:.1f} s before it could start this request, over its "
            f"deadline of {deadline:g} s (--max-queue-wait-s, or what the router's hold left; {load.waiting} "
            f"waiting, {load.running} running, {load.prompt_tokens_pending} prompt tokens pending, "
            f"{load.free_blocks} KV blocks free of {load.blocks_needed} needed)",
        )
