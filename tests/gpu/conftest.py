"""Shared by the GPU tests (marker ``gpu``; they skip without CUDA): the marker itself and a CUDA
generator with the test's fixed seed. The definitions of correct they share with the GPU benchmarks
are tests/kernel_checks.py and tests/engine_checks.py (the benchmarks import them from here)."""

from __future__ import annotations

import os

import pytest
import torch
from seeds import seed_for

_HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
    for item in items:
        if str(item.path).startswith(_HERE + os.sep):
            item.add_marker(pytest.mark.gpu)
            item.add_marker(skip)


@pytest.fixture
def gen(request):
    """A CUDA generator seeded with the test's fixed seed (tests/seeds.py; KVMESH_TEST_SEED=random for sweeps)."""
    return torch.Generator(device="cuda").manual_seed(seed_for(request.node.nodeid))
