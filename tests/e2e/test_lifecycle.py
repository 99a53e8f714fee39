"""Must show: spec updates flow to children and observedGeneration; a deleted or hand-edited
child comes back; deleting the InferenceService garbage-collects every child; invalid specs
that pass the schema give Degraded; foreign objects are never adopted; an operator restart in
the middle of a reconcile converges without duplicates."""

from __future__ import annotations

import json
import signal

import pytest

from .conftest import Cluster, Operator, condition, wait_for, wait_ready
from .helpers import EXAMPLES, RESOURCE, example, expected_children

pytestmark = pytest.mark.e2e

CHILD_KINDS = ",".join(sorted(set(RESOURCE.values()) | {"pods", "replicasets.apps"}))


def children(c: Cluster, ns: str, name: str) -> list[dict]:
    out = c.kubectl("get", CHILD_KINDS, "-n", ns, "-o", "json", "-l", f"app.kubernetes.io/instance={name}")
    return json.loads(out)["items"]


def container(c: Cluster, ns: str, dep: str) -> dict:
    return c.get("deployment.apps", dep, ns)["spec"]["template"]["spec"]["containers"][0]


def test_spec_update_flows_to_children(chart: Cluster, operator: Operator, ns: str) -> None:
    chart.apply(EXAMPLES["minimal"].read_text(), ns)
    before = wait_ready(chart, "tiny", ns)
    assert before["metadata"]["generation"] == 1
    old_decode_uid = chart.get("deployment.apps", "tiny-decode", ns)["metadata"]["uid"]

    chart.patch_spec("tiny", ns, {"decode": {"replicas": 2, "image": "example.test/w:2"}, "engine": {"maxNumSeqs": 32}})
    after = wait_ready(chart, "tiny", ns)
    assert after["metadata"]["generation"] == 2
    assert after["status"]["observedGeneration"] == 2
    assert all(c["observedGeneration"] == 2 for c in after["status"]["conditions"])
    assert after["status"]["decode"] == {"replicas": 2, "readyReplicas": 2, "summary": "2/2"}

    dec = chart.get("deployment.apps", "tiny-decode", ns)
    assert dec["metadata"]["uid"] == old_decode_uid  # updated in place, not replaced
    assert dec["spec"]["replicas"] == 2
    args = dec["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "32"
    assert dec["spec"]["template"]["spec"]["containers"][0]["image"] == "example.test/w:2"
    pre = container(chart, ns, "tiny-prefill")
    assert pre["image"] == "ghcr.io/kvmesh/worker:0.1.0"  # role override only on decode
    assert pre["args"][pre["args"].index("--max-num-seqs") + 1] == "32"
    cfg = json.loads(chart.get("configmap", "tiny-config", ns)["data"]["engine.json"])
    assert cfg["engine"]["maxNumSeqs"] == 32


def test_autoscaling_toggle_adds_and_prunes_hpas(chart: Cluster, operator: Operator, ns: str) -> None:
    chart.apply(EXAMPLES["minimal"].read_text(), ns)
    wait_ready(chart, "tiny", ns)
    on = {"enabled": True, "provider": "hpa"}
    on |= {"prefill": {"targetTTFTMilliseconds": 500}, "decode": {"targetITLMilliseconds": 50}}
    chart.patch_spec("tiny", ns, {"autoscaling": on})
    hpa = "horizontalpodautoscaler.autoscaling"
    wait_for("HPAs", lambda: len(chart.list(hpa, ns)) == 2)
    wait_ready(chart, "tiny", ns)
    chart.patch_spec("tiny", ns, {"autoscaling": {"enabled": False}})
    wait_for("HPAs pruned", lambda: chart.list(hpa, ns) == [])


def test_deleted_or_edited_child_comes_back(chart: Cluster, operator: Operator, ns: str) -> None:
    chart.apply(EXAMPLES["minimal"].read_text(), ns)
    wait_ready(chart, "tiny", ns)
    old = chart.get("deployment.apps", "tiny-decode", ns)["metadata"]["uid"]
    chart.kubectl("delete", "deployment", "tiny-decode", "-n", ns, "--wait=true")

    def recreated():
        d = chart.get("deployment.apps", "tiny-decode", ns)
        return d if d and d["metadata"]["uid"] != old else None

    wait_for("tiny-decode recreated", recreated)
    wait_ready(chart, "tiny", ns)

    # Drift: a hand edit of a field the operator owns is reverted.
    chart.kubectl("scale", "deployment", "tiny-prefill", "-n", ns, "--replicas=3")
    chart.kubectl("delete", "service", "tiny-workers", "-n", ns)
    chart.kubectl(
        "patch", "configmap", "tiny-config", "-n", ns, "--type=merge", "-p", '{"data": {"engine.json": "{}"}}'
    )
    wait_for("prefill back to 1", lambda: chart.get("deployment.apps", "tiny-prefill", ns)["spec"]["replicas"] == 1)
    wait_for("headless service back", lambda: chart.get("service", "tiny-workers", ns))
    wait_for("config restored", lambda: chart.get("configmap", "tiny-config", ns)["data"]["engine.json"] != "{}")
    wait_ready(chart, "tiny", ns)


def test_deleting_the_inferenceservice_removes_every_child(chart: Cluster, operator: Operator, ns: str) -> None:
    chart.apply(EXAMPLES["pd-redis"].read_text(), ns)
    wait_ready(chart, "llama-pd-redis", ns)
    assert len(children(chart, ns, "llama-pd-redis")) > 10
    chart.kubectl("delete", "inferenceservice", "llama-pd-redis", "-n", ns, "--wait=true")
    wait_for("garbage collection", lambda: children(chart, ns, "llama-pd-redis") == [], timeout=180)


def test_invalid_spec_that_passes_the_schema_is_degraded(chart: Cluster, operator: Operator, ns: str) -> None:
    body = example("minimal")
    body["spec"] = {"engine": {"maxNumBatchedTokens": 32, "maxNumSeqs": 64}}
    chart.apply(json.dumps(body), ns)

    def degraded():
        c = condition(chart.get("inferenceservice", "tiny", ns), "Degraded")
        return c if c and c["status"] == "True" else None

    c = wait_for("Degraded=True", degraded)
    assert c["reason"] == "InvalidSpec"
    assert "maxNumBatchedTokens (32) must be >= engine.maxNumSeqs (64)" in c["message"]
    obj = chart.get("inferenceservice", "tiny", ns)
    assert condition(obj, "Ready")["status"] == "False"
    assert condition(obj, "Progressing")["status"] == "False"
    assert children(chart, ns, "tiny") == []  # nothing rendered from an invalid spec

    chart.patch_spec("tiny", ns, {"engine": {"maxNumBatchedTokens": 256}})
    fixed = wait_ready(chart, "tiny", ns)
    assert condition(fixed, "Degraded")["status"] == "False"


def test_foreign_objects_are_not_adopted(chart: Cluster, operator: Operator, ns: str) -> None:
    chart.kubectl("create", "configmap", "tiny-config", "-n", ns, "--from-literal=owner=someone")
    chart.apply(EXAMPLES["minimal"].read_text(), ns)

    def conflict():
        c = condition(chart.get("inferenceservice", "tiny", ns), "Degraded")
        return c if c and c["status"] == "True" else None

    c = wait_for("Degraded=True", conflict)
    assert c["reason"] == "ChildConflict"
    assert "ConfigMap tiny-config exists and is not owned" in c["message"]
    assert condition(chart.get("inferenceservice", "tiny", ns), "Ready")["status"] == "False"
    cm = chart.get("configmap", "tiny-config", ns)
    assert cm["data"] == {"owner": "someone"}
    assert not cm["metadata"].get("ownerReferences")
    assert not any(m["manager"] == "kvmesh-operator" for m in cm["metadata"]["managedFields"])
    # The rest is still reconciled.
    wait_for("deployments", lambda: len(chart.list("deployment.apps", ns)) == 3)


def test_operator_restart_mid_reconcile_converges(chart: Cluster, operator: Operator, ns: str) -> None:
    """Kill the operator (SIGKILL, no cleanup) after it applied some but not all children of a
    new InferenceService; a fresh operator must finish the job with no duplicates."""
    name = "qwen-pd-nixl"
    operator.stop()
    try:
        chart.apply(EXAMPLES["pd-nixl"].read_text(), ns)
        operator.start(KVMESH_OPERATOR_DEBUG_APPLY_DELAY_SECONDS="1.5")
        total = len(expected_children(chart.get("inferenceservice", name, ns)))
        partial = wait_for(
            "some children applied",
            lambda: len([o for o in children(chart, ns, name) if o["kind"] not in ("Pod", "ReplicaSet")]) or None,
            timeout=120,
            interval=0.2,
        )
        assert partial < total, "operator finished before it could be interrupted"
        operator.stop(signal.SIGKILL)
    finally:
        if not operator.alive():
            operator.start()
    obj = wait_ready(chart, name, ns)
    got = {}
    for o in children(chart, ns, name):
        got.setdefault(o["kind"], []).append(o["metadata"]["name"])
    want = {}
    for o in expected_children(obj):
        want.setdefault(o["kind"], []).append(o["metadata"]["name"])
    for kind, names in want.items():
        assert sorted(got.get(kind, [])) == sorted(names), (kind, got.get(kind))
    # One ReplicaSet per Deployment (no spurious rollouts), and exactly the desired pods.
    assert len(got["ReplicaSet"]) == 3, got["ReplicaSet"]
    assert len(got["Pod"]) == 5, got["Pod"]


def test_delete_works_while_the_operator_is_down(chart: Cluster, operator: Operator, ns: str) -> None:
    """No kopf finalizer on InferenceServices: deleting one never waits for the operator."""
    chart.apply(EXAMPLES["minimal"].read_text(), ns)
    obj = wait_ready(chart, "tiny", ns)
    assert not obj["metadata"].get("finalizers")
    operator.stop()
    try:
        chart.kubectl("delete", "inferenceservice", "tiny", "-n", ns, "--wait=true", "--timeout=120s")
        wait_for("garbage collection", lambda: children(chart, ns, "tiny") == [], timeout=180)
    finally:
        operator.start()


def test_lora_adapters_change_only_their_configmap_and_are_pruned(chart: Cluster, operator: Operator, ns: str) -> None:
    """spec.loraAdapters: adding an adapter from a claim already mounted changes NAME-lora-adapters and
    status, never the workers' Deployments (their generation stays); removing every adapter prunes the
    ConfigMap and takes the flags off (a rollout)."""

    def adapters(*names: str) -> list[dict]:
        return [{"name": n, "volume": {"claimName": "models", "subPath": f"loras/{n}"}} for n in names]

    def files() -> dict:
        cm = chart.get("configmap", "tiny-lora-adapters", ns)
        return json.loads(cm["data"]["adapters.json"])["adapters"] if cm else {}

    body = example("minimal")
    body["spec"]["loraAdapters"] = adapters("a")
    chart.apply(json.dumps(body), ns)
    st = wait_ready(chart, "tiny", ns)["status"]
    assert st["loraAdapters"] == {"prefill": ["a"], "decode": ["a"]}
    assert files() == {"a": "/adapters/pvc/models/loras/a"}
    gens = {r: chart.get("deployment.apps", f"tiny-{r}", ns)["metadata"]["generation"] for r in ("prefill", "decode")}
    for r in ("prefill", "decode"):
        args = container(chart, ns, f"tiny-{r}")["args"]
        assert "--enable-lora" in args and "--lora-modules-file" in args

    chart.patch_spec("tiny", ns, {"loraAdapters": adapters("a", "b")})
    st = wait_ready(chart, "tiny", ns)["status"]
    assert st["loraAdapters"] == {"prefill": ["a", "b"], "decode": ["a", "b"]}
    assert files() == {"a": "/adapters/pvc/models/loras/a", "b": "/adapters/pvc/models/loras/b"}
    for r, g in gens.items():
        assert chart.get("deployment.apps", f"tiny-{r}", ns)["metadata"]["generation"] == g, r

    chart.patch_spec("tiny", ns, {"loraAdapters": None})
    wait_for("NAME-lora-adapters pruned", lambda: chart.get("configmap", "tiny-lora-adapters", ns) is None)
    st = wait_ready(chart, "tiny", ns)["status"]
    assert "loraAdapters" not in st
    assert "--enable-lora" not in container(chart, ns, "tiny-decode")["args"]
