"""The chart's Grafana dashboard and PrometheusRule use only metrics the code exports.

Metric names come from the real registries (`ServerMetrics`, `RouterMetrics`) through
`registry.collect()`, expanded with the suffixes prometheus_client exposes per type
(counter ``_total``, histogram ``_bucket/_sum/_count``), so a renamed or removed metric, or
a panel/alert that references one that never existed, fails here. Alert expressions are
taken from the template text with the `{{ $a.X }}` placeholders filled from values.yaml
(no helm needed); when a helm binary is around, the rendered chart is checked as well.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvmesh.services.api.metrics import ServerMetrics
from kvmesh.services.router.metrics import RouterMetrics

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvmesh"
DASHBOARD = CHART / "dashboards" / "kvmesh.json"
RULES_TEMPLATE = CHART / "templates" / "prometheusrule.yaml"

# Labels Prometheus (Operator) attaches to every scraped series; a metric's own label that
# collides with one of them is renamed exported_<name> (no honorLabels on our ServiceMonitor).
TARGET_LABELS = {"namespace", "pod", "service", "job", "instance", "container", "endpoint"}
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


def _exported() -> dict[str, set[str]]:
    """Every series name the code can expose -> the label names it carries."""
    out: dict[str, set[str]] = {}
    for owner in (ServerMetrics("m"), RouterMetrics()):
        labels_of = {
            c._name: set(getattr(c, "_labelnames", ()))
            for c in vars(owner).values()
            if hasattr(c, "_name") and hasattr(c, "collect")
        }
        for fam in owner.registry.collect():
            base = fam.name if fam.type != "counter" else fam.name.removesuffix("_total")
            labels = labels_of.get(base, set()) | {k for s in fam.samples for k in s.labels}
            names = {base + sfx for sfx in _SUFFIXES.get(fam.type, ("",))} | {s.name for s in fam.samples}
            for n in names:
                out[n] = labels | ({"le"} if n.endswith("_bucket") else set())
    return out


EXPORTED = _exported()

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
    "atan2",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])(\s*\()?")


def metrics_in(expr: str) -> tuple[set[str], dict[str, set[str]]]:
    """(metric names, metric -> label names in its matchers) used by one PromQL expression."""
    matchers: dict[str, set[str]] = {}
    for name, body in _SELECTOR.findall(_STRING.sub('""', expr)):
        for m in body.split(","):
            if m.strip():
                matchers.setdefault(name, set()).add(re.split(r"\s*(?:=~|!~|!=|=)", m.strip())[0])
    e = _STRING.sub(" ", expr)
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # range / subquery windows
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", " ", e)  # numbers, not digits in names
    names = {m.group(1) for m in _IDENT.finditer(e) if not m.group(2) and m.group(1).lower() not in _KEYWORDS}
    return names | set(matchers), matchers


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(_panels(p.get("panels", [])))
    return out


def _dashboard_exprs() -> list[tuple[str, str]]:
    d = _dashboard()
    out = [
        (f"panel {p['id']} {p.get('title')!r}", t["expr"])
        for p in _panels(d["panels"])
        for t in p.get("targets", [])
        if "expr" in t
    ]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q.strip())
            assert m, f"variable {v['name']}: unexpected query {q!r}"
            out.append((f"variable {v['name']}", m.group(1)))
    return out


def _alert_exprs(values: dict | None = None) -> list[tuple[str, str]]:
    """(alert, expr) from the template text, placeholders filled from values.yaml."""
    a = (values or yaml.safe_load((CHART / "values.yaml").read_text()))["alerts"]
    text = RULES_TEMPLATE.read_text()
    alerts = re.findall(r"^\s*- alert: (\S+)\n\s*expr: (.+)$", text, re.M)
    assert alerts and len(alerts) == text.count("- alert:"), "each alert needs a one-line expr right after it"

    def fill(m: re.Match) -> str:
        return str(a[m.group(1)])

    out = []
    for name, expr in alerts:
        e = re.sub(r"\{\{-?\s*(?:\$a|\.Values\.alerts)\.(\w+)\s*-?\}\}", fill, expr)
        assert "{{" not in e, f"{name}: unrendered template in {e!r}"
        out.append((name, e))
    return out


def _check(exprs: list[tuple[str, str]]) -> list[str]:
    bad = []
    for where, expr in exprs:
        names, matchers = metrics_in(expr)
        if not names:
            bad.append(f"{where}: no metric in {expr!r}")
        for n in sorted(names - EXPORTED.keys()):
            bad.append(f"{where}: {n} is not exported")
        for n, labels in matchers.items():
            if n in EXPORTED:
                unknown = labels - EXPORTED[n] - TARGET_LABELS
                if unknown:
                    bad.append(f"{where}: {n} has no label(s) {sorted(unknown)}")
    return bad


# ---- the checker itself ------------------------------------------------------------------


def test_exported_names_follow_prometheus_client_suffixes() -> None:
    assert "vllm:num_preemptions_total" in EXPORTED and "vllm:num_preemptions" not in EXPORTED
    assert "vllm:time_to_first_token_seconds_bucket" in EXPORTED
    assert "vllm:time_to_first_token_seconds" not in EXPORTED  # a histogram has no bare series
    assert "kvmesh:router_routing_decisions_total" in EXPORTED  # labeled, no child yet
    assert EXPORTED["kvmesh:router_routing_decisions_total"] == {"pod", "role", "reason"}
    assert EXPORTED["vllm:kv_cache_usage_perc"] == {"model_name"}


@pytest.mark.parametrize(
    "expr, want",
    [
        (
            "histogram_quantile(0.9, sum by (pod, le) (rate(vllm:time_to_first_token_seconds_bucket"
            '{namespace=~"$namespace"}[$__rate_interval])))',
            {"vllm:time_to_first_token_seconds_bucket"},
        ),
        (
            'label_replace(rate(vllm:request_success_total[5m]), "role", "$1", "pod", ".*-(prefill|decode)-.*")',
            {"vllm:request_success_total"},
        ),
        ("sum(a_total) / on (x) group_left (y) sum(b_bucket) > 1e3 and c", {"a_total", "b_bucket", "c"}),
        ("kvmesh:router_pod_healthy < 1", {"kvmesh:router_pod_healthy"}),
        ("rate(vllm:e2e_request_latency_seconds_count[5m]) * 2", {"vllm:e2e_request_latency_seconds_count"}),
    ],
)
def test_metric_extraction(expr: str, want: set[str]) -> None:
    assert metrics_in(expr)[0] == want


def test_checker_rejects_unknown_metrics_and_labels() -> None:
    assert _check([("p", "rate(vllm:num_preemptions[5m])")])  # missing _total
    assert _check([("p", "sum(rate(kvmesh:router_bogus_total[5m]))")])
    assert _check([("p", 'vllm:kv_cache_usage_perc{role="decode"}')])  # no such label
    assert not _check([("p", 'vllm:kv_cache_usage_perc{model_name="m", pod="x"}')])


# ---- the dashboard ------------------------------------------------------------------------


def test_dashboard_uses_only_exported_metrics() -> None:
    exprs = _dashboard_exprs()
    assert len(exprs) > 20
    assert _check(exprs) == []


def test_dashboard_is_well_formed() -> None:
    d = _dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    ds = next(v for v in d["templating"]["list"] if v["name"] == "datasource")
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert {v["name"] for v in d["templating"]["list"]} >= {"datasource", "namespace", "model"}
    panels = _panels(d["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in panels:
        assert p.get("datasource", {}).get("uid") == "${datasource}", p["title"]
        for t in p.get("targets", []):
            assert t.get("datasource", {}).get("uid") == "${datasource}", p["title"]
            assert t["expr"].strip() and t["refId"]
        if p["type"] != "row":
            assert p.get("targets"), f"panel {p['title']!r} has no query"
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]


# ---- the alerts ---------------------------------------------------------------------------


def test_alerts_use_only_exported_metrics() -> None:
    exprs = _alert_exprs()
    assert {n for n, _ in exprs} >= {
        "KvmeshNoHealthyDecodePod",
        "KvmeshHighTimeToFirstToken",
        "KvmeshKVCacheNearlyFull",
        "KvmeshWaitingQueueHigh",
        "KvmeshPreemptionRateHigh",
        "KvmeshRouterIndexDriftHigh",
        "KvmeshRouterKVEventStreamDown",
    }
    assert _check(exprs) == []


def test_alerts_have_annotations_and_runbook_anchor_in_docs() -> None:
    text = RULES_TEMPLATE.read_text()
    docs = (ROOT / "docs" / "operator.md").read_text()
    for name, _ in _alert_exprs():
        block = text.split(f"- alert: {name}\n", 1)[1].split("- alert:", 1)[0]
        for key in ("summary:", "description:", "runbook_url:"):
            assert key in block, f"{name} lacks {key}"
        assert f"#{name.lower()}" in block
        assert f"#### {name}" in docs, f"docs/operator.md has no runbook entry for {name}"
