"""Fixtures for tests on the cluster's real node (kubelet + containerd on this machine, started
by tests/e2e/cluster/up.sh unless KVMESH_REAL_NODE=0). Imported by test_real_node.py; the
`cluster` fixture itself comes from conftest.py.

The probe image (`kvmesh.local/e2e-probe:0.1`, built and imported by the cluster scripts) is
one static binary: `probe serve ADDR`, `probe get URL`, `probe resolve NAME [SERVER]`,
`probe whoami` (SelfSubjectReview through the in-cluster apiserver address).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from .conftest import wait_for

NODE_NAME = os.environ.get("NODE_NAME", "kvmesh-node-0")
PROBE_IMAGE = "kvmesh.local/e2e-probe:0.1"
POD_CIDR = os.environ.get("POD_CIDR", "10.245.0.0/24")


@dataclass
class RealNode:
    name: str
    ip: str
    pod_cidr: str


def _probe_pod(name: str, port: int, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeSelector": {"kvmesh.io/real-node": "true"},
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "probe",
                    "image": PROBE_IMAGE,
                    "imagePullPolicy": "Never",
                    "args": ["serve", f":{port}"],
                    "ports": [{"containerPort": port}],
                    "readinessProbe": {"httpGet": {"path": "/", "port": port}, "periodSeconds": 1},
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def real_node(cluster: Any) -> RealNode:
    if os.environ.get("KVMESH_REAL_NODE") == "0":
        pytest.skip("KVMESH_REAL_NODE=0: the cluster has no real node")
    node = cluster.get("node", NODE_NAME)
    assert node, f"no node {NODE_NAME}: up.sh should have started a real node"
    assert node["metadata"]["labels"].get("kvmesh.io/real-node") == "true"
    ip = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
    return RealNode(NODE_NAME, ip, node["spec"].get("podCIDR") or POD_CIDR)


@pytest.fixture(scope="module")
def probe_ns(cluster: Any, real_node: RealNode) -> Iterator[str]:
    """A namespace with two probe pods on the real node (`web`, `client`) and a ClusterIP
    Service `web` (port 80 -> 8080) in front of `web`; yields once both pods are Ready."""
    ns = f"rn-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", ns)
    objs = [
        _probe_pod("web", 8080, {"app": "web"}),
        _probe_pod("client", 8081, {"app": "client"}),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080, "protocol": "TCP"}]},
        },
    ]
    try:
        # The namespace's default ServiceAccount (KCM) must exist before pods are admitted.
        wait_for("default ServiceAccount", lambda: cluster.get("serviceaccount", "default", ns), timeout=60)
        cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}), ns=ns)
        cluster.kubectl(
            "wait", "-n", ns, "--for=condition=Ready", "pod/web", "pod/client", "--timeout=120s", timeout=150
        )
        yield ns
    except AssertionError:
        print(cluster.kubectl("get", "pods,svc,endpointslices", "-n", ns, "-o", "wide", check=False))
        print(cluster.kubectl("describe", "pods", "-n", ns, check=False)[-4000:])
        raise
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
