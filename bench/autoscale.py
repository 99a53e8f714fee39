"""`kvmesh bench autoscale`: one fixed open-loop ramp (low -> a linear rise -> peak -> low req/s)
through a real router in front of real `kvmesh serve --simulate` workers, run once per scaling policy:

* planner: every interval the workers' /metrics become `RoleObservation`s exactly as the
  operator's loop builds them (`operator.planner_loop.pod_load`), and `operator.planner.decide`
  gives the count, with the operator's defaults for the headroom (target utilization 0.8) and the
  forecast (60 s trend window; the lead time measured from the workers it started, ``--scale-up-lead``
  until then, the CRD's scaleUpLeadSeconds). The workers are aggregated (prefill and decode on
  one process: P/D would need a connector per pair, too much for a 2-core box), so both of the
  planner's rules read the same pods, the prefill rule (uncached-prompt backlog vs measured rate,
  TTFT target) and the decode rule (ITL vs batch), and the pool gets the larger of the two.
* static: the pool sized for the peak (``--max-workers``) the whole run.
* hpa: the Kubernetes HPA on CPU, ``desired = ceil(current * avgCPU / target)`` with its 10 %
  tolerance and scale-down stabilization, on the workers' real CPU use (/proc/<pid>/stat of the
  worker's process group, as a fraction of ``--hpa-cpu-request`` cores).

Scaling mechanics are the operator's: a new worker is pending until its /health answers 200, then
it is added to the router; no further scale-up while any is pending (the planner's own rule; the
HPA counts pending pods' CPU as 0). A scale-down drains the least-loaded worker: it leaves the
router at once (the operator's routable=false label takes it out of the Service), gets POST
/drain, and is stopped when GET /drain says idle.

Why local processes rather than pods: the decision and its inputs are the same code and the same
series as in the cluster; what a cluster adds (pod scheduling, image pull) only lengthens the time
to Ready, which is reported separately.

SLO per request: TTFT <= ``--ttft-target`` and mean ITL (first to last token) <= ``--itl-target``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.bench.router import Proc

POLICIES = ("planner", "static", "hpa")
# Open-loop ramp scaled to a 2-core box: RATE:SECONDS, or FROM-TO:SECONDS for a linear change (the
# shape of a real rise, e.g. 2 -> 10 -> 1 req/s, rather than an instant step).
DEFAULT_PHASES = "0.6:45,0.6-3:30,3:60,0.3:45"
QUICK_PHASES = "0.5:15,0.5-3:15,3:20,0.3:20"
HPA_TOLERANCE = 0.1
WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word"
).split()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--phases",
        default=DEFAULT_PHASES,
        help="RATE:SECONDS or FROM-TO:SECONDS (linear),... open-loop Poisson arrivals per phase",
    )
    p.add_argument("--quick", action="store_true", help=f"a 1-minute smoke run (phases {QUICK_PHASES})")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list of planner, static, hpa")
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--max-workers", type=int, default=3, help="the static pool, and the bound of the others")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between scaling decisions")
    p.add_argument("--scale-down-window", type=float, default=20.0, help="scale-down stabilization, s")
    p.add_argument("--prompt-words", type=int, default=200, help="words per prompt (about one token each)")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--sim-prefill-ms-per-token", type=float, default=1.5)
    p.add_argument("--sim-decode-ms", default="25,2.0", help="workers' BASE,PER_SEQ step cost, ms")
    p.add_argument("--ttft-target", type=float, default=2.0, help="TTFT SLO, s (planner target, p90)")
    p.add_argument("--itl-target", type=float, default=0.3, help="mean-ITL SLO, s (planner target, p50)")
    from kvmesh.operator.spec import AutoscalingSpec  # the CRD's defaults

    p.add_argument(
        "--target-utilization",
        type=float,
        default=AutoscalingSpec.target_utilization,
        help="planner: share of a pod's capacity planned for",
    )
    p.add_argument(
        "--forecast-window",
        type=float,
        default=float(AutoscalingSpec.forecast_window_s),
        help="planner: trend window, s (0: no forecast)",
    )
    p.add_argument(
        "--scale-up-lead",
        type=float,
        default=10.0,
        help="planner: scale-up to Ready, s, until measured (a simulated worker's start here)",
    )
    p.add_argument("--hpa-cpu-target", type=float, default=0.6, help="HPA target CPU utilization")
    p.add_argument("--hpa-cpu-request", type=float, default=0.5, help="a worker's CPU request, cores")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench/results/autoscale.json")
    p.add_argument("--png", default="bench/results/autoscale.png")
    p.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "kvmesh-bench-autoscale-logs"))


# ---- pure parts (unit-tested) ------------------------------------------------------------
Phase = tuple[float, float, float]  # (req/s at the start, req/s at the end, seconds)


def parse_phases(text: str) -> list[Phase]:
    out = []
    for part in text.split(","):
        rate, _, secs = part.partition(":")
        r0, dash, r1 = rate.partition("-")
        try:
            a, s = float(r0), float(secs)
            b = float(r1) if dash else a
        except ValueError:
            raise ValueError(f"--phases wants RATE:SECONDS or FROM-TO:SECONDS,..., got {part!r}") from None
        if a <= 0 or b <= 0 or s <= 0:
            raise ValueError(f"--phases: rates and seconds must be > 0, got {part!r}")
        out.append((a, b, s))
    return out


def format_phases(phases: list[Phase]) -> str:
    return ",".join(f"{a:g}:{s:g}" if a == b else f"{a:g}-{b:g}:{s:g}" for a, b, s in phases)


def arrivals(phases: list[Phase], seed: int) -> list[float]:
    """Poisson arrival times (s from the start) of the ramp, the same for every policy; a linear
    phase by thinning (candidates at its higher rate, each kept with probability rate(t) / that)."""
    rng = random.Random(seed)
    out, t0 = [], 0.0
    for a, b, secs in phases:
        top = max(a, b)
        t = t0 + rng.expovariate(top)
        while t < t0 + secs:
            if a == b or rng.random() * top < a + (b - a) * (t - t0) / secs:
                out.append(t)
            t += rng.expovariate(top)
        t0 += secs
    return out


def hpa_desired(current: int, utilizations: list[float], target: float, tolerance: float = HPA_TOLERANCE) -> int:
    """The HPA's recommendation: ``ceil(current * mean(util) / target)``, or ``current`` while the
    ratio is within the tolerance. Only Ready pods report; pending ones count as 0 % (what the HPA
    does on a scale-up), so the sum over Ready pods decides."""
    if not utilizations:
        return current
    ratio = statistics.fmean(utilizations) / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    return max(1, math.ceil(sum(utilizations) / target - 1e-9))


def attainment(results: list[dict], ttft_target: float, itl_target: float) -> float:
    """Share of requests (failed ones count as misses) with TTFT and mean ITL within target."""
    if not results:
        return 0.0
    good = sum(
        1
        for r in results
        if r["ok"] and r["ttft"] is not None and r["ttft"] <= ttft_target and (r["itl"] or 0.0) <= itl_target
    )
    return good / len(results)


def time_weighted_mean(samples: list[tuple[float, int]], end: float) -> float:
    """Mean of a step function given as (time, value) changes, from the first time to ``end``."""
    if not samples:
        return 0.0
    total = 0.0
    for (t, v), (t2, _) in zip(samples, samples[1:] + [(end, 0)]):
        total += v * max(0.0, t2 - t)
    span = end - samples[0][0]
    return total / span if span > 0 else float(samples[-1][1])


# ---- workers -------------------------------------------------------------------------------
@dataclass
class Worker:
    name: str
    url: str
    events: str
    replay: str
    proc: Proc
    started: float
    state: str = "pending"  # pending -> ready -> draining -> stopped
    ready_at: float | None = None
    cpu: tuple[float, float] | None = None  # (time, cpu seconds) of the last HPA sample


@dataclass
class Run:
    policy: str
    t0: float
    replicas: list[tuple[float, int]] = field(default_factory=list)  # (s, alive workers)
    ready: list[tuple[float, int]] = field(default_factory=list)
    decide_s: list[float] = field(default_factory=list)
    ready_events: list[tuple[float, float]] = field(default_factory=list)  # (started s, ready s)
    decisions: list[dict] = field(default_factory=list)


class Pool:
    """The workers of one policy's run, the router in front of them and the scaling mechanics."""

    def __init__(self, args, tmp: str, srv, router, run: Run, env: dict[str, str]) -> None:
        self.args, self.tmp, self.srv, self.router, self.run, self.env = args, tmp, srv, router, run, env
        self.workers: list[Worker] = []
        self.n = 0
        self.stoppers: list[threading.Thread] = []

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if w.state != "stopped"]

    def of(self, state: str) -> list[Worker]:
        return [w for w in self.workers if w.state == state]

    def start_one(self) -> None:
        from kvmesh.bench.router import start_instance

        i = self.n
        self.n += 1
        flags = [
            "--simulate",
            "--max-model-len",
            "2048",
            "--block-size",
            "16",
            "--sim-prefill-ms-per-token",
            str(self.args.sim_prefill_ms_per_token),
            "--sim-decode-ms",
            self.args.sim_decode_ms,
        ]
        log = os.path.join(self.args.log_dir, f"{self.run.policy}-worker{i}.log")
        w, p = start_instance(self.tmp, i, f"{self.run.policy}{i}", log, self.env, *flags)
        self.workers.append(Worker(f"w{i}", w["url"], w["events"], w["replay"], p, time.monotonic()))

    def poll(self) -> None:
        """Pending workers whose /health answers 200 join the router; drained ones stop."""
        import httpx

        from kvmesh.services.router.config import PodSpec

        for w in self.of("pending"):
            if w.proc.p.poll() is not None:
                raise RuntimeError(f"worker {w.name} exited (log {w.proc.log.name})")
            try:
                ok = httpx.get(w.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                w.state, w.ready_at = "ready", time.monotonic()
                self.srv.call(self.router.add_pod, PodSpec(w.url, "both", w.events, w.replay))
                self.run.ready_events.append((w.started - self.run.t0, w.ready_at - self.run.t0))
        for w in self.of("draining"):
            try:
                idle = httpx.get(w.url + "/drain", timeout=2).json().get("idle", False)
            except (httpx.HTTPError, ValueError):
                idle = True
            if idle:
                w.state = "stopped"
                th = threading.Thread(target=w.proc.stop, daemon=True)
                th.start()
                self.stoppers.append(th)

    def drain(self, name: str) -> None:
        import httpx

        w = next(w for w in self.workers if w.name == name)
        self.srv.call(self.router.remove_pod, w.url)  # out of the router first: no new work
        w.state = "draining"
        httpx.post(w.url + "/drain", timeout=5)

    def scale_to(self, desired: int, victim: str | None) -> None:
        alive = len(self.alive())
        if desired > alive:
            for _ in range(desired - alive):
                self.start_one()
        elif desired < alive and not self.of("draining") and not self.of("pending") and victim:
            self.drain(victim)

    def sample(self) -> None:
        now = time.monotonic() - self.run.t0
        n, r = len(self.alive()), len(self.of("ready"))
        if not self.run.replicas or self.run.replicas[-1][1] != n:
            self.run.replicas.append((now, n))
        if not self.run.ready or self.run.ready[-1][1] != r:
            self.run.ready.append((now, r))

    def close(self) -> None:
        for w in self.alive():
            w.state = "stopped"
            w.proc.stop()
        for th in self.stoppers:
            th.join(15)


# ---- policies --------------------------------------------------------------------------------
class PlannerPolicy:
    def __init__(self, args) -> None:
        from kvmesh.operator.planner import RoleState, Targets

        self.args = args
        self.states = {r: RoleState() for r in ("prefill", "decode")}
        self.samples: dict = {}
        self.lead_s: float | None = None  # scale-up to Ready as the planner measured it
        self.targets = Targets(
            min_replicas=args.min_workers,
            max_replicas=args.max_workers,
            scale_down_window_s=args.scale_down_window,
            ttft_s=args.ttft_target,
            itl_s=args.itl_target,
            target_utilization=args.target_utilization,
            forecast_window_s=args.forecast_window,
            lead_s=args.scale_up_lead,
        )

    def decide(self, pool: Pool, run: Run) -> tuple[int, str | None]:
        import httpx

        from kvmesh.operator.metrics_text import parse
        from kvmesh.operator.planner import RoleObservation, decide, least_loaded
        from kvmesh.operator.planner_loop import pod_load

        now = time.monotonic()
        loads = []
        for w in pool.of("ready"):
            try:
                sample = parse(httpx.get(w.url + "/metrics", timeout=5).text)
            except httpx.HTTPError:
                continue  # left out of this tick, as in the operator
            prev = self.samples.get(w.name)
            self.samples[w.name] = (now, sample)
            loads.append(pod_load(w.name, sample, prev, now, 0.5, 0.9))
        alive, ready = len(pool.alive()), len(pool.of("ready")) + len(pool.of("draining"))
        obs = RoleObservation(
            current=alive,
            ready=ready,
            pending=len(pool.of("pending")),
            pods=tuple(loads),
            interval_s=self.args.interval,
        )
        t = time.perf_counter()
        ds = [decide(role, obs, self.targets, self.states[role], now) for role in ("prefill", "decode")]
        run.decide_s.append(time.perf_counter() - t)
        d = max(ds, key=lambda d: d.desired)
        run.decisions.append(
            {"t": round(now - run.t0, 1), "desired": d.desired, "reason": d.reason, "signal": d.signal}
        )
        victim = least_loaded(tuple(loads))
        self.lead_s = max((s.lead_s or 0.0 for s in self.states.values()), default=0.0) or None
        return d.desired, victim.name if victim else None


class HpaPolicy:
    def __init__(self, args) -> None:
        self.args = args
        self.history: deque[tuple[float, int]] = deque()

    def decide(self, pool: Pool, run: Run) -> tuple[int, str | None]:
        from kvmesh.bench.router import group_cpu_s

        now = time.monotonic()
        utils: dict[str, float] = {}
        for w in pool.of("ready"):
            cpu = group_cpu_s(w.proc.p.pid)
            if w.cpu is not None:
                t0, c0 = w.cpu
                utils[w.name] = (cpu - c0) / max(now - t0, 1e-3) / self.args.hpa_cpu_request
            w.cpu = (now, cpu)
        current = len(pool.alive())
        t = time.perf_counter()
        rec = hpa_desired(current, list(utils.values()), self.args.hpa_cpu_target)
        if rec > current and pool.of("pending"):
            rec = current
        self.history.append((now, rec))
        while self.history and self.history[0][0] < now - self.args.scale_down_window:
            self.history.popleft()
        # Scale up at once; scale down to the highest recommendation of the window (the HPA's rule).
        desired = rec if rec >= current else min(current, max(r for _, r in self.history))
        desired = max(self.args.min_workers, min(self.args.max_workers, desired))
        run.decide_s.append(time.perf_counter() - t)
        run.decisions.append(
            {"t": round(now - run.t0, 1), "desired": desired, "cpu": {k: round(v, 2) for k, v in utils.items()}}
        )
        victim = min(utils, key=lambda k: (utils[k], k)) if utils else None
        return desired, victim


def controller(pool: Pool, policy, run: Run, stop: threading.Event) -> None:
    next_tick = time.monotonic() + pool.args.interval
    while not stop.is_set():
        pool.poll()
        pool.sample()
        if policy is not None and time.monotonic() >= next_tick:
            next_tick += pool.args.interval
            desired, victim = policy.decide(pool, run)
            pool.scale_to(desired, victim)
            pool.sample()
        stop.wait(0.25)


# ---- load ------------------------------------------------------------------------------------
async def drive(url: str, model: str, times: list[float], args, t0: float) -> list[dict]:
    import httpx

    rng = random.Random(args.seed + 1)
    prompts = [f"{i} " + " ".join(rng.choice(WORDS) for _ in range(args.prompt_words)) for i in range(len(times))]
    results: list[dict] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=30), limits=limits) as client:

        async def one(i: int, at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            body = {
                "model": model,
                "prompt": prompts[i],
                "max_tokens": args.output_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            start = time.monotonic()
            stamps: list[float] = []
            ok, err = False, None
            try:
                async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        err = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    else:
                        async for line in resp.aiter_lines():
                            if line.strip() == "data: [DONE]":
                                ok = True
                            elif line.startswith("data:"):
                                stamps.append(time.monotonic())
            except httpx.HTTPError as e:
                err = repr(e)
            ttft = stamps[0] - start if stamps else None
            itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
            results.append({"t": start - t0, "ok": ok, "ttft": ttft, "itl": itl, "error": err})

        await asyncio.gather(*(one(i, at) for i, at in enumerate(times)))
    return sorted(results, key=lambda r: r["t"])


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None


def rises(phases: list[Phase]) -> list[float]:
    """Start times (s) of the load's rises: a step up, or a linear phase that goes up (a rise that
    continues into the next phase counts once)."""
    out, t, prev_end, rising = [], 0.0, None, False
    for a, b, secs in phases:
        step = prev_end is not None and a > prev_end
        if (step or b > a) and not (rising and a == prev_end):
            out.append(t)
        rising = b > a or step
        prev_end, t = b, t + secs
    return out


def step_to_ready(run: Run, phases: list[Phase]) -> list[float]:
    """For each rise of the load: seconds from its start to the first worker started after it being Ready."""
    out = []
    for t in rises(phases):
        after = [ready for started, ready in run.ready_events if started >= t]
        if after:
            out.append(round(min(after) - t, 1))
    return out


def run_policy(policy: str, args, tmp: str, env: dict, times: list[float], phases) -> dict:
    from kvmesh.services.router.config import RouterConfig
    from kvmesh.testing.pods import start_router

    srv, router = start_router(RouterConfig(host="127.0.0.1", port=0, health_interval=1.0))
    run = Run(policy, time.monotonic())
    pool = Pool(args, tmp, srv, router, run, env)
    stop = threading.Event()
    try:
        for _ in range(args.max_workers if policy == "static" else args.min_workers):
            pool.start_one()
        deadline = time.monotonic() + 300
        while pool.of("pending"):
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not become ready in 300 s")
            pool.poll()
            time.sleep(0.25)
        import httpx

        model = httpx.get(pool.workers[0].url + "/v1/models").json()["data"][0]["id"]
        run.ready_events.clear()
        pol = PlannerPolicy(args) if policy == "planner" else HpaPolicy(args) if policy == "hpa" else None
        run.t0 = time.monotonic()
        ctl = threading.Thread(target=controller, args=(pool, pol, run, stop), daemon=True)
        ctl.start()
        results = asyncio.run(drive(srv.url, model, times, args, run.t0))
        end = time.monotonic() - run.t0
        stop.set()
        ctl.join(30)
    finally:
        stop.set()
        pool.close()
        srv.stop()
    failed = [r for r in results if not r["ok"]]
    return {
        "attainment": attainment(results, args.ttft_target, args.itl_target),
        "requests": len(results),
        "failed": len(failed),
        "errors": sorted({str(r["error"]) for r in failed})[:5],
        "avg_replicas": time_weighted_mean(run.replicas, end),
        "max_replicas": max((n for _, n in run.replicas), default=0),
        "ttft_p50": pct([r["ttft"] for r in results if r["ttft"] is not None], 50),
        "ttft_p90": pct([r["ttft"] for r in results if r["ttft"] is not None], 90),
        "itl_mean_p50": pct([r["itl"] for r in results if r["itl"] is not None], 50),
        "decide_ms_median": statistics.median(run.decide_s) * 1e3 if run.decide_s else None,
        "decide_ms_max": max(run.decide_s) * 1e3 if run.decide_s else None,
        "step_to_ready_s": step_to_ready(run, phases),
        "duration_s": round(end, 1),
        "replicas": run.replicas,
        "requests_series": [(round(r["t"], 2), r["ttft"]) for r in results],
        "decisions": run.decisions,
        "planner_lead_s_measured": None if pol is None else getattr(pol, "lead_s", None),
    }


def print_table(results: dict, setup: dict) -> None:
    print(
        f"\nramp {setup['phases']} (req/s:s), {setup['requests']} requests of ~{setup['prompt_words']} prompt "
        f"tokens + {setup['output_tokens']} output; SLO TTFT <= {setup['ttft_target_s']} s and mean ITL <= "
        f"{setup['itl_target_s'] * 1e3:.0f} ms"
    )
    hdr = f"{'policy':<8} {'attain':>7} {'failed':>6} {'avg rep':>7} {'max rep':>7} {'TTFT p50':>8} {'p90':>6} "
    hdr += f"{'decide ms med/max':>17} {'step->Ready s':>13}"
    print(hdr)
    for p, r in results.items():
        dm = "-" if r["decide_ms_median"] is None else f"{r['decide_ms_median']:.3f}/{r['decide_ms_max']:.3f}"
        print(
            f"{p:<8} {r['attainment'] * 100:6.1f}% {r['failed']:>6} {r['avg_replicas']:7.2f} {r['max_replicas']:>7} "
            f"{r['ttft_p50'] or 0:8.2f} {r['ttft_p90'] or 0:6.2f} {dm:>17} "
            f"{','.join(map(str, r['step_to_ready_s'])) or '-':>13}"
        )
    if "static" in results and "planner" in results:
        s, p = results["static"], results["planner"]
        share = p["avg_replicas"] / s["avg_replicas"] if s["avg_replicas"] else float("nan")
        ok = p["attainment"] >= 0.95 and share <= 0.75
        print(
            f"goal (planner >= 95% attainment with <= 75% of the static pool's replicas): "
            f"{p['attainment'] * 100:.1f}% with {share * 100:.0f}% -> {'met' if ok else 'NOT met'}"
        )


def plot(results: dict, phases, path: str, window: float = 10.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for p, r in results.items():
        xs, ys = [], []
        for (t, n), (t2, _) in zip(r["replicas"], r["replicas"][1:] + [(r["duration_s"], 0)]):
            xs += [t, t2]
            ys += [n, n]
        (line,) = ax1.plot(xs, ys, label=p)
        series = r["requests_series"]
        end = max((t for t, _ in series), default=0.0)
        mids, p50, p90 = [], [], []
        t = 0.0
        while t < end:
            win = [x for s, x in series if t <= s < t + window and x is not None]
            if win:
                mids.append(t + window / 2)
                p50.append(pct(win, 50))
                p90.append(pct(win, 90))
            t += window
        ax2.plot(mids, p50, color=line.get_color(), label=f"{p} p50")
        ax2.plot(mids, p90, color=line.get_color(), linestyle="--", label=f"{p} p90")
    t = 0.0
    peak = max(max(a, b) for a, b, _ in phases)
    for a, b, secs in phases:
        ax1.axvspan(t, t + secs, alpha=0.08 if max(a, b) == peak else 0.0, color="k")
        label = f"{a:g} req/s" if a == b else f"{a:g}→{b:g}"
        ax1.text(t + 1, 0.03, label, fontsize=8, transform=ax1.get_xaxis_transform())
        t += secs
    ax1.set_ylabel("worker replicas (started)")
    ax1.legend()
    ax2.set_ylabel(f"TTFT, s ({window:.0f} s windows)")
    ax2.set_xlabel("seconds into the ramp")
    ax2.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)


def run(args: argparse.Namespace) -> int:
    import shutil
    import signal

    from kvmesh.bench.router import stop_strays

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        phases = parse_phases(QUICK_PHASES if args.quick else args.phases)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    policies = [p for p in args.policies.split(",") if p]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not 1 <= args.min_workers <= args.max_workers:
        print(f"error: policies from {POLICIES}; 1 <= --min-workers <= --max-workers", file=sys.stderr)
        return 2
    times = arrivals(phases, args.seed)
    os.makedirs(args.log_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvmesh-bench-autoscale-")
    env = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"}
    results: dict[str, dict] = {}
    t_start = time.monotonic()
    try:
        for p in policies:
            print(f"[{p}] {len(times)} requests over {sum(s for _, _, s in phases):.0f} s ...", file=sys.stderr)
            results[p] = r = run_policy(p, args, tmp, env, times, phases)
            print(
                f"[{p}] attainment {r['attainment'] * 100:.1f}%, failed {r['failed']}, "
                f"avg replicas {r['avg_replicas']:.2f}, max {r['max_replicas']} {r['errors']}",
                file=sys.stderr,
            )
    finally:
        stop_strays()
        shutil.rmtree(tmp, ignore_errors=True)
    setup = {
        "phases": format_phases(phases),
        "requests": len(times),
        "prompt_words": args.prompt_words,
        "output_tokens": args.output_tokens,
        "ttft_target_s": args.ttft_target,
        "itl_target_s": args.itl_target,
        "planner_percentiles": {"ttft": 90, "itl": 50},
        "min_workers": args.min_workers,
        "max_workers": args.max_workers,
        "interval_s": args.interval,
        "scale_down_window_s": args.scale_down_window,
        "planner": {
            "target_utilization": args.target_utilization,
            "forecast_window_s": args.forecast_window,
            "scale_up_lead_s_until_measured": args.scale_up_lead,
        },
        "sim_prefill_ms_per_token": args.sim_prefill_ms_per_token,
        "sim_decode_ms": args.sim_decode_ms,
        "hpa": {"cpu_target": args.hpa_cpu_target, "cpu_request_cores": args.hpa_cpu_request},
        "workers": "aggregated `kvmesh serve --simulate` processes on loopback; in-process kvmesh router",
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    print_table(results, setup)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({**results, "_setup": setup}, fh, indent=1)
    if args.png:
        plot(results, phases, args.png)
    return 0
