"""Runs a GPU benchmark script of bench/ in its ``--smoke`` mode (a tiny random model on the CPU) the one way
every benchmark test does: in a process of its own, so the script runs as it would from a shell, with its
results written to a test's folder (OUT) and read back.

The run drops TRITON_INTERPRET (a caller's interpreter mode would only slow the CPU path down) and sets
KVMESH_CPU_THREADS=1 (more OpenMP threads than idle cores slow the matmuls many times over)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SmokeRun:
    stdout: str  # the table the script printed
    results: dict[str, Any]  # the JSON it wrote, OUT/<script>.json


def run_smoke(script: str, out: Path, *args: str, timeout: float = 300) -> SmokeRun:
    """``python -P bench/<script>.py --smoke *args`` with OUT and the working directory at ``out``; fails
    the test (with the script's output) unless it exits 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"OUT": str(out), "KVMESH_CPU_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bench" / f"{script}.py"), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=out,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return SmokeRun(done.stdout, json.loads((out / f"{script}.json").read_text()))
