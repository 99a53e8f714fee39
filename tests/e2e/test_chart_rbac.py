"""Must show: the chart lints and its rendered output is accepted by the API server; the
operator (running with the chart's ServiceAccount token, see conftest) has what it needs and
no more."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from .conftest import OPERATOR_NS, OPERATOR_SA, ROOT, Cluster, Operator, helm_template, wait_ready
from .helpers import EXAMPLES

pytestmark = pytest.mark.e2e


def test_helm_lint(cluster: Cluster) -> None:
    res = cluster.helm("lint", "--strict", str(ROOT / "charts" / "kvmesh"), check=False)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize(
    "values",
    [
        [],
        ["--set", "operator.watchNamespaces={team-a,team-b}", "--set", "operator.verbose=true"],
    ],
    ids=["defaults", "namespaced"],
)
def test_helm_template_passes_server_dry_run(chart: Cluster, values: list[str]) -> None:
    out = helm_template(chart, *values)
    docs = [d for d in yaml.safe_load_all(out) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "NetworkPolicy",
        "ServiceAccount",
    ]
    res = chart.run("apply", "--dry-run=server", "-f", "-", input=out, check=False)
    assert res.returncode == 0, res.stderr
    dep = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    ctr = dep["containers"][0]
    assert dep["securityContext"]["runAsNonRoot"] is True
    assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
    assert ctr["securityContext"]["allowPrivilegeEscalation"] is False
    assert dep["serviceAccountName"] == OPERATOR_SA


def test_chart_crd_is_the_crds_folder(cluster: Cluster) -> None:
    out = helm_template(cluster)
    crd = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "CustomResourceDefinition")
    assert crd == yaml.safe_load((ROOT / "crds" / "inferenceservices.yaml").read_text())


def test_operator_runs_as_the_service_account(chart: Cluster, operator: Operator, sa_kubeconfig: Path, ns: str) -> None:
    who = json.loads(chart.kubectl("auth", "whoami", "-o", "json", kubeconfig=sa_kubeconfig))
    assert who["status"]["userInfo"]["username"] == (f"system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}")
    chart.apply(EXAMPLES["minimal"].read_text(), ns)
    wait_ready(chart, "tiny", ns)
    assert operator.alive()
    assert "Forbidden" not in operator.logs(), operator.logs()


@pytest.mark.parametrize(
    "verb_args",
    [
        ["get", "secrets", "-A"],
        ["delete", "inferenceservice", "anything", "-n", "default"],
        ["create", "namespace", "sneaky"],
        ["create", "clusterrolebinding", "sneaky", "--clusterrole=cluster-admin", "--user=x"],
        ["delete", "nodes", "--all"],
    ],
    ids=["list-secrets", "delete-isvc", "create-ns", "escalate", "delete-nodes"],
)
def test_forbidden_verbs(chart: Cluster, sa_kubeconfig: Path, verb_args: list[str]) -> None:
    res = chart.run(*verb_args, kubeconfig=sa_kubeconfig, check=False)
    assert res.returncode != 0 and "forbidden" in res.stderr.lower(), res.stderr


def test_allowed_verbs_match_the_role(chart: Cluster, sa_kubeconfig: Path) -> None:
    def can(*args: str) -> bool:
        res = chart.run("auth", "can-i", *args, kubeconfig=sa_kubeconfig, check=False)
        return res.stdout.strip() == "yes"

    assert can("patch", "deployments.apps", "-n", "default")
    assert can("patch", "inferenceservices.serving.kvmesh.io/status", "-n", "default")
    assert not can("update", "inferenceservices.serving.kvmesh.io", "-n", "default")
    assert not can("delete", "pods", "-n", "default")
    assert can("patch", "deployments.apps", "--subresource=scale", "-n", "default")  # the planner
    assert can("patch", "pods", "-n", "default") and not can("create", "pods/exec", "-n", "default")
    assert not can("get", "secrets", "-n", OPERATOR_NS)
