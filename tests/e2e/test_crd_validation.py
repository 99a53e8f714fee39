"""Must show: invalid resources are rejected by the API server with a clear message (structural
schema types, enums, min/max, CEL rules), and nothing is stored."""

from __future__ import annotations

import json

import pytest

from .conftest import Cluster

pytestmark = pytest.mark.e2e

CASES = {
    # id: (spec, fragment of the API server's message)
    "schema-type": ({"engine": {"maxNumSeqs": "many"}}, 'spec.engine.maxNumSeqs: Invalid value: "string"'),
    "enum-connector": ({"kvConnector": {"type": "grpc"}}, 'spec.kvConnector.type: Unsupported value: "grpc"'),
    "enum-block-size": ({"engine": {"blockSize": 24}}, "spec.engine.blockSize: Unsupported value: 24"),
    "maximum": (
        {"engine": {"gpuMemoryUtilization": 1.5}},
        "spec.engine.gpuMemoryUtilization: Invalid value: 1.5: "
        "spec.engine.gpuMemoryUtilization in body should be less than or equal to 0.99",
    ),
    "minimum": ({"decode": {"replicas": -1}}, "spec.decode.replicas in body should be greater than or equal to 0"),
    "cel-min-le-max": (
        {"autoscaling": {"enabled": True, "decode": {"minReplicas": 5, "maxReplicas": 2}}},
        "autoscaling.decode.minReplicas must be <= maxReplicas",
    ),
    "enum-autoscaling-provider": (
        {"autoscaling": {"provider": "vpa"}},
        'spec.autoscaling.provider: Unsupported value: "vpa"',
    ),
    "cel-autoscaling-targets-required": (
        {"autoscaling": {"enabled": True, "prefill": {"targetTTFTMilliseconds": 500}}},
        "autoscaling.decode.targetITLMilliseconds is required when autoscaling is enabled",
    ),
    "enum-ttft-percentile": (
        {"autoscaling": {"prefill": {"ttftPercentile": 80}}},
        "spec.autoscaling.prefill.ttftPercentile: Unsupported value: 80",
    ),
    "cel-redis-only-with-redis": (
        {"kvConnector": {"type": "nixl", "redis": {"url": "redis://r:6379"}}},
        "kvConnector.redis is only allowed when kvConnector.type is redis",
    ),
    "cel-redis-needs-settings": ({"kvConnector": {"type": "redis"}}, "kvConnector.type redis needs kvConnector.redis"),
    "cel-redis-url-xor-managed": (
        {"kvConnector": {"type": "redis", "redis": {"url": "redis://r:6379", "managed": True}}},
        "set exactly one of kvConnector.redis.url or kvConnector.redis.managed=true",
    ),
    "cel-redis-secrets-with-url": (
        {"kvConnector": {"type": "redis", "redis": {"managed": True, "tlsCaSecret": "ca"}}},
        "kvConnector.redis.passwordSecret and tlsCaSecret go with url",
    ),
    "cel-gguf-path": (
        {"model": {"source": "gguf", "path": "w.bin", "volume": {"claimName": "models"}}},
        "model.path must name a .gguf file",
    ),
    "cel-hf-needs-volume": ({"model": {"source": "hf"}}, "model.path and model.volume are required"),
    "api-keys-secret-name": (
        {"auth": {"apiKeysSecret": "Tenant_Keys"}},
        'spec.auth.apiKeysSecret: Invalid value: "Tenant_Keys": spec.auth.apiKeysSecret in body should match',
    ),
    "cel-api-keys-not-internal": (
        {"auth": {"apiKeysSecret": "bad-kvmesh-internal"}},
        "auth.apiKeysSecret must not name an operator-generated <name>-kvmesh-internal Secret",
    ),
    "network-policy-type": ({"networkPolicy": {"enabled": "no"}}, "spec.networkPolicy.enabled: Invalid value"),
    "tp-minimum": (
        {"engine": {"tensorParallelSize": 0}},
        "spec.engine.tensorParallelSize in body should be greater than or equal to 1",
    ),
    "cel-gpus-equal-tp": (
        {"engine": {"tensorParallelSize": 4}, "decode": {"gpus": 2}},
        "decode.gpus must be 0 (CPU ranks) or engine.tensorParallelSize / engine.tensorParallelNodes",
    ),
    "cel-gpus-per-pod-across-hosts": (
        {"engine": {"tensorParallelSize": 4, "tensorParallelNodes": 2}, "decode": {"gpus": 4}},
        "decode.gpus must be 0 (CPU ranks) or engine.tensorParallelSize / engine.tensorParallelNodes",
    ),
    "tp-nodes-minimum": (
        {"engine": {"tensorParallelNodes": 0}},
        "spec.engine.tensorParallelNodes in body should be greater than or equal to 1",
    ),
    "cel-gpus-equal-default-tp": (
        {"prefill": {"gpus": 2}},
        "prefill.gpus must be 0 (CPU ranks) or engine.tensorParallelSize / engine.tensorParallelNodes",
    ),
    "cel-lora-one-source": (
        {"loraAdapters": [{"name": "sql", "path": "/a/sql", "configMap": "sql"}]},
        "each loraAdapters entry needs exactly one of path, volume or configMap",
    ),
    "cel-lora-no-source": (
        {"loraAdapters": [{"name": "sql"}]},
        "each loraAdapters entry needs exactly one of path, volume or configMap",
    ),
    "cel-lora-path-absolute": (
        {"loraAdapters": [{"name": "sql", "path": "adapters/sql"}]},
        "loraAdapters[].path must be an absolute path without '..'",
    ),
    "cel-lora-sub-path-inside": (
        {"loraAdapters": [{"name": "sql", "volume": {"claimName": "adapters", "subPath": "x/../../etc"}}]},
        "loraAdapters[].volume.subPath must be a relative path without '..'",
    ),
    "cel-lora-not-the-served-name": (  # the object is named "bad", the served name's default
        {"loraAdapters": [{"name": "bad", "path": "/a/bad"}]},
        "a loraAdapters name must differ from the served model name",
    ),
    "lora-name-pattern": (
        {"loraAdapters": [{"name": "SQL Adapter", "path": "/a/sql"}]},
        "spec.loraAdapters[0].name in body should match",
    ),
    "lora-names-unique": (  # x-kubernetes-list-type map keyed by name
        {"loraAdapters": [{"name": "sql", "path": "/a/sql"}, {"name": "sql", "path": "/a/sql2"}]},
        "Duplicate value",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_resource_is_rejected(case: str, chart: Cluster, ns: str) -> None:
    spec, fragment = CASES[case]
    body = {
        "apiVersion": "serving.kvmesh.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "bad", "namespace": ns},
        "spec": spec,
    }
    res = chart.run("create", "-f", "-", input=json.dumps(body), check=False)
    assert res.returncode != 0, f"{case} was accepted: {res.stdout}"
    assert "is invalid" in res.stderr and fragment in res.stderr, res.stderr
    assert chart.get("inferenceservice", "bad", ns) is None


def test_unknown_field_is_rejected_with_strict_validation(chart: Cluster, ns: str) -> None:
    body = {
        "apiVersion": "serving.kvmesh.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "bad", "namespace": ns},
        "spec": {"engine": {"blocksize": 16}},
    }
    res = chart.run("create", "--validate=strict", "-f", "-", input=json.dumps(body), check=False)
    assert res.returncode != 0
    assert 'unknown field "spec.engine.blocksize"' in res.stderr, res.stderr
