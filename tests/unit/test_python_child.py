"""kvmesh's Python children never import the checkout's folders as top-level modules.

From the repository root, ``python -m ...`` puts the working directory first on ``sys.path``, where
``kernels/`` shadows the installed ``kernels`` package that transformers imports (the server's engine
process then failed with an ImportError) and ``operator/`` shadows the standard library's. Every
child kvmesh starts goes through kvmesh/common/python_child.py, which adds ``-P``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.common.python_child import kvmesh_command, python_module

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import importlib.util, json, operator;"
    "k = importlib.util.find_spec('kernels');"
    "print(json.dumps({'kernels': k.origin if k else None, 'operator': operator.__file__}))"
)


def _run_from_root(argv: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # as a user's shell has it
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_child_started_from_the_repository_root_sees_installed_modules_only():
    argv = python_module("kvmesh.cli")
    assert argv[:3] == [sys.executable, "-P", "-m"] and kvmesh_command("up") == [*argv, "up"]
    # The same interpreter flags, with the probe instead of a module (-c keeps the flags' meaning).
    got = _run_from_root([*argv[:2], "-c", PROBE])
    for name in ("kernels", "operator"):
        assert got[name] is None or not Path(got[name]).is_relative_to(ROOT / name), (name, got[name])
    # Without -P the checkout's folders win: the check above is one that can fail.
    unsafe = _run_from_root([sys.executable, "-c", PROBE])
    assert Path(unsafe["kernels"]).is_relative_to(ROOT / "kernels")


def test_transformers_imports_in_a_child_at_the_repository_root():
    """transformers (>= 5.2x) imports `kernels` when one can be found: the engine process's case."""
    argv = python_module("kvmesh.cli")
    code = "import json, transformers.integrations.hub_kernels as h; print(json.dumps({'ok': True}))"
    assert _run_from_root([*argv[:2], "-c", code]) == {"ok": True}


def test_no_python_child_is_started_without_the_safe_path():
    """Product and benchmark code start Python children only through kvmesh/common/python_child.py."""
    bare = re.compile(r"sys\.executable,\s*\"-m\"")
    offenders = [
        str(p.relative_to(ROOT))
        for d in ("kvmesh", "engine", "services", "operator", "kernels", "bench", "tests")
        for p in (ROOT / d).rglob("*.py")
        if bare.search(p.read_text())
    ]
    assert offenders == []
