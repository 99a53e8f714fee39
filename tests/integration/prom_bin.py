"""The Prometheus and promtool binaries, and the OpenTelemetry Collector, that tests/e2e/cluster/build.sh
builds from the Go module proxy (pinned in versions.env, cached under $KVMESH_CACHE), and the chart
rendered with helm.

Why build on demand: `make test` starts the build in the background before the install, so it is
normally done when the tests get here; a test run on its own builds it now (about 3 minutes cold)
rather than skip. A failed build fails the test with the build's log.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "e2e" / "cluster"
CACHE = Path(os.environ.get("KVMESH_CACHE", Path.home() / ".cache" / "kvmesh"))


def _versions() -> dict[str, str]:
    out = {}
    for line in (SCRIPTS / "versions.env").read_text().splitlines():
        k, sep, v = line.partition("=")
        if sep and not line.lstrip().startswith("#"):
            out[k.strip()] = v.strip()
    return out


VERSIONS = _versions()
PROMETHEUS_BIN = CACHE / f"prometheus-v{VERSIONS['PROMETHEUS_VERSION']}" / "bin"
OTELCOL_BIN = CACHE / f"otelcol-v{VERSIONS['OTELCOL_VERSION']}" / "bin"
# common.sh's TOOLS_DIR (kubectl and helm)
_TOOLS = f"tools-{VERSIONS['KUBECTL_LAYER_PKG'].rsplit('/', 1)[-1]}-{VERSIONS['KUBECTL_LAYER_VERSION']}"
TOOLS_BIN = CACHE / _TOOLS / "bin"


def _ensure(stamp: Path, target: str) -> None:
    if stamp.exists():
        return
    r = subprocess.run(
        ["bash", str(SCRIPTS / "build.sh"), target], capture_output=True, text=True, timeout=1800, check=False
    )
    if r.returncode != 0 or not stamp.exists():
        raise RuntimeError(
            f"`bash tests/e2e/cluster/build.sh {target}` failed (rc {r.returncode}); it builds what this "
            f"test runs. Its output ends with:\n{(r.stdout + r.stderr)[-3000:]}"
        )


def prometheus_tool(name: str) -> Path:
    """Path of `prometheus` or `promtool`, built first when the cache lacks it."""
    _ensure(PROMETHEUS_BIN / ".done", "prometheus")
    return PROMETHEUS_BIN / name


def otelcol() -> Path:
    """Path of the OpenTelemetry Collector (OTLP receiver, batch processor, debug exporter), built first
    when the cache lacks it."""
    _ensure(OTELCOL_BIN / ".done", "otelcol")
    return OTELCOL_BIN / "otelcol"


def helm() -> Path:
    _ensure(TOOLS_BIN.parent / ".done", "tools")
    return TOOLS_BIN / "helm"


def helm_template(*args: str) -> list[dict]:
    """The chart's documents as `helm template` renders them with these extra arguments."""
    r = subprocess.run(
        [str(helm()), "template", "kvmesh", str(ROOT / "charts" / "kvmesh"), "--namespace", "kvmesh-system", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "HELM_CACHE_HOME": str(CACHE / "helm"), "HELM_CONFIG_HOME": str(CACHE / "helm")},
    )
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def rules_file(*helm_args: str) -> dict:
    """The chart's PrometheusRule as a Prometheus rule file ({groups: [...]})."""
    docs = helm_template("--set", "alerts.enabled=true", *helm_args)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return {"groups": rule["spec"]["groups"]}
