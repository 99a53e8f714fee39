"""kopf wiring: every trigger funnels into reconcile.reconcile().

Triggers: create/update(spec)/resume of an InferenceService, a resync timer (drift in any child,
status refresh) and events of owned Deployments (a deleted or edited Deployment is put back at
once, and readiness changes reach the status without waiting for the timer).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from .config import OperatorConfig
from .kube import Kube, TransientError, load_config
from .reconcile import reconcile
from .render import API_GROUP, LABEL_MANAGED_BY, MANAGER

log = logging.getLogger(__name__)
CONFIG = OperatorConfig.from_env()
PLURAL = "inferenceservices"
_kube: Kube | None = None


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
        prefix=API_GROUP, key="last-handled-configuration")
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
        reconcile(kube(), dict(body), CONFIG.debug_apply_delay_seconds, wait=wait)
    except TransientError as e:
        raise kopf.TemporaryError(str(e), delay=CONFIG.backoff(retry)) from e


@kopf.on.resume(API_GROUP, "v1alpha1", PLURAL)
@kopf.on.create(API_GROUP, "v1alpha1", PLURAL)
@kopf.on.update(API_GROUP, "v1alpha1", PLURAL, field="spec")
def on_change(body: kopf.Body, retry: int, **_: Any) -> None:
    _run(body, retry)


@kopf.timer(API_GROUP, "v1alpha1", PLURAL, interval=CONFIG.resync_seconds, sharp=False)
def resync(body: kopf.Body, **_: Any) -> None:
    # Errors here are logged by kopf and the next tick retries; no backoff bookkeeping needed.
    _run(body, wait=False)


if CONFIG.watch_children:

    @kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: MANAGER})
    def on_child_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
        owner = next((r for r in body.get("metadata", {}).get("ownerReferences") or ()
                      if r.get("controller") and r.get("kind") == "InferenceService"), None)
        if owner is None:
            return
        ns = body["metadata"]["namespace"]
        parent = kube().get(f"{API_GROUP}/v1alpha1", "InferenceService", ns, owner["name"])
        if parent is None or parent["metadata"].get("uid") != owner.get("uid"):
            return  # orphan on its way to garbage collection
        try:
            reconcile(kube(), parent, CONFIG.debug_apply_delay_seconds, wait=False)
        except TransientError as e:
            log.info("child event reconcile deferred: %s", e)
