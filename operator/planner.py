"""The SLO planner's arithmetic: how many prefill and decode pods the measured load needs.

Why pure (no I/O, no clock): every rule here is a place where peers' autoscalers went wrong
(cascading scale-up while new pods start, a stale series holding a pool up, flapping); a pure
function of (observation, history, time) makes each rule a unit test. operator/planner_loop.py
does the scraping, the draining and the writes.

Prefill: the pods' backlog of uncached prompt tokens (waiting and in flight,
``kvmesh:prompt_tokens_pending``) must be cleared within the TTFT target, and the arrival rate of
prompt tokens must be served with headroom, by pods that each compute ``rate_per_pod`` tokens/s
(measured from ``kvmesh:engine_computed_tokens`` over intervals in which the pods had a backlog,
so an idle pool does not read as a slow one). A pool that serves prompts as they come never shows
a backlog; until it does, a pod's rate is estimated as the tokens computed per request (per first
token) over the TTFT percentile, i.e. as if each request's prefill took all of its TTFT, which
errs towards more pods once requests queue (a lower estimate counts at once, a higher one by
half; an interval without a first token keeps the last).

Decode: each pod can run as many sequences as keep its ITL at the target (a line ITL = a + b *
batch fitted to (running, ITL) samples; proportional when only one batch size was seen), and the
pool's KV-cache use must stay under the KV target.

Headroom: both rules plan for ``target_utilization`` of a pod's capacity at the SLO targets
(prefill: of its measured rate; decode: of the sequences it runs at the ITL target), not all of it.

Forecast: a new pod serves only a lead time after the decision (start, load, Ready), so a planner
that reacts to today's load is late for a rising one by that much. Each tick the arriving work
(tokens computed per second plus the growth of the prompt backlog, summed over the pods) joins a
window of ``forecast_window_s`` (at least three intervals); when a least-squares line through it
rises significantly (slope over twice its standard error: Poisson noise on a flat load does not
pass) the rule's load is
scaled by the ratio of the line's value one horizon ahead (lead time + one interval) to its value
now, at most doubled. Only upward: scale-down stays on what is measured, behind its window. The lead time is
measured from the pods the planner started (decision to Ready, as the planner saw them), starting
from ``lead_s`` until one has been seen.

Pods that exist but are not Ready yet count as capacity: while any is pending the planner never
recommends more than the current count (reason HeldByPending), so slow starts do not cascade.
Stabilization follows the HPA: the applied count is at least the lowest recommendation of the
scale-up window and at most the highest of the scale-down window.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# (running, itl) samples kept per decode pool for the ITL-vs-batch fit.
ITL_SAMPLES = 64
# A trend counts when its slope is this many standard errors above zero.
TREND_T = 2.0
# The forecast at most doubles the load (the HPA's default scale-up policy allows +100 % a period): a
# line fitted through a step from idle would otherwise extrapolate it far beyond what comes.
MAX_GROWTH = 2.0


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
    first_tokens_per_s: float = 0.0  # requests that got their first token, per second of the interval

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
    target_utilization: float = 0.8  # share of a pod's capacity at the SLO targets planned for
    forecast_window_s: float = 60.0  # trend of the arriving work fitted over this window; 0: no forecast
    lead_s: float = 60.0  # decision to new pods Ready, until measured from the pods started


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
    prefill_rate_estimate: float | None = None  # the same estimated from TTFT while never measured
    last_backlog: float | None = None
    itl_samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=ITL_SAMPLES))
    arrivals: deque[tuple[float, float]] = field(default_factory=deque)  # (time, work arriving per s)
    scaled_up_at: float | None = None  # the tick that last asked for more pods, until they are Ready
    scaled_up_to: int = 0  # how many it asked for
    lead_s: float | None = None  # measured: that tick to the tick that saw them all Ready


def _fit_line(samples: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares y = a + b * x (ITL over batch, arriving work over time); None when x does not
    vary or b <= 0."""
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


def arrival_rate(obs: RoleObservation, st: RoleState) -> float:
    """Work arriving per second over the last interval: tokens the pods computed plus the growth of
    their prompt backlog (what came in but could not be computed yet). Updates ``st.last_backlog``."""
    backlog = sum(p.pending_prompt_tokens for p in obs.pods)
    growth = 0.0 if st.last_backlog is None else (backlog - st.last_backlog) / max(obs.interval_s, 1e-3)
    st.last_backlog = backlog
    return max(0.0, sum(p.computed_tokens_per_s for p in obs.pods) + growth)


def forecast_growth(samples: list[tuple[float, float]], now: float, horizon_s: float) -> float:
    """How much the arriving work will have grown ``horizon_s`` from ``now``: the ratio of a
    least-squares line through ``samples`` there to its value now, at most ``MAX_GROWTH``; 1.0
    unless at least three samples rise with a slope over ``TREND_T`` standard errors (a flat or
    noisy series never forecasts growth, a falling one never forecasts a drop)."""
    n = len(samples)
    fit = _fit_line(samples) if n >= 3 else None  # None: x does not vary, or no rise
    if fit is None:
        return 1.0
    a, b = fit
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    sxx = sum((x - mx) ** 2 for x, _ in samples)
    resid = sum((y - a - b * x) ** 2 for x, y in samples) / (n - 2)
    if b < TREND_T * math.sqrt(resid / sxx):
        return 1.0
    level = max(a + b * now, my, 1e-9)  # the line now; the mean guards a line that starts near 0
    return min(MAX_GROWTH, max(1.0, (a + b * (now + horizon_s)) / level))


def _rate_from_ttft(pods: tuple[PodLoad, ...]) -> float | None:
    """Tokens/s one pod prefills, estimated from the interval's requests: tokens computed per first
    token over the slowest pod's TTFT percentile; None without requests that got a first token."""
    ttfts = [p.ttft_s for p in pods if p.ttft_s is not None and p.ttft_s > 0 and p.first_tokens_per_s > 0]
    firsts = sum(p.first_tokens_per_s for p in pods)
    if not ttfts or firsts <= 0:
        return None
    per_request = sum(p.computed_tokens_per_s for p in pods) / firsts
    return per_request / max(ttfts) if per_request > 0 else None


def prefill_recommendation(
    obs: RoleObservation, t: Targets, st: RoleState, arrival: float
) -> tuple[int | None, str, str, float | None]:
    """(pods needed, signal, why, load in pods) for the prefill role; None when there is nothing to
    go by. The load in pods (before rounding up) is what the forecast scales; None when the rule
    had no measured rate to express it in."""
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
    rate = st.prefill_rate_per_pod
    signal = f"uncached_prompt_tokens={backlog:.0f} arrival={arrival:.0f}/s"
    if not pods:  # no Ready pod could be read: hold (absent data must never read as no load)
        return None, "no ready pods scraped", "NoMetrics", None
    estimated = rate is None
    if rate is None:
        est, prev = _rate_from_ttft(pods), st.prefill_rate_estimate
        if est is not None:  # a fall counts at once, a rise by half (errs towards more pods)
            st.prefill_rate_estimate = est if prev is None else min(est, 0.5 * prev + 0.5 * est)
        rate = st.prefill_rate_estimate  # an interval without a first token keeps the last one
        if rate is not None:
            signal += f" rate_per_pod~{rate:.0f}/s(from TTFT)"
    else:
        signal += f" rate_per_pod={rate:.0f}/s"
    if rate is None:
        # No interval with a backlog yet, so no measured capacity: go by what the pods see. A pool
        # that never builds a backlog must still be able to shrink, or it would hold its peak size.
        signal += " rate_per_pod=unmeasured"
        ttfts = [p.ttft_s for p in pods if p.ttft_s is not None]
        idle = backlog == 0 and all(p.waiting == 0 for p in pods)
        if ttfts and max(ttfts) > t.ttft_s:
            return obs.current + 1, signal, "ScaleUp: TTFT over target", None
        if idle and computed == 0:
            return 1, signal, "ScaleDown: no prompts arriving", None
        if idle and ttfts and max(ttfts) < 0.5 * t.ttft_s:
            return max(1, obs.current - 1), signal, "ScaleDown: no backlog, TTFT under half its target", None
        return obs.current, signal, "Stable: prefill rate not measured yet", None
    load = max(backlog / t.ttft_s, arrival / t.target_utilization) / rate
    n = max(1, math.ceil(load - 1e-9))
    ttft_over = estimated and any(p.ttft_s is not None and p.ttft_s > t.ttft_s for p in pods)
    if ttft_over and n <= obs.current:  # the estimate is rough; a missed target is not
        return obs.current + 1, signal, "ScaleUp: TTFT over target", load
    if n > obs.current:
        why = (
            "backlog over TTFT budget"
            if backlog / t.ttft_s >= arrival / t.target_utilization
            else "arrival over capacity"
        )
        return n, signal, f"ScaleUp: {why}", load
    if n < obs.current:
        return n, signal, "ScaleDown: prefill capacity idle", load
    return n, signal, "Stable", load


def decode_recommendation(
    obs: RoleObservation, t: Targets, st: RoleState, arrival: float
) -> tuple[int | None, str, str, float | None]:
    """(pods needed, signal, why, load in pods) for the decode role."""
    pods = obs.pods
    if not pods:
        return None, "no ready pods scraped", "NoMetrics", None
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
        itl_load = running / (per_pod * t.target_utilization) if math.isfinite(per_pod) else 0.0
        n_itl = math.ceil(itl_load - 1e-9) if math.isfinite(per_pod) else 1
        itl_reason = "ScaleUp: ITL over target"
    else:
        itl_load = 0.0
    kv_load = kv / t.kv_usage if t.kv_usage else 0.0
    n_kv = math.ceil(kv_load - 1e-9)
    n = max(1, n_itl, n_kv)
    signal = " ".join(parts)
    load = max(itl_load, kv_load)
    if n > obs.current:
        return n, signal, itl_reason if n_itl >= n_kv else "ScaleUp: KV cache over target", load
    if n < obs.current:
        return n, signal, "ScaleDown: decode capacity idle", load
    return n, signal, "Stable", load


def _measure_lead(obs: RoleObservation, st: RoleState, now: float) -> None:
    """Decision to Ready, from the pods this planner asked for: the tick that asked, to the first
    tick that sees no pod pending (the pods serve from then on, as far as the planner can tell)."""
    if st.scaled_up_at is None or obs.pending > 0 or obs.ready < obs.current:
        return
    if obs.current >= st.scaled_up_to:  # else the scale-up was not applied: nothing to measure
        st.lead_s = now - st.scaled_up_at
    st.scaled_up_at = None


def decide(role: str, obs: RoleObservation, t: Targets, st: RoleState, now: float) -> Decision:
    """One tick for one role: recommendation, forecast, pending credit, stabilization, bounds."""
    _measure_lead(obs, st, now)
    arrival = arrival_rate(obs, st)
    if obs.pods:  # a tick with nothing scraped says nothing about the load
        st.arrivals.append((now, arrival))
    window = max(t.forecast_window_s, 3 * obs.interval_s)  # a trend needs three samples
    while st.arrivals and st.arrivals[0][0] < now - window:
        st.arrivals.popleft()
    rule = prefill_recommendation if role == "prefill" else decode_recommendation
    rec, signal, reason, load = rule(obs, t, st, arrival)
    current = obs.current
    if rec is None:  # nothing measured: hold what there is (bounds still apply)
        rec = current
    if t.forecast_window_s > 0 and load is not None:
        lead = st.lead_s if st.lead_s is not None else t.lead_s
        horizon = lead + obs.interval_s  # the pods asked for now serve from then until the next ones can
        growth = forecast_growth(list(st.arrivals), now, horizon)
        if growth > 1.0:
            ahead = math.ceil(load * growth - 1e-9)
            signal += f" forecast=x{growth:.2f}@{horizon:.0f}s"
            if ahead > max(rec, current):
                rec, reason = ahead, f"ScaleUp: load forecast {growth:.2f}x in {horizon:.0f}s"
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
    if desired > current and st.scaled_up_at is None:
        st.scaled_up_at, st.scaled_up_to = now, desired
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
