"""The planner in the operator: every ``autoscaling.intervalSeconds``, for each InferenceService
with ``autoscaling.enabled`` and ``provider: planner``, read the workers' own ``/metrics``, let
operator/planner.py decide, and act on it.

Acting:
* up: write the new count through the Deployment's scale subresource;
* down, one pod at a time, losing nothing: the least loaded Ready pod gets the label
  ``serving.kvmesh.io/routable=false``, which takes it out of its role's Service, so its
  EndpointSlice entry goes and the router sends it no new work, while it stays in its ReplicaSet
  and finishes what it has (streams, and on a prefill pod the blocks decode pods still pull). Once
  its running, waiting and held requests are 0 (or the drain timeout passed) it gets the lowest
  ``controller.kubernetes.io/pod-deletion-cost`` and the Deployment is scaled down by one, so the
  ReplicaSet removes exactly that pod (its own graceful shutdown covers anything left). If the
  load comes back meanwhile, the label is put back.
* status.autoscaling.<role>: the decision record and the AbleToScale / ScalingActive /
  ScalingLimited conditions (the HPA's meanings).

Why no metrics adapter or Prometheus: the pods already export what the planner needs; reading it
directly is one less moving part and the data is never older than one interval. Samples of pods
that no longer exist are forgotten on the next tick, so a deleted pod never holds a pool up.
"""

from __future__ import annotations

import logging
import math
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import conditions as cond
from .conditions import Condition
from .config import OperatorConfig
from .kube import Kube
from .metrics_text import Sample, parse, quantile
from .planner import Decision, PodLoad, RoleObservation, RoleState, Targets, decide, least_loaded
from .render import HTTP_PORT, LABEL_ROUTABLE, LWS_GROUP_INDEX, LWS_KIND, selector, workload
from .spec import WORKER_ROLES, AutoscalingSpec, InferenceServiceSpec, ObjectMeta
from .validate import problems

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LOWEST_COST = str(-(2**31))  # int32 minimum: removed before any other Ready pod

ABLE_TO_SCALE = "AbleToScale"
SCALING_ACTIVE = "ScalingActive"
SCALING_LIMITED = "ScalingLimited"


def http_get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (http to a pod IP we listed)
        return r.read().decode("utf-8", errors="replace")


@dataclass
class _Drain:
    pod: str
    started: float


@dataclass
class _ServiceState:
    roles: dict[str, RoleState] = field(default_factory=lambda: {r: RoleState() for r in WORKER_ROLES})
    samples: dict[str, tuple[float, Sample]] = field(default_factory=dict)  # pod name -> last scrape
    drains: dict[str, _Drain] = field(default_factory=dict)
    last_scale: dict[str, str] = field(default_factory=dict)
    next_due: float = 0.0


def targets(a: AutoscalingSpec, role: str) -> Targets:
    s = a.role(role)
    return Targets(
        min_replicas=s.min_replicas,
        max_replicas=s.max_replicas,
        scale_up_window_s=s.scale_up_stabilization_s,
        scale_down_window_s=s.scale_down_stabilization_s,
        ttft_s=s.target_ttft_ms / 1e3 if s.target_ttft_ms else None,
        itl_s=s.target_itl_ms / 1e3 if s.target_itl_ms else None,
        kv_usage=s.target_kv_usage if role == "decode" else None,
        target_utilization=a.target_utilization,
        forecast_window_s=a.forecast_window_s,
        lead_s=a.scale_up_lead_s,
    )


def pod_load(
    name: str, sample: Sample, prev: tuple[float, Sample] | None, now: float, q_itl: float, q_ttft: float
) -> PodLoad:
    """One pod's `PodLoad` from its scrape at ``now`` and the previous one (counters and histograms
    become rates and percentiles over the interval between them; the first scrape has no interval).
    Public so that `kvmesh bench autoscale` builds its observations exactly as the operator does."""
    if prev is None:
        rate, itl, ttft, firsts = 0.0, None, None, 0.0
    else:
        t0, s0 = prev
        dt = max(now - t0, 1e-3)
        rate = max(0.0, sample.computed_tokens - s0.computed_tokens) / dt
        itl = quantile(sample.itl, s0.itl, q_itl)
        ttft = quantile(sample.ttft, s0.ttft, q_ttft)
        firsts = max(0.0, sample.ttft.get(math.inf, 0.0) - s0.ttft.get(math.inf, 0.0)) / dt
    return PodLoad(
        name=name,
        running=sample.gauge("running"),
        waiting=sample.gauge("waiting"),
        kv_usage=sample.gauge("kv_usage"),
        pending_prompt_tokens=sample.gauge("pending_prompt_tokens"),
        computed_tokens_per_s=rate,
        itl_s=itl,
        ttft_s=ttft,
        first_tokens_per_s=firsts,
    )


def _ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


class Planner:
    """State across ticks, per InferenceService (namespace, name)."""

    def __init__(
        self,
        kube: Kube,
        cfg: OperatorConfig,
        fetch: Callable[[str, float], str] = http_get,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube, self.cfg, self.fetch, self.clock = kube, cfg, fetch, clock
        self.states: dict[tuple[str, str], _ServiceState] = {}

    def due(self, body: dict[str, Any]) -> bool:
        """Whether this object's interval has passed (objects without the planner are never due,
        and whatever was kept for them is dropped)."""
        meta = body["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        spec = InferenceServiceSpec.parse(body.get("spec") or {})
        if not spec.autoscaling.planner:
            if self.states.pop(key, None) is not None:
                self._clear_status(key)
            return False
        st = self.states.get(key)
        return st is None or self.clock() >= st.next_due

    def forget_missing(self, present: set[tuple[str, str]]) -> None:
        for key in [k for k in self.states if k not in present]:
            del self.states[key]

    def _clear_status(self, key: tuple[str, str]) -> None:
        try:
            self.kube.patch_status(key[0], key[1], {"autoscaling": None})
        except Exception as e:  # noqa: BLE001 (status is best effort)
            log.info("clearing status.autoscaling of %s/%s failed: %s", *key, e)

    # ---- one tick -------------------------------------------------------------------------
    def tick(self, body: dict[str, Any]) -> dict[str, Decision]:
        meta = ObjectMeta.parse(body["metadata"])
        spec = InferenceServiceSpec.parse(body.get("spec") or {})
        a = spec.autoscaling
        key = (meta.namespace, meta.name)
        st = self.states.setdefault(key, _ServiceState())
        now = self.clock()
        st.next_due = now + a.interval_s
        if problems(spec, meta.name):
            return {}  # reconcile reports InvalidSpec; nothing to plan on
        decisions: dict[str, Decision] = {}
        status: dict[str, Any] = {}
        live_pods: set[str] = set()
        old = (body.get("status") or {}).get("autoscaling") or {}
        for role in WORKER_ROLES:
            api_version, kind, name = workload(spec, meta, role)
            dep = self.kube.get(api_version, kind, meta.namespace, name)
            if dep is None:
                continue
            d, scraped, extra = self._role(meta, a, role, dep, st, now, live_pods)
            decisions[role] = d
            status[role] = self._status(d, role, st, scraped, extra, (old.get(role) or {}).get("conditions"), meta)
        for pod in [p for p in st.samples if p not in live_pods]:
            del st.samples[pod]  # a deleted pod's numbers go with it
        if status:
            self.kube.patch_status(meta.namespace, meta.name, {"autoscaling": status})
        return decisions

    def _scrape(
        self, pod: dict[str, Any], st: _ServiceState, now: float, q_itl: float, q_ttft: float
    ) -> tuple[PodLoad, float] | None:
        name = pod["metadata"]["name"]
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            return None
        try:
            sample = parse(self.fetch(f"http://{ip}:{HTTP_PORT}/metrics", self.cfg.scrape_timeout_seconds))
        except Exception as e:  # noqa: BLE001 (a pod that does not answer is left out of this tick)
            log.info("scrape of %s (%s) failed: %s", name, ip, e)
            return None
        prev = st.samples.get(name)
        st.samples[name] = (now, sample)
        return pod_load(name, sample, prev, now, q_itl, q_ttft), sample.gauge("held")

    def _role(
        self,
        meta: ObjectMeta,
        a: AutoscalingSpec,
        role: str,
        dep: dict[str, Any],
        st: _ServiceState,
        now: float,
        live_pods: set[str],
    ) -> tuple[Decision, int, str]:
        ns = meta.namespace
        current = int((dep.get("spec") or {}).get("replicas", 1))
        sel = ",".join(f"{k}={v}" for k, v in selector(meta, role).items())
        pods = [p for p in self.kube.list_pods(ns, sel) if not p["metadata"].get("deletionTimestamp")]
        live_pods.update(p["metadata"]["name"] for p in pods)
        ready = [p for p in pods if _ready(p)]
        pending = max(0, current - len(ready))
        s = a.role(role)
        loads: list[PodLoad] = []
        held: dict[str, float] = {}
        drained_load: PodLoad | None = None
        drain = st.drains.get(role)
        if drain is not None and drain.pod not in {p["metadata"]["name"] for p in pods}:
            st.drains.pop(role)
            drain = None
        # A pod left unroutable by an earlier operator run is taken over as the pod being drained.
        for p in pods:
            if (p["metadata"].get("labels") or {}).get(LABEL_ROUTABLE) == "false" and drain is None:
                drain = st.drains[role] = _Drain(p["metadata"]["name"], now)
        for p in ready:
            got = self._scrape(p, st, now, s.itl_percentile / 100, s.ttft_percentile / 100)
            if got is not None:
                load, h = got
                held[load.name] = h
                if drain is None or load.name != drain.pod:  # the drained pod takes no new work
                    loads.append(load)
                else:
                    drained_load = load
        interval = float(a.interval_s)
        obs = RoleObservation(
            current=current, ready=len(ready), pending=pending, pods=tuple(loads), interval_s=interval
        )
        d = decide(role, obs, targets(a, role), st.roles[role], now)
        dep_name = dep["metadata"]["name"]
        kind = (dep["apiVersion"], dep["kind"])
        extra = ""
        if d.desired > current:
            self._undrain(ns, st, role)
            self.kube.scale(ns, dep_name, d.desired, kind)
            st.last_scale[role] = cond.now()
        elif d.desired < current and drain is None:
            if pending or len(ready) < current:
                extra = "scale-down waits for starting pods"
            else:
                victim = _last_group(loads, pods) if kind[1] == LWS_KIND else least_loaded(tuple(loads))
                if victim is not None:
                    self.kube.patch_pod_metadata(ns, victim.name, labels={LABEL_ROUTABLE: "false"})
                    st.drains[role] = _Drain(victim.name, now)
                    d = replace(_with(d, "ScaleDownDraining", f"draining {victim.name}"), desired=current)
        elif d.desired < current and drain is not None:
            dl = drained_load
            open_ = None if dl is None else dl.running + dl.waiting + held.get(drain.pod, 0.0)
            waited = now - drain.started
            if open_ == 0 or waited >= self.cfg.drain_timeout_seconds:
                self.kube.patch_pod_metadata(ns, drain.pod, annotations={DELETION_COST: LOWEST_COST})
                self.kube.scale(ns, dep_name, current - 1, kind)
                st.last_scale[role] = cond.now()
                st.drains.pop(role)
                why = "drained" if open_ == 0 else f"drain timed out after {waited:.0f}s"
                d = replace(_with(d, f"ScaleDown: removed {drain.pod} ({why})", ""), desired=current - 1)
            else:
                d = replace(_with(d, "ScaleDownDraining", f"draining {drain.pod}: open={open_}"), desired=current)
        elif drain is not None:  # the load came back before the pod was removed
            self._undrain(ns, st, role)
        return d, len(loads), extra

    def _undrain(self, ns: str, st: _ServiceState, role: str) -> None:
        drain = st.drains.pop(role, None)
        if drain is not None:
            self.kube.patch_pod_metadata(ns, drain.pod, labels={LABEL_ROUTABLE: "true"})

    def _status(
        self,
        d: Decision,
        role: str,
        st: _ServiceState,
        scraped: int,
        extra: str,
        old_conditions: list[dict[str, Any]] | None,
        meta: ObjectMeta,
    ) -> dict[str, Any]:
        limited_reason = "DesiredWithinRange"
        if d.limited:
            limited_reason = "TooManyReplicas" if d.reason == "AtMax" else "TooFewReplicas"
        new = [
            Condition(
                ABLE_TO_SCALE,
                "False" if d.reason == "HeldByPending" else "True",
                "HeldByPending" if d.reason == "HeldByPending" else "ReadyForNewScale",
                extra or ("pods are starting; no further scale-up until they are Ready" if d.pending else "ok"),
            ),
            Condition(
                SCALING_ACTIVE,
                "True" if scraped else "False",
                "ValidMetricFound" if scraped else "FailedGetPodsMetric",
                f"{scraped} pods scraped" if scraped else "no Ready pod's /metrics could be read",
            ),
            Condition(SCALING_LIMITED, "True" if d.limited else "False", limited_reason, d.reason),
        ]
        out: dict[str, Any] = {
            "desiredReplicas": d.desired,
            "currentReplicas": d.current,
            "readyReplicas": d.ready,
            "pendingReplicas": d.pending,
            "signal": d.signal,
            "reason": d.reason,
            "conditions": cond.merge(old_conditions, new, meta.generation),
        }
        if role in st.last_scale:
            out["lastScaleTime"] = st.last_scale[role]
        return out


def _with(d: Decision, reason: str, detail: str) -> Decision:
    return replace(d, reason=reason, signal=f"{d.signal} {detail}".strip())


def _last_group(loads: list[PodLoad], pods: list[dict[str, Any]]) -> PodLoad | None:
    """The leader of the highest-numbered group: a LeaderWorkerSet scales down from the top and has no
    deletion cost to pick another, so that group is the one to drain."""
    index = {p["metadata"]["name"]: int((p["metadata"].get("labels") or {}).get(LWS_GROUP_INDEX, -1)) for p in pods}
    return max(loads, key=lambda pl: index.get(pl.name, -1), default=None)
