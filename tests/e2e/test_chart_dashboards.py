"""The chart's dashboard ConfigMap and PrometheusRule as helm renders them (the e2e tier builds helm).

The metric checks themselves live in tests/unit/test_dashboards.py (no helm needed); this renders the
chart with both options on and checks that what helm produces is what those checks examined."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from .conftest import ROOT, Cluster, helm_template

pytestmark = pytest.mark.e2e

_spec = importlib.util.spec_from_file_location(
    "kvmesh_dashboard_checks", ROOT / "tests" / "unit" / "test_dashboards.py"
)
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)
CHART = ROOT / "charts" / "kvmesh"


def _template(c: Cluster, *args: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(helm_template(c, *args)) if d]


def test_rendered_chart_dashboard_and_alerts(cluster: Cluster) -> None:
    kinds = sorted(d["kind"] for d in _template(cluster))
    assert "ConfigMap" not in kinds and "PrometheusRule" not in kinds  # both off by default
    docs = _template(
        cluster,
        "--set",
        "dashboards.enabled=true",
        "--set",
        "alerts.enabled=true",
        "--set",
        "alerts.ttftP90Seconds=3.5",
    )
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvmesh.json"]) == checks._dashboard()
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    rendered = [(r["alert"], r["expr"]) for r in rules]
    assert checks._check(rendered) == []
    assert any(e.endswith("> 3.5") for n, e in rendered if n == "KvmeshHighTimeToFirstToken")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["alerts"]["ttftP90Seconds"] = 3.5
    assert rendered == checks._alert_exprs(values)  # the text-based extraction matches helm's output
    for r in rules:
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert "{{ $labels." in r["annotations"]["summary"] or "{{ $value" in r["annotations"]["summary"]
