"""Assertions shared by e2e modules (kept out of conftest so they are plain imports)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvmesh.operator.render import render

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {p.stem: p for p in sorted((ROOT / "examples").glob("*.yaml"))}

# kubectl resource names for the kinds render() produces.
RESOURCE = {
    "ConfigMap": "configmap",
    "Service": "service",
    "ServiceAccount": "serviceaccount",
    "Deployment": "deployment.apps",
    "PodDisruptionBudget": "poddisruptionbudget.policy",
    "HorizontalPodAutoscaler": "horizontalpodautoscaler.autoscaling",
    "Role": "role.rbac.authorization.k8s.io",
    "RoleBinding": "rolebinding.rbac.authorization.k8s.io",
    "NetworkPolicy": "networkpolicy.networking.k8s.io",
}


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load(EXAMPLES[name].read_text())


def expected_children(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """render() of a live InferenceService (after the API server defaulted it)."""
    return render(obj["spec"], obj["metadata"])


def subset_mismatch(want: Any, got: Any, path: str = "") -> str | None:
    """First place where `want` is not contained in `got` (the live object has defaults added
    by the API server; quantities compare by their string form)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return f"{path}: expected object, got {got!r}"
        for k, v in want.items():
            if k not in got:
                return f"{path}.{k}: missing"
            m = subset_mismatch(v, got[k], f"{path}.{k}")
            if m:
                return m
        return None
    if isinstance(want, list):
        if not isinstance(got, list) or len(want) != len(got):
            return f"{path}: expected {want!r}, got {got!r}"
        for i, (w, g) in enumerate(zip(want, got)):
            m = subset_mismatch(w, g, f"{path}[{i}]")
            if m:
                return m
        return None
    if want == got or str(want) == str(got):
        return None
    return f"{path}: expected {want!r}, got {got!r}"
