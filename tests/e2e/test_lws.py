"""Must show: the test cluster runs LeaderWorkerSet (sigs.k8s.io/lws, the version in
tests/e2e/cluster/versions.env), the substrate the operator's multi-node replicas are rendered
onto. On the kwok nodes, a LeaderWorkerSet of one group of two pods gets its leader pod, its
worker StatefulSet and worker pod, labelled and given the leader's address by LWS's own webhooks.
On the real node, deleting the worker recreates the whole group (restartPolicy
RecreateGroupOnPodRestart, the default): v0.8.0's pod controller deletes the leader (foreground,
so the worker StatefulSet goes with it) and the leader StatefulSet brings a new group up.

Why the recreation runs on the real node: the controller acts on the worker it sees terminating.
A kubelet takes its time over that (SIGTERM, sandbox teardown); kwok deletes a terminating pod
within ~15 ms, so the controller misses it now and then (1 deletion in 20 here).

The controller and its CRD are built from the module by tests/e2e/cluster/build.sh and started by
up.sh like kube-controller-manager.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import Cluster, wait_for
from .realnode import NODE_NAME, PROBE_IMAGE, real_node  # noqa: F401 (real_node: a fixture)

pytestmark = pytest.mark.e2e

NAME = "mn"
LABEL = "leaderworkerset.sigs.k8s.io/"
LEADER, WORKER = f"{NAME}-0", f"{NAME}-0-1"  # group 0's leader; its worker StatefulSet's pod 1
KWOK_POD = {"containers": [{"name": "worker", "image": "example.test/lws:1"}]}  # kwok "runs" any image
REAL_POD = {
    "nodeSelector": {"kvmesh.io/real-node": "true"},
    "terminationGracePeriodSeconds": 2,
    "containers": [{"name": "worker", "image": PROBE_IMAGE, "imagePullPolicy": "Never", "args": ["serve", ":8080"]}],
}


def _lws(ns: str, pod_spec: dict[str, Any]) -> str:
    """One group (replicas 1) of a leader and one worker (size 2), both from `pod_spec`."""
    return json.dumps(
        {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": {"name": NAME, "namespace": ns},
            "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, "workerTemplate": {"spec": pod_spec}}},
        }
    )


def _running(c: Cluster, name: str, ns: str, not_uid: str | None = None) -> dict[str, Any] | None:
    """The pod `name` once Running (and, with not_uid, once it is a new pod of that name)."""
    pod = c.get("pod", name, ns)
    if not pod or pod["status"].get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
        return None
    return pod if pod["metadata"]["uid"] != not_uid else None


def _owned(c: Cluster, kind: str, name: str, ns: str, owner: dict[str, Any], running: bool = False) -> Any:
    """The object `name` once its controller is `owner` (and, with running, once it is Running)."""
    obj = _running(c, name, ns) if running else c.get(kind, name, ns)
    refs = (obj or {}).get("metadata", {}).get("ownerReferences") or ()
    return obj if any(r.get("controller") and r["uid"] == owner["metadata"]["uid"] for r in refs) else None


def _env(pod: dict[str, Any]) -> dict[str, str]:
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in container.get("env") or ()}


def test_lws_group_created_and_labelled(chart: Cluster, ns: str) -> None:
    c = chart
    c.apply(_lws(ns, KWOK_POD))
    lws = wait_for("LeaderWorkerSet stored", lambda: c.get("leaderworkerset.leaderworkerset.x-k8s.io", NAME, ns))
    # LWS's defaulting webhook ran (the CRD schema alone defaults neither of these)
    assert lws["spec"]["networkConfig"]["subdomainPolicy"] == "Shared"
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["maxUnavailable"] == 1
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"

    leader = wait_for("leader pod Running", lambda: _running(c, LEADER, ns), 120)
    labels = leader["metadata"]["labels"]
    assert (labels[LABEL + "name"], labels[LABEL + "group-index"], labels[LABEL + "worker-index"]) == (NAME, "0", "0")

    sts = wait_for("worker StatefulSet", lambda: c.get("statefulset.apps", LEADER, ns), 120)
    (owner,) = sts["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Pod", LEADER, leader["metadata"]["uid"])
    assert sts["spec"]["replicas"] == 1  # size 2: the leader plus one worker
    assert (sts["metadata"]["labels"][LABEL + "name"], sts["metadata"]["labels"][LABEL + "group-index"]) == (NAME, "0")

    worker = wait_for("worker pod Running", lambda: _running(c, WORKER, ns), 120)
    wl = worker["metadata"]["labels"]
    assert (wl[LABEL + "name"], wl[LABEL + "group-index"], wl[LABEL + "worker-index"]) == (NAME, "0", "1")
    assert wl[LABEL + "group-key"] == labels[LABEL + "group-key"]
    # the pod webhook's env: the leader's stable DNS name through the LWS's headless Service
    want = {"LWS_LEADER_ADDRESS": f"{LEADER}.{NAME}.{ns}", "LWS_GROUP_SIZE": "2"}
    assert _env(worker) == {**want, "LWS_WORKER_INDEX": "1"}
    assert _env(leader) == {**want, "LWS_WORKER_INDEX": "0"}
    svc = c.get("service", NAME, ns)
    assert svc and svc["spec"]["clusterIP"] == "None"


@pytest.fixture
def real_ns(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace without the kwok tier's annotations: its CPU pods go to the real node."""
    request.getfixturevalue("real_node")  # skips without a real node (KVMESH_REAL_NODE=0)
    ns = f"rn-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", ns)
    try:
        # The namespace's default ServiceAccount (KCM) must exist before pods are admitted.
        wait_for("default ServiceAccount", lambda: cluster.get("serviceaccount", "default", ns), timeout=60)
        yield ns
    except AssertionError:
        print(cluster.kubectl("get", "leaderworkerset,statefulset,pods", "-n", ns, "-o", "wide", check=False))
        raise
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_deleting_the_worker_recreates_the_group(cluster: Cluster, real_ns: str) -> None:
    c, ns = cluster, real_ns
    c.apply(_lws(ns, REAL_POD))
    leader = wait_for("leader pod Running", lambda: _running(c, LEADER, ns), 120)
    sts = wait_for("its worker StatefulSet", lambda: _owned(c, "statefulset.apps", LEADER, ns, leader), 120)
    worker = wait_for("its worker pod Running", lambda: _owned(c, "pod", WORKER, ns, sts, running=True), 120)
    assert worker["spec"]["nodeName"] == leader["spec"]["nodeName"] == NODE_NAME

    # The worker's deletion makes the controller delete the leader (foreground: its worker
    # StatefulSet and worker pod go with it); the leader StatefulSet recreates the leader, which
    # gets a new worker StatefulSet and worker.
    c.kubectl("delete", "pod", WORKER, "-n", ns, "--wait=false")
    new_leader = wait_for("a new leader pod", lambda: _running(c, LEADER, ns, not_uid=leader["metadata"]["uid"]), 120)
    new_sts = wait_for("its worker StatefulSet", lambda: _owned(c, "statefulset.apps", LEADER, ns, new_leader), 120)
    new_worker = wait_for("its worker pod", lambda: _owned(c, "pod", WORKER, ns, new_sts, running=True), 120)
    assert new_sts["metadata"]["uid"] != sts["metadata"]["uid"]
    assert new_worker["metadata"]["uid"] != worker["metadata"]["uid"]
    assert new_worker["metadata"]["labels"][LABEL + "group-index"] == "0"
    assert _env(new_worker)["LWS_LEADER_ADDRESS"] == f"{LEADER}.{NAME}.{ns}"
    events = json.loads(
        c.kubectl("get", "events", "-n", ns, "--field-selector", "reason=RecreateGroupOnPodRestart", "-o", "json")
    )["items"]
    assert any(f"deleted leader pod {LEADER}" in e["message"] for e in events), events
