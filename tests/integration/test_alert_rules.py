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
