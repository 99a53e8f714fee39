"""Must show: `spec.autoscaling.provider: keda` gives one KEDA ScaledObject per worker role that
the API server accepts with KEDA's own CRDs installed (their OpenAPI schemas validate every
field), owned and kept by the operator; switching provider prunes them and brings the HPAs back.

KEDA itself is not run: only its CRDs (tests/e2e/cluster/build.sh fetches them from the
github.com/kedacore/keda/v2 module through the Go module proxy).
"""

from __future__ import annotations

import json

import pytest

from kvmesh.operator.render import render

from .conftest import CACHE, Cluster, Operator, wait_for

pytestmark = pytest.mark.e2e


def _keda_crds_dir():
    from .conftest import ROOT

    env = dict(
        line.split("=", 1)
        for line in (ROOT / "tests" / "e2e" / "cluster" / "versions.env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    return CACHE / f"keda-v{env['KEDA_VERSION']}" / "crds"


@pytest.fixture(scope="module")
def keda_crds(chart: Cluster) -> Cluster:
    d = _keda_crds_dir()
    assert (d / ".done").exists(), f"KEDA CRDs missing: `bash tests/e2e/cluster/build.sh keda-crds` fetches them to {d}"
    for f in sorted(d.glob("keda.sh_*.yaml")):
        # server-side: the ScaledObject CRD is too large for client-side apply's annotation
        chart.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(f))
    chart.kubectl("wait", "--for=condition=Established", "crd/scaledobjects.keda.sh", "--timeout=60s")
    return chart


SPEC = {
    "autoscaling": {
        "enabled": True,
        "provider": "keda",
        "prefill": {"minReplicas": 1, "maxReplicas": 3, "targetTTFTMilliseconds": 400},
        "decode": {"minReplicas": 1, "maxReplicas": 4, "targetITLMilliseconds": 40, "targetKVCacheUsage": 0.7},
    }
}


def _isvc(ns: str, spec: dict) -> str:
    return json.dumps(
        {
            "apiVersion": "serving.kvmesh.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "scaled", "namespace": ns},
            "spec": spec,
        }
    )


def test_keda_scaled_objects_accepted_owned_and_pruned(keda_crds: Cluster, operator: Operator, ns: str) -> None:
    c = keda_crds
    c.apply(_isvc(ns, SPEC))
    owner = wait_for("InferenceService stored", lambda: c.get("inferenceservice", "scaled", ns))
    want = {o["metadata"]["name"]: o for o in render(owner["spec"], owner["metadata"]) if o["kind"] == "ScaledObject"}
    assert sorted(want) == ["scaled-decode", "scaled-prefill"]

    def both() -> list[dict] | None:
        got = [c.get("scaledobject.keda.sh", n, ns) for n in sorted(want)]
        return got if all(got) else None

    for so in wait_for("the operator's ScaledObjects", both, 120):
        name = so["metadata"]["name"]
        (ref,) = so["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("InferenceService", owner["metadata"]["uid"], True)
        assert any(m["manager"] == "kvmesh-operator" for m in so["metadata"]["managedFields"])
        # what the API server stored (after KEDA's schema pruned anything it does not know) is
        # what render() asked for: no field was dropped
        for key, value in want[name]["spec"].items():
            assert so["spec"][key] == value, (name, key)
    assert not c.list("horizontalpodautoscaler.autoscaling", ns)  # KEDA, not the operator, makes the HPA
    for role in ("prefill", "decode"):
        assert '"f:replicas"' not in _applied_fields(c.get("deployment.apps", f"scaled-{role}", ns))

    # A ScaledObject edited by hand is put back (drift correction, like every child).
    c.kubectl(
        "patch",
        "scaledobject.keda.sh",
        "scaled-decode",
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec": {"maxReplicaCount": 40}}',
    )
    wait_for(
        "maxReplicaCount restored",
        lambda: c.get("scaledobject.keda.sh", "scaled-decode", ns)["spec"]["maxReplicaCount"] == 4,
        60,
    )

    # provider hpa: the ScaledObjects are pruned and the operator's HPAs take over.
    c.patch_spec("scaled", ns, {"autoscaling": {"provider": "hpa"}})
    wait_for("ScaledObjects pruned", lambda: not c.list("scaledobject.keda.sh", ns), 120)
    wait_for("HPAs rendered", lambda: len(c.list("horizontalpodautoscaler.autoscaling", ns)) == 2, 120)


def _applied_fields(dep: dict) -> str:
    """The operator's applied fields of a Deployment (JSON of its managedFields entry)."""
    mine = [
        m
        for m in dep["metadata"].get("managedFields") or ()
        if m["manager"] == "kvmesh-operator" and m["operation"] == "Apply"
    ]
    return json.dumps(mine[0]["fieldsV1"]) if mine else ""


def test_a_rendered_scaled_object_with_a_bad_field_is_refused(keda_crds: Cluster, ns: str) -> None:
    """The CRDs do validate: KEDA's schema refuses a ScaledObject whose trigger lacks `type`
    (so the acceptance above means something)."""
    so = render(SPEC, {"name": "bad", "namespace": ns, "uid": "u", "generation": 1})
    (obj,) = [o for o in so if o["kind"] == "ScaledObject" and o["metadata"]["name"] == "bad-decode"]
    obj["metadata"].pop("ownerReferences")
    del obj["spec"]["triggers"][0]["type"]
    r = keda_crds.run("apply", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False)
    assert r.returncode != 0 and "type" in r.stderr, r.stderr
