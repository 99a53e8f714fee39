"""Shared by the GPU tests (marker ``gpu``; they skip without CUDA): the marker itself, a CUDA
generator with the test's fixed seed, and ``bench/gpu_engine.py`` imported as a module, so the
engine benchmark's correctness check and the tests are one definition of correct. The kernel
checks come from tests/kernel_checks.py."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from seeds import seed_for

_HERE = os.path.dirname(os.path.abspath(__file__))
_BENCH = os.path.join(_HERE, "..", "..", "bench")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
    for item in items:
        if str(item.path).startswith(_HERE + os.sep):
            item.add_marker(pytest.mark.gpu)
            item.add_marker(skip)


@pytest.fixture(scope="session")
def engine_bench():
    """``bench/gpu_engine.py`` imported under a name of its own."""
    spec = importlib.util.spec_from_file_location("kvmesh_bench_gpu_engine", os.path.join(_BENCH, "gpu_engine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def gen(request):
    """A CUDA generator seeded with the test's fixed seed (tests/seeds.py; KVMESH_TEST_SEED=random for sweeps)."""
    return torch.Generator(device="cuda").manual_seed(seed_for(request.node.nodeid))
