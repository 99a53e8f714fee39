"""kopf wiring: every trigger funnels into reconcile.reconcile().

Triggers: create/update(spec)/resume of an InferenceService, a resync loop (drift in any child,
status refresh) and events of owned Deployments (a deleted or edited Deployment is put back at
once, and readiness changes reach the status without waiting for the timer).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from typing import Any

import kopf

from .config import OperatorConfig
from .kube import Kube, TransientError, load_config
from .planner_loop import Planner
from .reconcile import reconcile
from .render import API_GROUP, LABEL_MANAGED_BY, MANAGER

log = logging.getLogger(__name__)
CONFIG = OperatorConfig.from_env()
PLURAL = "inferenceservices"
_kube: Kube | None = None
PLANNER_LIST_SECONDS = 5.0  # how stale the planner's list of InferenceServices may get


def kube() -> Kube:
    global _kube
    if _kube is None:
        load_config()
        _kube = Kube()
    return _kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Keep kopf's bookkeeping in annotations under our prefix, and out of status: status is ours
    # and follows the API conventions.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{API_GROUP}/kopf-finalizer"
    settings.posting.level = logging.WARNING
    # No cluster-wide watch of CRDs/namespaces: one discovery at startup is enough (the CRD is
    # installed before the operator) and it keeps the RBAC smaller.
    settings.scanning.disabled = True
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.networking.error_backoffs = [1, 2, 5, 10, 20]
    settings.execution.max_workers = 16
    kube()


def _run(body: kopf.Body, retry: int = 0, wait: bool = True) -> None:
    try:
        reconcile(kube(), dict(body), CONFIG.debug_apply_delay_seconds, wait=wait, prometheus_url=CONFIG.prometheus_url)
    except TransientError as e:
        raise kopf.TemporaryError(str(e), delay=CONFIG.backoff(retry)) from e


@kopf.on.resume(API_GROUP, "v1alpha1", PLURAL)
@kopf.on.create(API_GROUP, "v1alpha1", PLURAL)
@kopf.on.update(API_GROUP, "v1alpha1", PLURAL, field="spec")
def on_change(body: kopf.Body, retry: int, **_: Any) -> None:
    _run(body, retry)


def _in_scope(item: dict[str, Any], namespaces: tuple[str, ...]) -> bool:
    ns = item["metadata"].get("namespace", "")
    return not namespaces or any(fnmatch.fnmatch(ns, pat) for pat in namespaces)


async def _plan_forever(namespaces: tuple[str, ...]) -> None:
    """The autoscaling planner (operator/planner_loop.py) for every InferenceService in scope with
    ``autoscaling.enabled`` and ``provider: planner``, each on its own ``intervalSeconds``.

    A loop of our own rather than a kopf timer, for the reason given at _resync_forever. It wakes
    every second, lists InferenceServices at most every PLANNER_LIST_SECONDS, and runs the ticks
    that are due in a thread (they scrape pods and call the API)."""
    planner = Planner(kube(), CONFIG)
    items: list[dict] = []
    listed = -PLANNER_LIST_SECONDS
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(1.0)
        if loop.time() - listed >= PLANNER_LIST_SECONDS:
            try:
                items = [i for i in await asyncio.to_thread(kube().list_inference_services) if _in_scope(i, namespaces)]
                listed = loop.time()
            except Exception as e:  # noqa: BLE001 (keep the loop alive whatever the API does)
                log.warning("planner list failed: %s", e)
                continue
            planner.forget_missing({(i["metadata"].get("namespace", ""), i["metadata"]["name"]) for i in items})
        for item in items:
            if not planner.due(item):
                continue
            meta = item["metadata"]
            try:
                fresh = await asyncio.to_thread(
                    kube().get, f"{API_GROUP}/v1alpha1", "InferenceService", meta.get("namespace", ""), meta["name"]
                )
                if fresh is not None and not fresh["metadata"].get("deletionTimestamp"):
                    await asyncio.to_thread(planner.tick, fresh)
            except Exception as e:  # noqa: BLE001
                log.warning("planner tick of %s/%s failed: %s", meta.get("namespace"), meta["name"], e)


async def _resync_forever(namespaces: tuple[str, ...]) -> None:
    """Every resync interval, reconcile every InferenceService in scope.

    Why not a kopf timer: kopf puts a finalizer on every object with a timer or daemon, and a
    finalizer makes deleting an InferenceService hang whenever the operator is not running.
    One loop over a list call gives the same drift correction without it.
    """
    while True:
        await asyncio.sleep(CONFIG.resync_seconds)
        try:
            items = await asyncio.to_thread(kube().list_inference_services)
        except Exception as e:  # noqa: BLE001 (keep the loop alive whatever the API does)
            log.warning("resync list failed: %s", e)
            continue
        for item in items:
            ns = item["metadata"].get("namespace", "")
            if not _in_scope(item, namespaces):
                continue
            try:
                await asyncio.to_thread(
                    reconcile, kube(), item, CONFIG.debug_apply_delay_seconds, False, CONFIG.prometheus_url
                )
            except Exception as e:  # noqa: BLE001
                log.warning("resync of %s/%s failed: %s", ns, item["metadata"]["name"], e)


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, **_: Any) -> None:
    namespaces: tuple[str, ...] = memo.get("namespaces", ())  # __main__'s --namespace flags (none: all)
    memo["resync"] = asyncio.create_task(_resync_forever(namespaces))
    memo["planner"] = asyncio.create_task(_plan_forever(namespaces))


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    for name in ("resync", "planner"):
        task = memo.get(name)
        if task is not None:
            task.cancel()


if CONFIG.watch_children:

    @kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: MANAGER})
    def on_child_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        owner = next(
            (
                r
                for r in body.get("metadata", {}).get("ownerReferences") or ()
                if r.get("controller") and r.get("kind") == "InferenceService"
            ),
            None,
        )
        if owner is None:
            return
        ns = body["metadata"]["namespace"]
        parent = kube().get(f"{API_GROUP}/v1alpha1", "InferenceService", ns, owner["name"])
        if parent is None or parent["metadata"].get("uid") != owner.get("uid"):
            return  # orphan on its way to garbage collection
        try:
            reconcile(
                kube(), parent, CONFIG.debug_apply_delay_seconds, wait=False, prometheus_url=CONFIG.prometheus_url
            )
        except TransientError as e:
            log.info("child event reconcile deferred: %s", e)
