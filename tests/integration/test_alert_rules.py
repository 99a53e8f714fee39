"""The chart's alert rules as a real Prometheus sees them: rendered by helm, checked with
`promtool check rules`, and unit-tested with `promtool test rules` against
alert_rules/<group>.test.yaml, which holds for every alert one case where it fires on synthetic
series and one where it stays quiet.

promtool is a local process (no cluster), built from the Go module proxy by
tests/e2e/cluster/build.sh (`make test` starts that build in the background; see prom_bin.py).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prom_bin import prometheus_tool, rules_file

pytestmark = pytest.mark.integration

TESTS = Path(__file__).parent / "alert_rules"


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(prometheus_tool("promtool")), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def _rendered(tmp: Path, *helm_args: str) -> dict:
    """The rendered rule file next to a copy of every group's test file (they name it relatively)."""
    rules = rules_file(*helm_args)
    (tmp / "kvmesh.rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    for f in TESTS.glob("*.test.yaml"):
        shutil.copy(f, tmp / f.name)
    return rules


def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    rules = _rendered(tmp_path)
    r = _promtool("check", "rules", "kvmesh.rules.yaml", cwd=tmp_path)
    n = sum(len(g["rules"]) for g in rules["groups"])
    assert r.returncode == 0 and f"SUCCESS: {n} rules found" in r.stdout, r.stdout + r.stderr


def test_every_alert_has_a_firing_and_a_quiet_case_and_they_pass(tmp_path: Path) -> None:
    rules = _rendered(tmp_path)
    for group in rules["groups"]:
        test_file = TESTS / f"{group['name'].removesuffix('.rules')}.rules.test.yaml"
        assert test_file.exists(), f"alert group {group['name']} has no promtool test file {test_file.name}"
        cases = [c for t in yaml.safe_load(test_file.read_text())["tests"] for c in t["alert_rule_test"]]
        for rule in group["rules"]:
            mine = [c for c in cases if c["alertname"] == rule["alert"]]
            assert any(c["exp_alerts"] for c in mine), f"{rule['alert']}: no case where it fires"
            assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']}: no case where it stays quiet"
        r = _promtool("test", "rules", test_file.name, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr


def test_quiet_cases_catch_a_threshold_that_moved(tmp_path: Path) -> None:
    """The quiet cases do constrain the rules: with the KV-cache threshold lowered to 0.5 (a
    chart value), the 90 percent case fires and promtool fails naming that alert."""
    _rendered(tmp_path, "--set", "alerts.kvCacheUsage=0.5")
    r = _promtool("test", "rules", "kvmesh.rules.test.yaml", cwd=tmp_path)
    assert r.returncode != 0
    assert "KvmeshKVCacheNearlyFull" in r.stdout + r.stderr


def test_keda_trigger_queries_compute_the_replicas_each_role_needs(tmp_path: Path) -> None:
    """The prometheus-scaler queries of the ScaledObjects render() gives for provider keda, run as
    recording rules by promtool on synthetic series: each returns the replicas its signal asks
    for (KEDA's AverageValue threshold is 1), counts only its own role's pods in its namespace,
    and reads 0 (not NaN, not empty) when the role is idle."""
    from kvmesh.operator.render import render

    spec = {
        "autoscaling": {
            "enabled": True,
            "provider": "keda",
            "prefill": {"targetTTFTMilliseconds": 500},
            "decode": {"targetITLMilliseconds": 40, "targetKVCacheUsage": 0.7},
        }
    }
    meta = {"name": "svc", "namespace": "ns", "uid": "u", "generation": 1}
    rules = [
        {"record": f"keda:{so['metadata']['name'].replace('-', '_')}_{t['name']}", "expr": t["metadata"]["query"]}
        for so in render(spec, meta)
        if so["kind"] == "ScaledObject"
        for t in so["spec"]["triggers"]
    ]
    assert [r["record"] for r in rules] == ["keda:svc_prefill_ttft", "keda:svc_decode_itl", "keda:svc_decode_kv_cache"]
    (tmp_path / "keda.rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": rules}]}))
    r = _promtool("check", "rules", "keda.rules.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr

    def s(metric: str, pod: str, values: str, ns: str = "ns", **labels: str) -> dict[str, str]:
        extra = "".join(f',{k}="{v}"' for k, v in labels.items())
        return {"series": f'{metric}{{namespace="{ns}",pod="{pod}",model_name="svc"{extra}}}', "values": values}

    d1, d2, p1 = "svc-decode-6d9f7c-x1a2b", "svc-decode-6d9f7c-q9w8e", "svc-prefill-5c8d7b-k3j4h"
    itl = "vllm:inter_token_latency_seconds_bucket"
    series = [
        # decode: KV use 0.6 + 0.8 against 0.7 -> 2 pods; a prefill pod and another namespace's
        # decode pod of the same name do not count
        s("vllm:kv_cache_usage_perc", d1, "0.6x40"),
        s("vllm:kv_cache_usage_perc", d2, "0.8x40"),
        s("vllm:kv_cache_usage_perc", p1, "0.9x40"),
        s("vllm:kv_cache_usage_perc", d1, "0.9x40", ns="other"),
        # decode ITL: every token between 40 and 80 ms, p90 = 76 ms against 40 ms, 2 pods -> 3.8
        *(s(itl, d, "0x40", le="0.04") for d in (d1, d2)),
        *(s(itl, d, "0+8x40", le="0.08") for d in (d1, d2)),
        *(s(itl, d, "0+8x40", le="+Inf") for d in (d1, d2)),
        *(s("vllm:num_requests_running", p, "1x40") for p in (d1, d2, p1)),
        # prefill: no request in the window (counters flat) -> 0
        s("vllm:time_to_first_token_seconds_bucket", p1, "5x40", le="0.5"),
        s("vllm:time_to_first_token_seconds_bucket", p1, "5x40", le="+Inf"),
    ]
    cases = {"keda:svc_decode_kv_cache": 2.0, "keda:svc_decode_itl": 3.8, "keda:svc_prefill_ttft": 0.0}
    test = {
        "rule_files": ["keda.rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "15s",  # a 1m rate window then holds 4 samples
                "input_series": series,
                "promql_expr_test": [
                    # rounded: 0.076 / 0.04 * 2 is 3.8000000000000007 in float64
                    {"expr": f"round({name}, 0.001)", "eval_time": "8m", "exp_samples": [{"labels": "{}", "value": v}]}
                    for name, v in cases.items()
                ],
            }
        ],
    }
    (tmp_path / "keda.test.yaml").write_text(yaml.safe_dump(test))
    r = _promtool("test", "rules", "keda.test.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
