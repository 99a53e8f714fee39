"""Must show, against the real API server: each ServiceAccount the chart and the operator create
holds exactly the permissions of the table in docs/operator.md (Security, RBAC); the generated
Secret is created once, owned by the InferenceService, referenced by the pods and never rewritten
(keys stable across reconciles), one the user made is left alone, and it is deleted with its
owner; the NetworkPolicies are created and switched off by the spec."""

from __future__ import annotations

import base64
import json
import re
from collections import defaultdict

import pytest

from .conftest import OPERATOR_NS, OPERATOR_SA, ROOT, Cluster, Operator, wait_for, wait_ready
from .helpers import EXAMPLES

pytestmark = pytest.mark.e2e

INTERNAL_KEYS = {"upstream-api-key", "kv-auth-key", "redis-password", "admin-key"}
# What Kubernetes grants every authenticated identity (system:basic-user, system:discovery,
# system:public-info-viewer): not ours to document or to remove.
EVERYONE = {
    "selfsubjectreviews.authentication.k8s.io",
    "selfsubjectaccessreviews.authorization.k8s.io",
    "selfsubjectrulesreviews.authorization.k8s.io",
}


def documented(identity: str) -> dict[str, set[str]]:
    """resource -> verbs of `identity` in the RBAC table of docs/operator.md."""
    text = (ROOT / "docs" / "operator.md").read_text()
    section = text.split("### RBAC", 1)[1].split("\n#", 1)[0]
    out: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] == identity:
            out[cells[2].strip("`")] = {v.strip() for v in cells[3].split(",")}
    assert out, f"no rows for {identity} in docs/operator.md"
    return out


def granted(c: Cluster, ns: str, sa: str) -> dict[str, set[str]]:
    """resource -> verbs from `kubectl auth can-i --list` as the ServiceAccount (impersonated by
    the admin), in namespace ns; cluster-wide rules show up in every namespace."""
    out = c.kubectl("auth", "can-i", "--list", f"--as=system:serviceaccount:{ns}:{sa}", "-n", ns)
    rules: dict[str, set[str]] = defaultdict(set)
    for line in out.splitlines()[1:]:
        m = re.match(r"^(\S+)\s+\[(.*?)\]\s+\[(.*?)\]\s+\[(.*?)\]\s*$", line)
        if not m:
            assert line.startswith(" ") or not line.strip(), line  # non-resource URL rows
            continue
        resource, _, names, verbs = m.groups()
        assert not names, line  # no per-name grants
        if resource not in EVERYONE:
            rules[resource] |= set(verbs.split())
    return dict(rules)


def test_operator_service_account_holds_exactly_the_documented_permissions(chart: Cluster) -> None:
    assert granted(chart, OPERATOR_NS, OPERATOR_SA) == documented("operator")


def secret(c: Cluster, name: str, ns: str) -> dict | None:
    return c.get("secret", name, ns)


def decoded(s: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in s["data"].items()}


def test_router_service_account_and_generated_secret(chart: Cluster, operator: Operator, ns: str) -> None:
    chart.apply(EXAMPLES["minimal"].read_text(), ns)
    obj = wait_ready(chart, "tiny", ns)
    assert granted(chart, ns, "tiny-router") == documented("router")

    s = wait_for("generated Secret", lambda: secret(chart, "tiny-kvmesh-internal", ns))
    (ref,) = s["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"], ref["controller"]) == ("InferenceService", obj["metadata"]["uid"], True)
    keys = decoded(s)
    assert set(keys) == INTERNAL_KEYS and len(set(keys.values())) == 4 and all(len(v) >= 40 for v in keys.values())
    # the pods reference it; no Deployment holds a value
    for dep in ("tiny-prefill", "tiny-decode", "tiny-router"):
        d = chart.get("deployment.apps", dep, ns)
        refs = {
            e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
            for e in d["spec"]["template"]["spec"]["containers"][0]["env"]
            if "secretKeyRef" in (e.get("valueFrom") or {})
        }
        assert refs["KVMESH_KV_AUTH_KEY"] == "kv-auth-key", dep
        assert refs["KVMESH_ADMIN_KEY"] == "admin-key", dep  # /drain, /reset_prefix_cache, /pods
        assert not any(v in json.dumps(d) for v in keys.values()), dep
    # NetworkPolicies are among the children
    policies = {p["metadata"]["name"] for p in chart.list("networkpolicy.networking.k8s.io", ns)}
    assert policies == {"tiny-default-deny", "tiny-router", "tiny-workers"}

    # Reconciles after a spec change (and every resync meanwhile) leave the keys as they are.
    chart.patch_spec("tiny", ns, {"engine": {"maxNumSeqs": 32}})
    after = wait_ready(chart, "tiny", ns)
    assert after["status"]["observedGeneration"] == 2
    s2 = secret(chart, "tiny-kvmesh-internal", ns)
    assert s2["metadata"]["resourceVersion"] == s["metadata"]["resourceVersion"]
    assert decoded(s2) == keys

    # The spec switch removes the policies (pruned like any child no longer rendered).
    chart.patch_spec("tiny", ns, {"networkPolicy": {"enabled": False}})
    wait_for("policies pruned", lambda: not chart.list("networkpolicy.networking.k8s.io", ns), 60)

    # Deleting the InferenceService deletes its Secret (garbage collection through the owner reference).
    chart.kubectl("delete", "inferenceservice", "tiny", "-n", ns)
    wait_for("generated Secret garbage-collected", lambda: secret(chart, "tiny-kvmesh-internal", ns) is None, 120)
    # no RBAC denial (the log is the session's: other tests' namespaces being deleted give 403s too)
    assert operator.alive()
    assert f'User "system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}" cannot' not in operator.logs()


def test_a_secret_the_user_brought_is_left_alone(chart: Cluster, operator: Operator, ns: str) -> None:
    mine = {k: f"user-{k}-value" for k in INTERNAL_KEYS}
    chart.kubectl(
        "create",
        "secret",
        "generic",
        "tiny-kvmesh-internal",
        "-n",
        ns,
        *(f"--from-literal={k}={v}" for k, v in mine.items()),
    )
    chart.apply(EXAMPLES["minimal"].read_text(), ns)
    wait_ready(chart, "tiny", ns)
    s = secret(chart, "tiny-kvmesh-internal", ns)
    assert decoded(s) == mine
    assert not s["metadata"].get("ownerReferences")
