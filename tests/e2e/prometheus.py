"""A real Prometheus on the host for the real-pod tier: the chart's documented scrape job
(prometheus.scrapeConfig: Kubernetes service discovery, role endpointslice) pointed at the test
API server through its kubeconfig, the chart's alert rules loaded, queried over its HTTP API.

The binary is the one tests/e2e/cluster/build.sh builds from the Go module proxy (see
tests/integration/prom_bin.py). The host reaches the pods over the node's bridge, as the
Prometheus of a cluster reaches them over the pod network.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import yaml

from .conftest import ROOT, Cluster, helm_template, wait_for

_spec = importlib.util.spec_from_file_location("kvmesh_prom_bin", ROOT / "tests" / "integration" / "prom_bin.py")
prom_bin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prom_bin)

DASHBOARD = ROOT / "charts" / "kvmesh" / "dashboards" / "kvmesh.json"
SCRAPE_INTERVAL = "2s"
RATE_INTERVAL = "30s"  # what Grafana's $__rate_interval stands for in the panel queries here


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, c: Cluster, namespaces: list[str], workdir: Path) -> None:
        self.c, self.dir = c, workdir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        docs = [
            d
            for d in yaml.safe_load_all(
                helm_template(
                    c,
                    "--set",
                    "prometheus.scrapeConfig.enabled=true",
                    "--set",
                    f"prometheus.scrapeConfig.interval={SCRAPE_INTERVAL}",
                    "--set",
                    f"prometheus.scrapeConfig.scrapeTimeout={SCRAPE_INTERVAL}",
                    "--set",
                    "prometheus.scrapeConfig.namespaces={" + ",".join(namespaces) + "}",
                    "--set",
                    "alerts.enabled=true",
                )
            )
            if d
        ]
        (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-scrape-config")]
        scrape = yaml.safe_load(cm["data"]["kvmesh-scrape.yaml"])
        for job in scrape["scrape_configs"]:
            for sd in job["kubernetes_sd_configs"]:
                sd["kubeconfig_file"] = str(c.kubeconfig)  # out of cluster: the test API server
        (workdir / "kvmesh-scrape.yaml").write_text(yaml.safe_dump(scrape))
        (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
        self.rules = rule["spec"]["groups"]
        (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": self.rules}))
        (workdir / "prometheus.yml").write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
                    "rule_files": ["rules.yaml"],
                    "scrape_config_files": ["kvmesh-scrape.yaml"],
                }
            )
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log = open(self.dir / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                str(prom_bin.prometheus_tool("prometheus")),
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            cwd=self.dir,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for("Prometheus ready", self._ready, 60)

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.logs()
        try:
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()

    def logs(self) -> str:
        return (self.dir / "prometheus.log").read_text(errors="replace")[-4000:]

    def targets(self) -> list[dict[str, Any]]:
        return httpx.get(self.url + "/api/v1/targets", params={"state": "active"}, timeout=10).json()["data"][
            "activeTargets"
        ]

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def rules_health(self) -> dict[str, str]:
        """Rule name -> health ("ok", "err" with lastError, "unknown" before its first evaluation)."""
        groups = httpx.get(self.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        return {
            r["name"]: r["health"] + (f": {r['lastError']}" if r.get("lastError") else "")
            for g in groups
            for r in g["rules"]
        }

    def has_data(self, expr: str) -> bool:
        """The query returns at least one sample with a number (not NaN: a ratio over no traffic)."""
        return any(not math.isnan(float(s["value"][1])) for s in self.query(expr))


def dashboard_queries(namespace: str) -> list[tuple[str, str]]:
    """(panel title, query) of every panel target, with the dashboard variables set as a user
    would (this namespace, every model and router) and $__rate_interval given a value."""
    d = json.loads(DASHBOARD.read_text())

    def walk(panels: list[dict]) -> list[dict]:
        return [q for p in panels for q in (p, *walk(p.get("panels") or []))]

    out = []
    for p in walk(d["panels"]):
        for t in p.get("targets") or ():
            e = t["expr"].replace("$namespace", namespace).replace("$model", ".*").replace("$router", ".*")
            out.append((p["title"], e.replace("$__rate_interval", RATE_INTERVAL)))
    return out


def variable_queries(namespace: str) -> list[tuple[str, str]]:
    """(variable, query) for the dashboard's query variables: Grafana's `label_values(M, L)` as
    the PromQL that lists the same values (`count by (L) (M)`)."""
    d = json.loads(DASHBOARD.read_text())
    out = []
    for v in d["templating"]["list"]:
        if v.get("type") != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["definition"])
        assert m, v["definition"]
        out.append((f"${v['name']}", f"count by ({m[2]}) ({m[1].replace('$namespace', namespace)})"))
    return out


_THRESHOLD = re.compile(r"\s*(?:>=|<=|==|!=|>|<)\s*[-+0-9.eE]+\s*$")


def alert_queries(groups: list[dict]) -> list[tuple[str, str]]:
    """(alert, expression) for every alert with its threshold comparison taken off (`X > 2` ->
    `X`; `A > 1 and B >= 0` -> A and B): the expression a firing alert depends on, which must
    return data from live pods even while the alert is (rightly) quiet."""
    out = []
    for g in groups:
        for r in g["rules"]:
            for part in r["expr"].split(" and "):
                out.append((r["alert"], _THRESHOLD.sub("", part)))
    return out
