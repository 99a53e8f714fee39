"""Thin, typed access to the API for the handful of kinds the operator owns.

Why not the dynamic client: it runs discovery on start and hides the request; the operator only
needs apply / get / delete / list-by-label on a fixed set of kinds, and explicit REST paths keep
the RBAC story obvious (every verb used here is one the chart grants).
"""

from __future__ import annotations

import builtins
import json
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from .render import MANAGER


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str

    def collection(self, namespace: str) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        return f"{base}/namespaces/{namespace}/{self.plural}"


KINDS: dict[tuple[str, str], Kind] = {
    (k.api_version, k.kind): k
    for k in (
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Service", "services"),
        Kind("v1", "ServiceAccount", "serviceaccounts"),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
        Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        # autoscaling.provider keda; a cluster without KEDA's CRDs answers 404 to list (see list).
        Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
        # Worker roles whose replicas span hosts (engine.tensorParallelNodes > 1); needs LWS's CRD.
        Kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets"),
    )
}
# Not in KINDS (never applied, listed or pruned): the operator may only create Secrets, so it can
# read none; the generated one goes away with its owner (garbage collection).
SECRETS = Kind("v1", "Secret", "secrets")
INFERENCE_SERVICES = Kind("serving.kvmesh.io/v1alpha1", "InferenceService", "inferenceservices")
# Also not in KINDS: the planner reads the workers' pods, labels the one it drains and sets its
# deletion cost, and writes replica counts through the scale subresource of its workload (KINDS).
PODS = Kind("v1", "Pod", "pods")

# Status codes worth retrying: throttling, server-side trouble, and conflicts from racing writers.
TRANSIENT_STATUS = frozenset({409, 429, 500, 502, 503, 504})


class TransientError(Exception):
    """The API call may succeed later (network trouble, 5xx, 429, conflicts)."""


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in TRANSIENT_STATUS or exc.status == 0
    return isinstance(exc, (ConnectionError, TimeoutError, OSError, urllib3.exceptions.HTTPError))


def load_config() -> None:
    """In-cluster service account first, then KUBECONFIG (local runs and e2e tests)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class Kube:
    """One ApiClient; every write is server-side apply with the operator's field manager."""

    def __init__(self, api: client.ApiClient | None = None) -> None:
        self.api = api or client.ApiClient()

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, Any]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        try:
            params = self.api.param_serialize(
                method=method,
                resource_path=path,
                query_params=query or [],
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
            )
            resp = self.api.call_api(*params, _request_timeout=30)
            raw = resp.read()
        except ApiException as e:
            if is_transient(e):
                raise TransientError(f"{method} {path}: {e.status} {e.reason}") from e
            raise
        except (ConnectionError, TimeoutError, OSError, urllib3.exceptions.HTTPError) as e:
            raise TransientError(f"{method} {path}: {e}") from e
        if not 200 <= resp.status <= 299:
            exc = ApiException(status=resp.status, reason=resp.reason)
            exc.body = raw.decode(errors="replace") if raw else ""
            if is_transient(exc):
                raise TransientError(f"{method} {path}: {resp.status} {exc.body[:200]}") from exc
            raise exc
        return json.loads(raw) if raw else None

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply. force=True: our manager owns the fields it renders, so a hand edit
        of one of them is reverted (drift correction) rather than reported as a conflict."""
        k = KINDS[(obj["apiVersion"], obj["kind"])]
        path = f"{k.collection(obj['metadata']['namespace'])}/{obj['metadata']['name']}"
        return self._call(
            "PATCH",
            path,
            body=obj,
            query=[("fieldManager", MANAGER), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )

    def create_if_absent(self, obj: dict[str, Any]) -> bool:
        """Create a Secret unless one of that name exists (409: left exactly as it is). True when
        this call created it. Create is the only Secret verb the operator holds."""
        try:
            self._call(
                "POST", SECRETS.collection(obj["metadata"]["namespace"]), body=obj, query=[("fieldManager", MANAGER)]
            )
        except TransientError as e:
            if isinstance(e.__cause__, ApiException) and e.__cause__.status == 409:
                return False
            raise
        return True

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        k = KINDS[(api_version, kind)] if (api_version, kind) in KINDS else INFERENCE_SERVICES
        try:
            return self._call("GET", f"{k.collection(namespace)}/{name}")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict]:
        """Children of one kind by label; a kind the cluster does not serve (a CRD such as KEDA's
        not installed) has none."""
        k = KINDS[(api_version, kind)]
        try:
            out = self._call("GET", k.collection(namespace), query=[("labelSelector", label_selector)])
        except ApiException as e:
            if e.status == 404:
                return []
            raise
        return list(out.get("items") or [])

    def list_inference_services(self) -> builtins.list[dict]:  # `list` here is the method above
        """All InferenceServices the operator may see (cluster-wide list, filtered by caller)."""
        k = INFERENCE_SERVICES
        out = self._call("GET", f"/apis/{k.api_version}/{k.plural}")
        return list(out.get("items") or [])

    def delete(self, api_version: str, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete with a uid precondition so we never remove a same-named replacement."""
        k = KINDS[(api_version, kind)]
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": {"uid": uid},
            "propagationPolicy": "Background",
        }
        try:
            self._call("DELETE", f"{k.collection(namespace)}/{name}", body=body)
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def list_pods(self, namespace: str, label_selector: str) -> builtins.list[dict]:
        out = self._call("GET", PODS.collection(namespace), query=[("labelSelector", label_selector)])
        return list(out.get("items") or [])

    def patch_pod_metadata(
        self, namespace: str, name: str, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None
    ) -> None:
        """Merge-patch a pod's labels/annotations (404: the pod is gone, nothing to do)."""
        meta: dict[str, Any] = {}
        if labels:
            meta["labels"] = labels
        if annotations:
            meta["annotations"] = annotations
        try:
            self._call(
                "PATCH",
                f"{PODS.collection(namespace)}/{name}",
                body={"metadata": meta},
                content_type="application/merge-patch+json",
            )
        except ApiException as e:
            if e.status != 404:
                raise

    def scale(
        self, namespace: str, name: str, replicas: int, kind: tuple[str, str] = ("apps/v1", "Deployment")
    ) -> None:
        """Set a Deployment's (or a LeaderWorkerSet's: ``kind``) replicas through its scale subresource
        (the operator's manifests leave the field out while an autoscaler owns it)."""
        self._call(
            "PATCH",
            f"{KINDS[kind].collection(namespace)}/{name}/scale",
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        path = f"{INFERENCE_SERVICES.collection(namespace)}/{name}/status"
        try:
            self._call("PATCH", path, body={"status": status}, content_type="application/merge-patch+json")
        except ApiException as e:
            if e.status != 404:  # the object went away: nothing to report on
                raise
