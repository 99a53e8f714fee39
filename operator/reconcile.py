"""Level-based reconcile of one InferenceService: render, check ownership, apply, prune, report.

Why level-based: the same function runs on create, update, resume, every resync tick and every
event of an owned Deployment, and always drives the children to render(spec). That is what makes
drift correction, operator restarts mid-way and lost events harmless: the next pass converges.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvmesh.services.api.lora_sync import parse_adapters

from . import conditions as cond
from .conditions import Condition
from .kube import KINDS, Kube, TransientError
from .render import (
    DEFAULT_PROMETHEUS_URL,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_OWNER,
    LORA_FILE_KEY,
    LWS_KIND,
    MANAGER,
    child_key,
    internal_secret,
    lora_configmap_name,
    render,
)
from .spec import ROLES, WORKER_ROLES, InferenceServiceSpec, ObjectMeta
from .validate import problems

log = logging.getLogger(__name__)

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()
_dirty: set[tuple[str, str]] = set()  # objects whose running pass must go round once more


def _lock(namespace: str, name: str) -> threading.Lock:
    """Serialize passes over one object: handlers, timers and child events run in parallel."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


@dataclass
class Outcome:
    """What one pass found; turned into status by status_for()."""

    generation: int
    invalid: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    apply_errors: list[str] = field(default_factory=list)
    roles: dict[str, dict[str, int]] = field(default_factory=dict)
    not_ready: list[str] = field(default_factory=list)
    # The adapters each worker role is configured to serve: what the applied NAME-lora-adapters names
    # ({} without adapters; None when this pass does not know, e.g. the ConfigMap's apply failed).
    lora_adapters: dict[str, list[str]] | None = None


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    return any(
        r.get("uid") == uid and r.get("controller") for r in obj.get("metadata", {}).get("ownerReferences") or ()
    )


def _lws_progress(lws: dict[str, Any], floor: int = 0) -> tuple[int, int, bool]:
    """(desired, ready, rolled_out) for a LeaderWorkerSet: its groups count as replicas (a group is
    ready when all its pods are). Its status has no observedGeneration; updatedReplicas tells."""
    spec, st = lws.get("spec") or {}, lws.get("status") or {}
    desired = max(int(spec.get("replicas", 1)), floor)
    ready = int(st.get("readyReplicas") or 0)
    settled = (
        int(st.get("updatedReplicas") or 0) >= desired and int(st.get("replicas") or 0) == desired and ready >= desired
    )
    return desired, ready, settled


def _deployment_progress(dep: dict[str, Any], floor: int = 0) -> tuple[int, int, bool]:
    """(desired, ready, rolled_out) for a Deployment as the API server reports it.

    floor: an HPA's minReplicas. Until the HPA has scaled the Deployment up to it, the role is
    not settled (otherwise Ready=True would flash before autoscaling has done its first step).
    """
    spec, st = dep.get("spec") or {}, dep.get("status") or {}
    desired = max(int(spec.get("replicas", 1)), floor)
    ready = int(st.get("readyReplicas") or 0)
    settled = (
        int(st.get("observedGeneration") or 0) >= int(dep["metadata"].get("generation") or 0)
        and int(st.get("updatedReplicas") or 0) >= desired
        and int(st.get("replicas") or 0) == desired
        and ready >= desired
    )
    return desired, ready, settled


def reconcile(
    kube: Kube,
    body: dict[str, Any],
    apply_delay: float = 0.0,
    wait: bool = True,
    prometheus_url: str = DEFAULT_PROMETHEUS_URL,
) -> Outcome | None:
    """One pass (more if something asked for one meanwhile). Raises TransientError when the API
    should be retried later.

    wait=False (timers, child events): if a pass over this object is already running, ask it to
    run once more instead of queueing a thread behind it, and return None.
    """
    meta = ObjectMeta.parse(body["metadata"])
    key = (meta.namespace, meta.name)
    lock = _lock(*key)
    if not lock.acquire(blocking=wait):
        _dirty.add(key)
        return None
    try:
        while True:
            _dirty.discard(key)
            out = _reconcile_once(kube, meta, apply_delay, prometheus_url)
            if key not in _dirty:
                return out
    finally:
        lock.release()


def _reconcile_once(
    kube: Kube, meta: ObjectMeta, apply_delay: float, prometheus_url: str = DEFAULT_PROMETHEUS_URL
) -> Outcome:
    # Re-read: the body may be stale when we waited for the lock or come from a child event.
    fresh = kube.get("serving.kvmesh.io/v1alpha1", "InferenceService", meta.namespace, meta.name)
    if fresh is None or fresh["metadata"].get("deletionTimestamp"):
        return Outcome(generation=meta.generation)
    meta = ObjectMeta.parse(fresh["metadata"])
    out = Outcome(generation=meta.generation)
    spec = InferenceServiceSpec.parse(fresh.get("spec") or {})
    out.invalid = problems(spec, meta.name)
    if out.invalid:
        write_status(kube, fresh, out)
        return out
    desired = render(spec, meta, prometheus_url)
    if not spec.lora_adapters:
        out.lora_adapters = {}
    try:
        _ensure_internal_secret(kube, meta, out)
        _apply_all(kube, meta, desired, out, apply_delay, _replica_floors(spec))
        _prune(kube, meta, desired)
    except TransientError:
        out.apply_errors.append("API temporarily unavailable; retrying")
        _safe_write_status(kube, fresh, out)
        raise
    write_status(kube, fresh, out)
    return out


def _api_message(e: Exception) -> str:
    """The API server's own explanation (Status.message), falling back to the HTTP reason."""
    try:
        return str(json.loads(getattr(e, "body", "") or "{}").get("message") or e)
    except ValueError:
        return str(getattr(e, "reason", e))


def _ensure_internal_secret(kube: Kube, meta: ObjectMeta, out: Outcome) -> None:
    """Create NAME-kvmesh-internal before the pods that reference it. One that exists (made by an
    earlier pass, or keys the user brought) is left as it is, so keys stay stable."""
    from kubernetes.client.rest import ApiException

    secret = internal_secret(meta)
    try:
        if kube.create_if_absent(secret):
            log.info("created Secret %s/%s", meta.namespace, secret["metadata"]["name"])
    except ApiException as e:
        out.apply_errors.append(f"Secret {secret['metadata']['name']}: {e.status} {_api_message(e)}")


def _replica_floors(spec: InferenceServiceSpec) -> dict[str, int]:
    a = spec.autoscaling
    return {"prefill": a.prefill.min_replicas, "decode": a.decode.min_replicas} if a.enabled else {}


def _apply_all(
    kube: Kube, meta: ObjectMeta, desired: list[dict], out: Outcome, apply_delay: float, floors: dict[str, int]
) -> None:
    from kubernetes.client.rest import ApiException

    for obj in desired:
        if apply_delay:
            time.sleep(apply_delay)
        api_version, kind, name = child_key(obj)
        existing = kube.get(api_version, kind, meta.namespace, name)
        if existing is not None and not controlled_by(existing, meta.uid):
            # Never adopt: the object belongs to someone else (or to an older owner).
            out.conflicts.append(f"{kind} {name} exists and is not owned by this InferenceService")
            continue
        try:
            applied = kube.apply(obj)
        except ApiException as e:
            out.apply_errors.append(f"{kind} {name}: {e.status} {_api_message(e)}")
            log.warning("apply %s %s/%s failed: %s", kind, meta.namespace, name, e.body)
            continue
        if kind == "ConfigMap" and name == lora_configmap_name(meta):
            out.lora_adapters = configured_adapters(applied)
        if kind in ("Deployment", LWS_KIND):
            component = obj["metadata"]["labels"][LABEL_COMPONENT]
            progress = _deployment_progress if kind == "Deployment" else _lws_progress
            d, r, settled = progress(applied, floors.get(component, 0))
            if component in ROLES:
                out.roles[component] = {"replicas": d, "readyReplicas": r}
            if not settled:
                out.not_ready.append(f"{component} {r}/{d}")


def configured_adapters(cm: dict[str, Any]) -> dict[str, list[str]]:
    """status.loraAdapters from the applied NAME-lora-adapters: the adapters every prefill and decode
    worker is told to serve (each worker loads them within a minute or so of a change: the kubelet's
    ConfigMap sync, then the server's poll). Not whether each pod has loaded them: that is on each
    pod's /v1/models."""
    try:
        names = sorted(parse_adapters((cm.get("data") or {}).get(LORA_FILE_KEY, "{}")))
    except ValueError:
        names = []
    return {role: names for role in WORKER_ROLES}


def _prune(kube: Kube, meta: ObjectMeta, desired: list[dict]) -> None:
    """Delete children we own that render() no longer produces (e.g. HPAs after autoscaling is
    switched off, a managed Redis after a connector change)."""
    keep = {child_key(o) for o in desired}
    sel = f"{LABEL_OWNER}={meta.name},{LABEL_MANAGED_BY}={MANAGER}"
    for api_version, kind in KINDS:
        for item in kube.list(api_version, kind, meta.namespace, sel):
            if (api_version, kind, item["metadata"]["name"]) in keep:
                continue
            if controlled_by(item, meta.uid):
                log.info("pruning %s %s/%s", kind, meta.namespace, item["metadata"]["name"])
                kube.delete(api_version, kind, meta.namespace, item["metadata"]["name"], item["metadata"]["uid"])


def status_for(body: dict[str, Any], out: Outcome) -> dict[str, Any]:
    """Status subresource body for this outcome (pure; unit-tested)."""
    gen = out.generation
    if out.invalid:
        msg = "; ".join(out.invalid)
        new = [
            Condition(cond.READY, "False", "InvalidSpec", msg),
            Condition(cond.PROGRESSING, "False", "InvalidSpec", msg),
            Condition(cond.DEGRADED, "True", "InvalidSpec", msg),
        ]
    else:
        problems_ = out.conflicts + out.apply_errors
        ready = not problems_ and not out.not_ready and len(out.roles) == len(ROLES)
        if ready:
            new = [
                Condition(cond.READY, "True", "AllReplicasReady", "all prefill, decode and router replicas are ready")
            ]
        elif problems_:
            new = [Condition(cond.READY, "False", "ReconcileFailed", "; ".join(problems_))]
        else:
            new = [
                Condition(
                    cond.READY, "False", "ReplicasNotReady", "waiting for " + ", ".join(out.not_ready or ["children"])
                )
            ]
        if out.not_ready:
            new.append(Condition(cond.PROGRESSING, "True", "RollingOut", "rolling out: " + ", ".join(out.not_ready)))
        elif problems_:
            new.append(Condition(cond.PROGRESSING, "False", "Blocked", "cannot progress: " + "; ".join(problems_)))
        else:
            new.append(Condition(cond.PROGRESSING, "False", "Complete", "rollout complete"))
        if out.conflicts:
            new.append(Condition(cond.DEGRADED, "True", "ChildConflict", "; ".join(out.conflicts)))
        elif out.apply_errors:
            new.append(Condition(cond.DEGRADED, "True", "ApplyFailed", "; ".join(out.apply_errors)))
        else:
            new.append(Condition(cond.DEGRADED, "False", "AsExpected", "no problems found"))
    old = (body.get("status") or {}).get("conditions")
    status: dict[str, Any] = {"observedGeneration": gen, "conditions": cond.merge(old, new, gen)}
    for role, counts in out.roles.items():
        status[role] = {**counts, "summary": f"{counts['readyReplicas']}/{counts['replicas']}"}
    if out.lora_adapters is not None:  # a merge patch: null removes what an earlier pass wrote
        status["loraAdapters"] = out.lora_adapters or None
    return status


def write_status(kube: Kube, body: dict[str, Any], out: Outcome) -> None:
    kube.patch_status(body["metadata"]["namespace"], body["metadata"]["name"], status_for(body, out))


def _safe_write_status(kube: Kube, body: dict[str, Any], out: Outcome) -> None:
    try:
        write_status(kube, body, out)
    except Exception:  # the API is already failing; the retry will report properly
        log.debug("status write failed during transient error", exc_info=True)
