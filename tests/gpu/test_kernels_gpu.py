"""GPU correctness of kvmesh.kernels against the torch references (marker ``gpu``).

Runs the same checks as ``bench/gpu_kernels.py`` (fresh random shapes, NaN-poisoned
outputs, the bounds stated there), one test per kernel family, so there is one
definition of "correct". Run through the device tool, e.g.:

    python3 -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py

``make test`` deselects the ``gpu`` marker; without CUDA these tests skip.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("gpu_kernels.py")


@pytest.fixture
def gen():
    g = torch.Generator(device="cuda")
    seed = int.from_bytes(os.urandom(4), "little")
    g.manual_seed(seed)
    print("seed", seed)
    return g


@pytest.mark.parametrize("check", ["check_write_kv", "check_blocks", "check_elementwise", "check_top_p", "check_race",
                                   "check_attention", "check_cuda_graph", "check_pdl"])
def test_kernel_family(bench, gen, check):
    bench.FAILED.clear()
    getattr(bench, check)(gen)
    assert not bench.FAILED, f"failed checks: {bench.FAILED}"
