"""The SLO planner's arithmetic: how many prefill and decode pods the measured load needs.

Why pure (no I/O, no clock): every rule here is a place where peers' autoscalers went wrong
(cascading scale-up while new pods start, a stale series holding a pool up, flapping); a pure
function of (observation, history, time) makes each rule a unit test. operator/planner_loop.py
does the scraping, the draining and the writes.

Prefill: the pods' backlog of uncached prompt tokens (waiting and in flight,
``kvmesh:prompt_tokens_pending``) must be cleared within the TTFT target, and the arrival rate of
prompt tokens must be served with headroom, by pods that each compute ``rate_per_pod`` tokens/s
(measured from ``kvmesh:engine_computed_tokens`` over intervals in which the pods had a backlog,
so an idle pool does not read as a slow one).

Decode: each pod can run as many sequences as keep its ITL at the target (a line ITL = a + b *
batch fitted to (running, ITL) samples; proportional when only one batch size was seen), and the
pool's KV-cache use must stay under the KV target.

Pods that exist but are not Ready yet count as capacity: while any is pending the planner never
recommends more than the current count (reason HeldByPending), so slow starts do not cascade.
Stabilization follows the HPA: the applied count is at least the lowest recommendation of the
scale-up window and at most the highest of the scale-down window.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# Share of a pod's measured prefill rate the planner plans to use: the rest absorbs bursts.
PREFILL_HEADROOM = 0.8
# (running, itl) samples kept per decode pool for the ITL-vs-batch fit.
ITL_SAMPLES = 64


@dataclass(frozen=True)
class PodLoad:
    """One Ready pod's numbers over the last interval (the loop turns counters into rates)."""

    name: str
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    pending_prompt_tokens: float = 0.0  # uncached prompt tokens of waiting and running requests
    computed_tokens_per_s: float = 0.0  # tokens the model ran per second over the interval
    itl_s: float | None = None  # the target percentile of ITL over the interval (None: no tokens)
    ttft_s: float | None = None

    @property
    def load(self) -> float:
        """Ordering for the scale-down choice: the least loaded pod is drained first."""
        return self.running + self.waiting + self.pending_prompt_tokens / 1e6


@dataclass(frozen=True)
class RoleObservation:
    """What the loop saw of one role: the Deployment's replica count, how many of its pods are
    Ready and how many exist but are not Ready (starting), and the Ready pods' loads."""

    current: int
    ready: int
    pending: int
    pods: tuple[PodLoad, ...] = ()
    interval_s: float = 15.0


@dataclass(frozen=True)
class Targets:
    min_replicas: int
    max_replicas: int
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    ttft_s: float | None = None
    itl_s: float | None = None
    kv_usage: float | None = None


@dataclass(frozen=True)
class Decision:
    """The record written to status.autoscaling.<role>."""

    role: str
    desired: int
    current: int
    ready: int
    pending: int
    recommendation: int  # before stabilization and bounds
    signal: str
    reason: str
    limited: bool = False  # clamped by minReplicas / maxReplicas (condition ScalingLimited)


@dataclass
class RoleState:
    """What the planner remembers between ticks for one role."""

    history: deque[tuple[float, int]] = field(default_factory=deque)  # (time, recommendation)
    prefill_rate_per_pod: float | None = None  # tokens/s one busy prefill pod computes
    last_backlog: float | None = None
    itl_samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=ITL_SAMPLES))


def _fit_line(samples: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares itl = a + b * batch; None when the batches do not vary or b <= 0."""
    n = len(samples)
    if n < 2:
        return None
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    sxx = sum((x - mx) ** 2 for x, _ in samples)
    if sxx <= 1e-9:
        return None
    b = sum((x - mx) * (y - my) for x, y in samples) / sxx
    if b <= 0:
        return None
    return my - b * mx, b


def prefill_recommendation(obs: RoleObservation, t: Targets, st: RoleState) -> tuple[int | None, str, str]:
    """(pods needed, signal, why) for the prefill role; None when there is nothing to go by."""
    assert t.ttft_s is not None
    pods = obs.pods
    backlog = sum(p.pending_prompt_tokens for p in pods)
    computed = sum(p.computed_tokens_per_s for p in pods)
    # Measure a pod's rate only from intervals with work queued: an idle pod computes little
    # because it was given little, not because it is slow.
    busy = [p for p in pods if p.pending_prompt_tokens > 0 or p.waiting > 0]
    if busy:
        measured = sum(p.computed_tokens_per_s for p in busy) / len(busy)
        if measured > 0:  # a rise counts at once, a fall by half per interval (one slow interval is noise)
            prev = st.prefill_rate_per_pod
            st.prefill_rate_per_pod = measured if prev is None else max(measured, 0.5 * prev + 0.5 * measured)
    growth = 0.0 if st.last_backlog is None else (backlog - st.last_backlog) / max(obs.interval_s, 1e-3)
    st.last_backlog = backlog
    arrival = max(0.0, computed + growth)  # prompt tokens/s arriving
    rate = st.prefill_rate_per_pod
    signal = f"uncached_prompt_tokens={backlog:.0f} arrival={arrival:.0f}/s"
    if not pods:  # no Ready pod could be read: hold (absent data must never read as no load)
        return None, "no ready pods scraped", "NoMetrics"
    if rate is None:
        # No interval with a backlog yet, so no measured capacity: go by what the pods see. A pool
        # that never builds a backlog must still be able to shrink, or it would hold its peak size.
        signal += " rate_per_pod=unmeasured"
        ttfts = [p.ttft_s for p in pods if p.ttft_s is not None]
        idle = backlog == 0 and all(p.waiting == 0 for p in pods)
        if ttfts and max(ttfts) > t.ttft_s:
            return obs.current + 1, signal, "ScaleUp: TTFT over target"
        if idle and computed == 0:
            return 1, signal, "ScaleDown: no prompts arriving"
        if idle and ttfts and max(ttfts) < 0.5 * t.ttft_s:
            return max(1, obs.current - 1), signal, "ScaleDown: no backlog, TTFT under half its target"
        return obs.current, signal, "Stable: prefill rate not measured yet"
    signal += f" rate_per_pod={rate:.0f}/s"
    needed = max(backlog / t.ttft_s, arrival / PREFILL_HEADROOM)
    n = max(1, math.ceil(needed / rate - 1e-9))
    if n > obs.current:
        return n, signal, "ScaleUp: backlog over TTFT budget"
    if n < obs.current:
        return n, signal, "ScaleDown: prefill capacity idle"
    return n, signal, "Stable"


def decode_recommendation(obs: RoleObservation, t: Targets, st: RoleState) -> tuple[int | None, str, str]:
    """(pods needed, signal, why) for the decode role."""
    pods = obs.pods
    if not pods:
        return None, "no ready pods scraped", "NoMetrics"
    running = sum(p.running + p.waiting for p in pods)
    kv = sum(p.kv_usage for p in pods)
    for p in pods:
        if p.itl_s is not None and p.running > 0:
            st.itl_samples.append((p.running, p.itl_s))
    parts = [f"sequences={running:.0f}", f"kv_usage_sum={kv:.2f}"]
    n_itl = 0
    itl_reason = ""
    if t.itl_s is not None and running > 0:
        line = _fit_line(list(st.itl_samples))
        itls = [p.itl_s for p in pods if p.itl_s is not None]
        if line is not None:
            a, b = line
            per_pod = (t.itl_s - a) / b
            parts.append(f"itl={a * 1e3:.1f}ms+{b * 1e3:.2f}ms*batch")
        elif itls:
            itl = max(itls)
            per_pod = (running / len(pods)) * t.itl_s / itl
            parts.append(f"itl={itl * 1e3:.1f}ms")
        else:
            per_pod = math.inf
        if per_pod <= 0:
            per_pod = 1.0  # the floor alone is over target: one sequence per pod is the best there is
        parts.append(f"seqs_per_pod_at_target={per_pod:.1f}")
        n_itl = math.ceil(running / per_pod - 1e-9) if math.isfinite(per_pod) else 1
        itl_reason = "ScaleUp: ITL over target"
    n_kv = math.ceil(kv / t.kv_usage - 1e-9) if t.kv_usage else 0
    n = max(1, n_itl, n_kv)
    signal = " ".join(parts)
    if n > obs.current:
        return n, signal, itl_reason if n_itl >= n_kv else "ScaleUp: KV cache over target"
    if n < obs.current:
        return n, signal, "ScaleDown: decode capacity idle"
    return n, signal, "Stable"


def decide(role: str, obs: RoleObservation, t: Targets, st: RoleState, now: float) -> Decision:
    """One tick for one role: recommendation, pending credit, stabilization, bounds."""
    rec, signal, reason = (prefill_recommendation if role == "prefill" else decode_recommendation)(obs, t, st)
    current = obs.current
    if rec is None:  # nothing measured: hold what there is (bounds still apply)
        rec = current
    raw = rec
    if rec > current and obs.pending > 0:
        rec, reason = current, "HeldByPending"
    # HPA stabilization: remember the recommendation, then take the min over the scale-up window
    # and the max over the scale-down window.
    st.history.append((now, rec))
    horizon = max(t.scale_up_window_s, t.scale_down_window_s)
    while st.history and st.history[0][0] < now - horizon:
        st.history.popleft()
    up = min(r for ts, r in st.history if ts >= now - t.scale_up_window_s)
    down = max(r for ts, r in st.history if ts >= now - t.scale_down_window_s)
    desired = current
    if desired < up:
        desired = up
    if desired > down:
        desired = down
    if desired == current and rec != current and reason.startswith(("ScaleUp", "ScaleDown")):
        reason = "Stabilizing: " + reason
    limited = False
    if desired > t.max_replicas:
        desired, reason, limited = t.max_replicas, "AtMax", True
    elif desired < t.min_replicas:
        desired, reason, limited = t.min_replicas, "AtMin", True
    elif raw > t.max_replicas and desired == t.max_replicas:
        limited = True
        if reason != "HeldByPending":  # while pods start, that is the news (condition AbleToScale)
            reason = "AtMax"
    return Decision(
        role=role,
        desired=desired,
        current=current,
        ready=obs.ready,
        pending=obs.pending,
        recommendation=raw,
        signal=signal,
        reason=reason,
        limited=limited,
    )


def least_loaded(pods: tuple[PodLoad, ...]) -> PodLoad | None:
    """The pod to drain on a scale-down: least work to finish, ties by name for determinism."""
    return min(pods, key=lambda p: (p.load, p.name), default=None)
