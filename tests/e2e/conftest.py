"""e2e fixtures: a real control plane (etcd, kube-apiserver, KCM, scheduler, kwok, LWS) started by
tests/e2e/cluster/up.sh, the chart's CRD/RBAC applied, and the operator running locally with the
chart's ServiceAccount token, so every e2e test also proves that RBAC is sufficient.

The cluster uses its own state dir and ports (not those of `make cluster-up`), so a cluster
started by hand does not interfere; it is torn down at session end (logs kept for post-mortems).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvmesh.common.python_child import python_module

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "e2e" / "cluster"
CACHE = Path(os.environ.get("KVMESH_CACHE", Path.home() / ".cache" / "kvmesh"))
E2E_ENV = {
    "KVMESH_CACHE": str(CACHE),
    "KVMESH_CLUSTER_DIR": str(CACHE / "cluster-e2e"),
    "ETCD_CLIENT_PORT": "23891",
    "ETCD_PEER_PORT": "23901",
    "APISERVER_PORT": "26543",
    "KWOK_PORT": "20347",
    "LWS_WEBHOOK_PORT": "21043",
    # Namespaces of finished tests are deleted asynchronously; leave room for their pods' GPUs.
    "KWOK_NODES": "4",
    "KWOK_GPUS_PER_NODE": "16",
}
RELEASE = "kvmesh"
KWOK_NS_PREFIX = "t-"  # namespaces of the kwok tier (fake pods); the real-pod tier uses r-
OPERATOR_NS = "kvmesh-system"
OPERATOR_SA = "kvmesh-operator"
RESULTS = Path(os.environ.get("KVMESH_E2E_RESULTS", ROOT / "bench-results" / "e2e-operator.json"))
T = TypeVar("T")


def wait_for(what: str, fn: Callable[[], T | None], timeout: float = 180.0, interval: float = 0.5) -> T:
    """Poll until fn() returns something truthy; a generous deadline, never a timing assertion."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except subprocess.CalledProcessError as e:
            last = e.stderr
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def record(key: str, value: Any) -> None:
    """Append a measurement to bench-results/e2e-operator.json (for docs/BENCHMARKS)."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[key] = value
    RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@dataclass
class Cluster:
    kubeconfig: Path
    bin: Path  # kubectl and helm live here

    def run(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
        tool: str = "kubectl",
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig or self.kubeconfig)}
        return subprocess.run(
            [str(self.bin / tool), *args],
            input=input,
            text=True,
            capture_output=True,
            check=check,
            env=env,
            timeout=timeout,
        )

    def kubectl(self, *args: str, **kw: Any) -> str:
        try:
            return self.run(*args, **kw).stdout
        except subprocess.CalledProcessError as e:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {e.stderr}") from e

    def helm(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run(*args, tool="helm", **kw)

    def get(self, kind: str, name: str, ns: str | None = None) -> dict[str, Any] | None:
        args = ["get", kind, name, "-o", "json", "--ignore-not-found", "--show-managed-fields"]
        if ns:
            args += ["-n", ns]
        out = self.kubectl(*args)
        return json.loads(out) if out.strip() else None

    def list(self, kind: str, ns: str, selector: str | None = None) -> list[dict[str, Any]]:
        args = ["get", kind, "-n", ns, "-o", "json"]
        if selector:
            args += ["-l", selector]
        return json.loads(self.kubectl(*args))["items"]

    def apply(self, manifest: str, ns: str | None = None, **kw: Any) -> str:
        args = ["apply", "-f", "-"] + (["-n", ns] if ns else [])
        return self.kubectl(*args, input=manifest, **kw)

    def patch_spec(self, name: str, ns: str, spec: dict[str, Any]) -> str:
        """Merge-patches an InferenceService's spec as a user's `kubectl patch --type=merge` would
        (a None value removes the field), so every test changes a spec the same way."""
        body = json.dumps({"spec": spec})
        return self.kubectl("patch", "inferenceservice", name, "-n", ns, "--type=merge", "-p", body)


def _script(name: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **E2E_ENV}
    return subprocess.run(
        ["bash", str(SCRIPTS / name)],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=None,
        timeout=timeout,
        check=True,
    )


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    _script("down.sh", 120)  # leftovers of an aborted earlier run
    t0 = time.monotonic()
    _script("build.sh", 3600)  # no-op when cached; a cold build takes most of the deadline
    record("build_seconds_this_session", round(time.monotonic() - t0, 1))
    t0 = time.monotonic()
    # The images the real node runs (`make images`; no-op when cached, waits for a running build).
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "images.sh")],
        env={**os.environ, **E2E_ENV},
        stdout=subprocess.DEVNULL,
        timeout=3600,
        check=True,
    )
    record("images_seconds_this_session", round(time.monotonic() - t0, 1))
    t1 = time.monotonic()
    out = _script("up.sh", 600).stdout.strip().splitlines()
    record("cluster_up_seconds", round(time.monotonic() - t1, 1))
    tools = (
        Path(  # kubectl and helm: where common.sh (the one place that names it) put them
            subprocess.run(
                ["bash", "-c", '. tests/e2e/cluster/common.sh && echo "$TOOLS_DIR"'],
                cwd=ROOT,
                env={**os.environ, **E2E_ENV},
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        / "bin"
    )
    c = Cluster(kubeconfig=Path(out[-1]), bin=tools)
    try:
        yield c
    finally:
        env = {**os.environ, **E2E_ENV, "KEEP_LOGS": "1"}
        subprocess.run(["bash", str(SCRIPTS / "down.sh")], env=env, timeout=120)


def helm_template(c: Cluster, *extra: str) -> str:
    return c.helm(
        "template", RELEASE, str(ROOT / "charts" / "kvmesh"), "--namespace", OPERATOR_NS, "--include-crds", *extra
    ).stdout


@pytest.fixture(scope="session")
def chart(cluster: Cluster) -> Cluster:
    """CRD, ServiceAccount and RBAC from `helm template` (the operator Deployment at 0 replicas:
    its image cannot be built here, the test runs the same code as a local process)."""
    cluster.kubectl("create", "namespace", OPERATOR_NS)
    cluster.apply(helm_template(cluster, "--set", "operator.replicas=0"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/inferenceservices.serving.kvmesh.io")
    return cluster


class Operator:
    """`python -m kvmesh.operator` as a subprocess, authenticated as the chart's SA."""

    def __init__(self, c: Cluster, kubeconfig: Path, log_dir: Path) -> None:
        self.c, self.kubeconfig, self.log_dir = c, kubeconfig, log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.env_extra: dict[str, str] = {}

    def start(self, **env: str) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        log = open(self.log_dir / f"operator-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(
            # `t-*` only: the real-pod tier's operator pod (tests/e2e/realpods.py) owns `r-*`.
            python_module("kvmesh.operator", "--namespace", f"{KWOK_NS_PREFIX}*"),
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig), "KVMESH_OPERATOR_RESYNC_SECONDS": "3", **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace")[-4000:] for p in sorted(self.log_dir.glob("operator-*.log")))


@pytest.fixture(scope="session")
def sa_kubeconfig(chart: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kubeconfig holding a token of the chart's ServiceAccount (not admin)."""
    token = chart.kubectl("create", "token", OPERATOR_SA, "-n", OPERATOR_NS, "--duration=4h").strip()
    admin = chart.kubeconfig.read_text()
    server = next(line.split('"')[1] for line in admin.splitlines() if "server:" in line)
    path = tmp_path_factory.mktemp("sa") / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "e2e", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
                "users": [{"name": OPERATOR_SA, "user": {"token": token}}],
                "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": OPERATOR_SA}}],
                "current-context": "e2e",
            }
        )
    )
    return path


@pytest.fixture(scope="session")
def operator(chart: Cluster, sa_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(chart, sa_kubeconfig, tmp_path_factory.mktemp("operator"))
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print("\n--- operator log tail ---\n" + op.logs()[-3000:])


@pytest.fixture
def ns(chart: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, with a bound `models` PVC for the examples that mount one."""
    name = f"{KWOK_NS_PREFIX}{uuid.uuid4().hex[:8]}"
    # The kwok tier's pods belong on the fake GPU nodes, which are tainted like real GPU nodes
    # (nvidia.com/gpu:NoSchedule): the namespace pins them there (PodNodeSelector) and tolerates
    # the taint (PodTolerationRestriction), so its CPU pods (the router) never reach the real node.
    chart.apply(f"""
apiVersion: v1
kind: Namespace
metadata:
  name: {name}
  annotations:
    scheduler.alpha.kubernetes.io/node-selector: type=kwok
    scheduler.alpha.kubernetes.io/defaultTolerations: '[{{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}}]'
""")  # noqa: E501 (one JSON annotation value)
    pv = f"models-{name}"
    chart.apply(f"""
apiVersion: v1
kind: PersistentVolume
metadata: {{name: {pv}}}
spec:
  capacity: {{storage: 10Gi}}
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  persistentVolumeReclaimPolicy: Retain
  hostPath: {{path: /models}}
  claimRef: {{namespace: {name}, name: models}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: models, namespace: {name}}}
spec:
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  volumeName: {pv}
  resources: {{requests: {{storage: 10Gi}}}}
""")
    yield name
    chart.kubectl("delete", "namespace", name, "--wait=false")
    chart.kubectl("delete", "pv", pv, "--wait=false")


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or ():
        if c.get("type") == ctype:
            return c
    return None


def wait_ready(c: Cluster, name: str, ns: str, timeout: float = 240) -> dict[str, Any]:
    seen: list[Any] = [None]

    def ready() -> dict[str, Any] | None:
        obj = c.get("inferenceservice", name, ns)
        seen[0] = (obj or {}).get("status"), (obj or {}).get("metadata", {}).get("generation")
        cond = condition(obj, "Ready")
        if (
            obj
            and cond
            and cond["status"] == "True"
            and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
        ):
            return obj
        return None

    try:
        return wait_for(f"{ns}/{name} Ready=True", ready, timeout)
    except AssertionError as e:
        pods = c.kubectl("get", "deploy,rs,pods", "-n", ns, "-o", "wide", check=False)
        raise AssertionError(f"{e}\nlast status/generation: {seen[0]}\n{pods}") from None
