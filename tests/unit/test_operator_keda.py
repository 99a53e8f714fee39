"""spec.autoscaling.provider keda: render() gives one KEDA ScaledObject per worker role instead
of HPAs, with the spec's bounds and windows and prometheus-scaler triggers on the operator's
Prometheus. (What the queries compute is checked by promtool in
tests/integration/test_alert_rules.py; that the API server accepts the objects, in
tests/e2e/test_keda.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.operator.config import OperatorConfig
from kvmesh.operator.render import DEFAULT_PROMETHEUS_URL, render

pytestmark = pytest.mark.unit

META = {"name": "svc", "namespace": "demo", "uid": "00000000-0000-0000-0000-000000000001", "generation": 1}
SPEC: dict[str, Any] = {
    "autoscaling": {
        "enabled": True,
        "provider": "keda",
        "prefill": {"minReplicas": 1, "maxReplicas": 5, "targetTTFTMilliseconds": 400},
        "decode": {
            "minReplicas": 2,
            "maxReplicas": 7,
            "targetITLMilliseconds": 40,
            "targetKVCacheUsage": 0.7,
            "scaleDownStabilizationSeconds": 120,
        },
    }
}


def kinds(objs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_keda_provider_renders_scaled_objects_not_hpas() -> None:
    objs = kinds(render(SPEC, META, "http://prom.mon.svc:9090"))
    assert not [k for k in objs if k[0] == "HorizontalPodAutoscaler"]
    pre, dec = objs[("ScaledObject", "svc-prefill")], objs[("ScaledObject", "svc-decode")]
    for so, role in ((pre, "prefill"), (dec, "decode")):
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        assert so["metadata"]["ownerReferences"][0]["controller"] is True
        assert so["metadata"]["labels"]["app.kubernetes.io/component"] == role
        assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"svc-{role}"}
        assert "replicas" not in objs[("Deployment", f"svc-{role}")]["spec"]  # left to KEDA's HPA
        for t in so["spec"]["triggers"]:
            assert t["type"] == "prometheus" and t["metricType"] == "AverageValue"
            assert t["metadata"]["serverAddress"] == "http://prom.mon.svc:9090"
            assert t["metadata"]["threshold"] == "1"
            assert 'namespace="demo"' in t["metadata"]["query"]
            assert f'pod=~"svc-{role}-[^-]+-[^-]+"' in t["metadata"]["query"]
    assert (pre["spec"]["minReplicaCount"], pre["spec"]["maxReplicaCount"]) == (1, 5)
    assert (dec["spec"]["minReplicaCount"], dec["spec"]["maxReplicaCount"]) == (2, 7)
    assert [t["name"] for t in pre["spec"]["triggers"]] == ["ttft"]
    assert [t["name"] for t in dec["spec"]["triggers"]] == ["itl", "kv_cache"]
    (ttft,) = pre["spec"]["triggers"]
    assert "histogram_quantile(0.9, " in ttft["metadata"]["query"] and "/ 0.4)" in ttft["metadata"]["query"]
    assert "/ 0.04)" in dec["spec"]["triggers"][0]["metadata"]["query"]
    assert "/ 0.7)" in dec["spec"]["triggers"][1]["metadata"]["query"]
    behavior = dec["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 120
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert dec["spec"]["cooldownPeriod"] == 120
    assert dec["spec"]["pollingInterval"] == 15


def test_other_providers_render_no_scaled_objects() -> None:
    for provider in ("hpa", "planner"):
        spec = {"autoscaling": {**SPEC["autoscaling"], "provider": provider}}
        assert not [o for o in render(spec, META) if o["kind"] == "ScaledObject"]
    assert not [o for o in render({}, META) if o["kind"] == "ScaledObject"]  # autoscaling off


def test_prometheus_url_setting() -> None:
    assert OperatorConfig.from_env({}).prometheus_url == DEFAULT_PROMETHEUS_URL
    cfg = OperatorConfig.from_env({"KVMESH_OPERATOR_PROMETHEUS_URL": "https://prom.example:9091"})
    assert cfg.prometheus_url == "https://prom.example:9091"
    with pytest.raises(ValueError, match="prometheus_url"):
        OperatorConfig.from_env({"KVMESH_OPERATOR_PROMETHEUS_URL": "prom:9090"})
