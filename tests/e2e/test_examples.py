"""Must show: `kubectl apply` of each example gives the expected children (specs, owner
references, labels), pods Running on the fake GPU nodes, Ready=True with the right replica
counts, and the printer columns."""

from __future__ import annotations

import time

import pytest

from kvmesh.operator.crd import engine_properties

from .conftest import Cluster, condition, record, wait_ready
from .helpers import EXAMPLES, RESOURCE, example, expected_children, subset_mismatch

pytestmark = pytest.mark.e2e

# Desired replicas per role once settled (pd-redis autoscales decode with minReplicas 2).
EXPECTED = {
    "minimal": {"prefill": 1, "decode": 1, "router": 1},
    "pd-nixl": {"prefill": 2, "decode": 2, "router": 1},
    "pd-redis": {"prefill": 1, "decode": 2, "router": 1},
}


def test_every_example_is_covered() -> None:
    assert set(EXAMPLES) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_reaches_ready(name: str, chart: Cluster, operator, ns: str) -> None:
    manifest = EXAMPLES[name].read_text()
    is_name = example(name)["metadata"]["name"]
    t0 = time.monotonic()
    chart.apply(manifest, ns)
    obj = wait_ready(chart, is_name, ns)
    record(f"apply_to_ready_seconds.{name}", round(time.monotonic() - t0, 1))

    # Status: replica counts per role, all three conditions, observedGeneration on each.
    st = obj["status"]
    for role, n in EXPECTED[name].items():
        assert st[role] == {"replicas": n, "readyReplicas": n, "summary": f"{n}/{n}"}, st
    for ctype, status in (("Ready", "True"), ("Progressing", "False"), ("Degraded", "False")):
        c = condition(obj, ctype)
        assert c and c["status"] == status, st["conditions"]
        assert c["observedGeneration"] == obj["metadata"]["generation"]
        assert c["reason"] and c["message"] and c["lastTransitionTime"]

    # Children: exactly what render() says, owned by this object, with our labels.
    uid = obj["metadata"]["uid"]
    for want in expected_children(obj):
        kind, cname = want["kind"], want["metadata"]["name"]
        live = chart.get(RESOURCE[kind], cname, ns)
        assert live is not None, f"{kind} {cname} missing"
        refs = live["metadata"].get("ownerReferences") or []
        assert [(r["kind"], r["uid"], r.get("controller")) for r in refs] == [("InferenceService", uid, True)], refs
        labels = live["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == is_name
        assert labels["app.kubernetes.io/managed-by"] == "kvmesh-operator"
        managers = {m["manager"] for m in live["metadata"].get("managedFields") or () if m.get("operation") == "Apply"}
        assert managers == {"kvmesh-operator"}, managers
        for section in ("spec", "data", "rules", "roleRef", "subjects"):
            if section in want:
                miss = subset_mismatch(want[section], live.get(section), f"{kind}/{cname}.{section}")
                assert miss is None, miss

    # Pods: scheduled on the kwok GPU nodes and Running, as many as the replica counts say.
    pods = chart.list("pods", ns, f"app.kubernetes.io/instance={is_name}")
    extra = 1 if name == "pd-redis" else 0  # the managed Redis
    assert len(pods) == sum(EXPECTED[name].values()) + extra, [p["metadata"]["name"] for p in pods]
    for p in pods:
        assert p["status"]["phase"] == "Running", p["status"]
        assert p["spec"]["nodeName"].startswith("kwok-gpu-")
    gpus = sum(
        int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0)) for p in pods for c in p["spec"]["containers"]
    )
    assert gpus == EXPECTED[name]["prefill"] + EXPECTED[name]["decode"]

    # Printer columns.
    table = chart.kubectl("get", "inferenceservices", "-n", ns).splitlines()
    assert table[0].split() == ["NAME", "READY", "PREFILL", "DECODE", "AGE"], table
    row = table[1].split()
    p, d = EXPECTED[name]["prefill"], EXPECTED[name]["decode"]
    assert row[:4] == [is_name, "True", f"{p}/{p}", f"{d}/{d}"], table
    wide = chart.kubectl("get", "kvis", "-n", ns, "-o", "wide").splitlines()
    assert wide[0].split()[4:7] == ["CONNECTOR", "TP", "REASON"], wide
    assert wide[1].split()[4:7] == [obj["spec"]["kvConnector"]["type"], "1", "AllReplicasReady"]


def test_defaults_are_applied_by_the_api_server(chart: Cluster, ns: str) -> None:
    chart.apply(EXAMPLES["minimal"].read_text(), ns)
    spec = chart.get("inferenceservice", "tiny", ns)["spec"]
    # every spec.engine setting at its declared default (EngineArgs' CrdProperty, which the CRD carries)
    assert spec["engine"] == {name: schema["default"] for name, schema in engine_properties().items()}
    assert spec["kvConnector"] == {"type": "nixl"}
    assert spec["model"] == {"source": "embedded"}
    assert spec["prefill"] == {"replicas": 1} and spec["autoscaling"]["enabled"] is False
