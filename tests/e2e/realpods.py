"""Helpers for the real-pod tier: the chart installed with `helm install` (the operator as a pod
from the image `make images` builds), InferenceServices whose pods run on the cluster's real node,
and the probes the tests read (pod /metrics over pod IPs, the router through its ClusterIP).

Why a second chart release: the kwok tier runs its operator as a local process watching `t-*`
namespaces (so it can be killed mid-reconcile); this tier's operator pod watches `r-*`, so the two
never reconcile the same object.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ROOT, Cluster, wait_for, wait_ready

REAL_NODE_LABEL = "kvmesh.io/real-node"
REAL_RELEASE = "kvmesh-real"
REAL_OPERATOR_NS = "kvmesh-real"
REAL_NS_PREFIX = "r-"
CPU_EXAMPLES = {p.stem: p for p in sorted((ROOT / "examples" / "cpu").glob("*.yaml"))}
MAX_TOKENS = 8


def _samples(text: str):
    for family in text_string_to_metric_families(text):
        yield from family.samples


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text format)."""
    return sum(
        s.value for s in _samples(text) if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def series(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of every sample of `name`."""
    return [dict(s.labels) for s in _samples(text) if s.name == name]


@dataclass
class Service:
    """One InferenceService running on the real node."""

    c: Cluster
    name: str
    ns: str

    def pods(self, component: str | None = None) -> list[dict[str, Any]]:
        sel = f"app.kubernetes.io/instance={self.name}"
        if component:
            sel += f",app.kubernetes.io/component={component}"
        return [p for p in self.c.list("pods", self.ns, sel) if not p["metadata"].get("deletionTimestamp")]

    def pod_urls(self, component: str) -> dict[str, str]:
        return {
            p["metadata"]["name"]: f"http://{p['status']['podIP']}:8000"
            for p in self.pods(component)
            if p["status"].get("podIP")
        }

    @property
    def url(self) -> str:
        svc = self.c.get("service", self.name, self.ns)
        return f"http://{svc['spec']['clusterIP']}:80"

    def patch_spec(self, spec: dict[str, Any]) -> None:
        """Merge-patches this service's spec (Cluster.patch_spec)."""
        self.c.patch_spec(self.name, self.ns, spec)

    def admin_key(self) -> str:
        """The service's admin key (key admin-key of the operator's NAME-kvmesh-internal Secret): the
        router shows which pod answered (x-kvmesh-pod) to it alone."""
        secret = self.c.get("secret", f"{self.name}-kvmesh-internal", self.ns)
        assert secret is not None, f"no Secret {self.name}-kvmesh-internal"
        return base64.b64decode(secret["data"]["admin-key"]).decode()

    def router_metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def pod_metrics(self, url: str) -> str:
        return httpx.get(url + "/metrics", timeout=30).text

    def routed(self, timeout: float = 300) -> None:
        """The router answers through the ClusterIP and counts every worker pod healthy (its
        discovery and health checks trail the pods' readiness by a few seconds)."""

        def healthy() -> bool:  # refused until kube-proxy has the new router pod's endpoint: not yet, not a failure
            try:
                return httpx.get(self.url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for("router via ClusterIP", healthy, timeout)

        def all_seen() -> bool:
            m = self.router_metrics()
            urls = set(self.pod_urls("prefill").values()) | set(self.pod_urls("decode").values())
            return all(metric(m, "kvmesh:router_pod_healthy", pod=u) == 1 for u in urls)

        wait_for("router sees every worker pod healthy", all_seen, timeout, 1.0)

    def idle(self, component: str, timeout: float = 180) -> None:
        """Every pod of the role holds no request and no block (nothing leaked)."""

        def clean() -> bool:
            for url in self.pod_urls(component).values():
                m = self.pod_metrics(url)
                if (
                    metric(m, "vllm:kv_cache_usage_perc")
                    or metric(m, "vllm:num_requests_running")
                    or metric(m, "vllm:num_requests_waiting")
                    or metric(m, "kvmesh:kv_held_requests")
                ):
                    return False
            return True

        wait_for(f"{self.ns}/{self.name} {component} pods idle with every block free", clean, timeout, 1.0)


def real_node_name(c: Cluster) -> str:
    nodes = json.loads(c.kubectl("get", "nodes", "-l", f"{REAL_NODE_LABEL}=true", "-o", "json"))["items"]
    assert nodes, "the test cluster has no real node (tests/e2e/cluster/up.sh starts one)"
    return nodes[0]["metadata"]["name"]


# Every namespace of this tier enforces the `restricted` Pod Security level (the API server's
# PodSecurity admission): a pod the operator or the chart renders that breaks it is refused.
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
    "pod-security.kubernetes.io/warn": "restricted",
}


def create_restricted_namespace(c: Cluster, name: str) -> None:
    c.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": RESTRICTED}}))


def install_chart(c: Cluster) -> None:
    """`helm install` as a user would (into a namespace that enforces Pod Security `restricted`),
    plus the test's namespace scope and a short resync."""
    create_restricted_namespace(c, REAL_OPERATOR_NS)
    c.helm(
        "upgrade",
        "--install",
        REAL_RELEASE,
        str(ROOT / "charts" / "kvmesh"),
        "-n",
        REAL_OPERATOR_NS,
        "--create-namespace",
        "--set",
        f"operator.watchNamespaces={{{REAL_NS_PREFIX}*}}",
        "--set",
        "operator.resyncSeconds=3",
        "--wait",
        "--timeout",
        "5m",
        timeout=360,
    )


def operator_pods(c: Cluster) -> list[dict[str, Any]]:
    return [
        p
        for p in c.list("pods", REAL_OPERATOR_NS, "app.kubernetes.io/name=kvmesh")
        if not p["metadata"].get("deletionTimestamp")
    ]


def new_namespace(c: Cluster) -> str:
    name = f"{REAL_NS_PREFIX}{uuid.uuid4().hex[:8]}"
    create_restricted_namespace(c, name)
    return name


def delete_namespace(c: Cluster, name: str) -> None:
    """Deletes a test's namespace and waits until its pods are gone, so the next test's pods get the
    node's CPU and memory; the namespace's other objects go on being deleted in the background (each
    test has a namespace of its own).

    Its pods are force-deleted once the namespace is terminating (no new pod can be made there then):
    a test's teardown needs no graceful drain, and each pod's (preStop, then the server's drain of
    open connections) took about 40 s of every real-pod test. The tests of graceful shutdown delete
    their pods themselves."""
    c.kubectl("delete", "namespace", name, "--wait=false", timeout=60, check=False)
    c.kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", timeout=60, check=False)
    c.kubectl("wait", "--for=delete", "pods", "--all", "-n", name, "--timeout=120s", timeout=180, check=False)


def deploy(c: Cluster, example: str, ns: str, timeout: float = 900) -> tuple[Service, dict[str, Any]]:
    manifest = CPU_EXAMPLES[example].read_text()
    import yaml

    name = yaml.safe_load(manifest)["metadata"]["name"]
    c.apply(manifest, ns)
    obj = wait_ready(c, name, ns, timeout)
    return Service(c, name, ns), obj


def wait_rolled_out(svc: Service, timeout: float = 900) -> None:
    """Every Deployment of the service has all its replicas on the latest template, Ready."""

    def done() -> bool:
        deps = svc.c.list("deployment.apps", svc.ns, f"app.kubernetes.io/instance={svc.name}")
        for d in deps:
            st, want = d.get("status") or {}, d["spec"].get("replicas", 1)
            if (
                st.get("observedGeneration") != d["metadata"]["generation"]
                or st.get("updatedReplicas") != want
                or st.get("readyReplicas") != want
                or st.get("replicas") != want
            ):
                return False
        return True

    wait_for(f"{svc.ns}/{svc.name} rolled out", done, timeout, 2.0)
    wait_ready(svc.c, svc.name, svc.ns, timeout)


def host_pids_of(pod_name: str, needle: str = "kvmesh") -> list[int]:
    """Host PIDs of a pod's processes (the node runs on this machine), found by the POD_NAME the
    pod spec puts in their environment."""
    want = f"POD_NAME={pod_name}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if want in env and needle.encode() in cmd:
            out.append(int(d.name))
    return sorted(out)


def process_status(pid: int) -> dict[str, str]:
    """/proc/PID/status as a dict (Seccomp, NoNewPrivs, CapEff, Uid, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def container_pids(pod: dict[str, Any]) -> list[int]:
    """Host PIDs of the processes in a pod's containers: their cgroup paths end in the container
    IDs the pod's status reports (the sandbox's pause process has its own ID and is left out)."""
    forms = tuple(
        s["containerID"].split("://", 1)[1]
        for s in pod["status"].get("containerStatuses") or ()
        if s.get("containerID")
    )
    assert forms, f"no container IDs in {pod['metadata']['name']}'s status"
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cg = (d / "cgroup").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if any(f in cg for f in forms) and not cmd.startswith(b"/pause"):
            out.append(int(d.name))
    return sorted(out)


def confinement(pod: dict[str, Any]) -> dict[int, tuple[str, str, str, str]]:
    """PID -> (Seccomp, NoNewPrivs, CapEff, effective uid) of each of the pod's container
    processes on this host: what the runtime really applied, not what the pod spec asked for."""
    out = {}
    for pid in container_pids(pod):
        try:
            st = process_status(pid)
        except OSError:
            continue  # exited meanwhile
        out[pid] = (st["Seccomp"], st["NoNewPrivs"], st["CapEff"], st["Uid"].split()[1])
    return out


def kill_main_process(pod_name: str) -> int:
    """SIGKILL the container's main process (the API server; its engine child follows it)."""
    pids = host_pids_of(pod_name)
    assert pids, f"no process of {pod_name} found on this host"
    ppid = {p: int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) for p in pids}
    main = next(p for p in pids if ppid[p] not in pids)
    os.kill(main, signal.SIGKILL)
    return main


@dataclass
class Load:
    """Requests sent back to back from a few threads until stopped; every outcome recorded."""

    send: Callable[[int], str | None]  # returns None on success, else what went wrong
    threads: int = 2
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        for i in range(self.threads):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                err = self.send(i * 100_000 + n)
            except Exception as e:  # a transport error is a failed request too
                err = f"{type(e).__name__}: {e}"
            with self._lock:
                if err is None:
                    self.ok += 1
                else:
                    self.failures.append(err)
            n += 1

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(timeout=300)

    def wait_ok(self, n: int, timeout: float = 300) -> None:
        wait_for(f"{n} successful requests under load", lambda: self.ok >= n, timeout, 0.5)


def not_ready_on(node: str, pods: list[dict[str, Any]]) -> list[str]:
    """Names of pods that are not Running and Ready on `node` (empty when all are)."""
    bad = []
    for p in pods:
        conds = {c["type"]: c["status"] for c in p["status"].get("conditions") or ()}
        if p["spec"].get("nodeName") != node or p["status"].get("phase") != "Running" or conds.get("Ready") != "True":
            bad.append(f"{p['metadata']['name']} ({p['spec'].get('nodeName')}, {p['status'].get('phase')})")
    return bad
