"""Shared by the GPU tests: each loads one ``bench/gpu_*.py`` script as a module, so the
benchmark's checks and the tests are one definition of correct."""
from __future__ import annotations

import importlib.util
import os

import pytest

_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def _load(script: str):
    spec = importlib.util.spec_from_file_location(f"kvmesh_bench_{script[:-3]}", os.path.join(_BENCH, script))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def load_bench():
    """``load_bench("gpu_engine.py")``: ``bench/<script>`` imported under a name of its own."""
    return _load
