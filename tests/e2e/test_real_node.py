"""Smoke test of the cluster's real node: a pod really runs (containerd + runc), is reachable
on its pod IP from the host, a ClusterIP Service works through kube-proxy from the host and
from another pod, cluster DNS resolves Service names inside pods, the pod's ServiceAccount
token reaches the apiserver through https://10.96.0.1, and `kubectl logs` is served by the
kubelet."""

from __future__ import annotations

import ipaddress
import urllib.request
from typing import Any

import pytest

from .conftest import wait_for
from .realnode import RealNode, probe_ns, real_node  # noqa: F401 (fixtures)

pytestmark = pytest.mark.e2e


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 (local test addresses)
        return r.read().decode()


def exec_probe(cluster: Any, ns: str, pod: str, *args: str) -> str:
    return cluster.kubectl("exec", "-n", ns, pod, "--", "/probe", *args, timeout=60)


def pod(cluster: Any, ns: str, name: str) -> dict[str, Any]:
    obj = cluster.get("pod", name, ns)
    assert obj
    return obj


def test_pod_runs_on_real_node(cluster: Any, real_node: RealNode, probe_ns: str) -> None:
    web = pod(cluster, probe_ns, "web")
    assert web["spec"]["nodeName"] == real_node.name
    assert web["status"]["phase"] == "Running"
    ip = ipaddress.ip_address(web["status"]["podIP"])
    assert ip in ipaddress.ip_network(real_node.pod_cidr)
    assert http_get(f"http://{ip}:8080/") == "probe web\n"


def test_cpu_pods_avoid_gpu_nodes(cluster: Any) -> None:
    for node in cluster.list("node", "default"):
        labels = node["metadata"]["labels"]
        if labels.get("type") == "kwok":
            taints = node["spec"].get("taints") or []
            assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in taints


def test_cluster_ip_from_host_and_pod(cluster: Any, real_node: RealNode, probe_ns: str) -> None:
    svc = cluster.get("service", "web", probe_ns)
    assert svc
    cip = svc["spec"]["clusterIP"]
    # kube-proxy programs the rules shortly after the EndpointSlice appears: poll, don't sleep.
    body = wait_for("ClusterIP from the host", lambda: _try(lambda: http_get(f"http://{cip}/")), timeout=60)
    assert body == "probe web\n"
    assert exec_probe(cluster, probe_ns, "client", "get", f"http://{cip}/") == "probe web\n"
    # hairpin: a pod reaching itself through its own Service
    assert exec_probe(cluster, probe_ns, "web", "get", f"http://{cip}/") == "probe web\n"


def test_dns_in_pod(cluster: Any, probe_ns: str) -> None:
    cip = cluster.get("service", "web", probe_ns)["spec"]["clusterIP"]  # type: ignore[index]
    for name in (f"web.{probe_ns}.svc.cluster.local", f"web.{probe_ns}.svc", "web"):
        assert exec_probe(cluster, probe_ns, "client", "resolve", name).split() == [cip], name
    assert exec_probe(cluster, probe_ns, "client", "resolve", "kubernetes.default.svc.cluster.local").split() == [
        "10.96.0.1"
    ]
    body = exec_probe(cluster, probe_ns, "client", "get", f"http://web.{probe_ns}.svc/")
    assert body == "probe web\n"


def test_in_cluster_apiserver_with_sa_token(cluster: Any, probe_ns: str) -> None:
    # TLS verified against the pod's ca.crt, token of the pod's ServiceAccount.
    out = exec_probe(cluster, probe_ns, "client", "whoami")
    assert f"system:serviceaccount:{probe_ns}:default" in out


def test_kubectl_logs(cluster: Any, probe_ns: str) -> None:
    http_get(f"http://{pod(cluster, probe_ns, 'web')['status']['podIP']}:8080/logged")
    logs = wait_for(
        "request in logs",
        lambda: (lambda s: s if "/logged" in s else None)(cluster.kubectl("logs", "-n", probe_ns, "web")),
        timeout=30,
    )
    assert "probe: listening on :8080" in logs


def _try(fn: Any) -> Any:
    try:
        return fn()
    except OSError:
        return None
