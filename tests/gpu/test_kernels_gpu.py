"""GPU correctness of kvmesh.kernels against the torch references (marker ``gpu``).

Runs the checks of tests/kernel_checks.py (fresh random shapes, NaN-poisoned outputs, the bounds
stated there; ``bench/gpu_kernels.py`` runs the same ones), one test per kernel family:

    python3 -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py

``make test`` leaves tests/gpu out; without CUDA these tests skip (tests/gpu/conftest.py).
"""

from __future__ import annotations

import kernel_checks
import pytest


@pytest.mark.parametrize(
    "check",
    [
        "check_write_kv",
        "check_fp8_kv",
        "check_blocks",
        "check_elementwise",
        "check_top_p",
        "check_race",
        "check_attention",
        "check_cuda_graph",
        "check_pdl",
        "check_fp8",
    ],
)
def test_kernel_family(gen, check):
    kernel_checks.FAILED.clear()
    getattr(kernel_checks, check)(gen)
    assert not kernel_checks.FAILED, f"failed checks: {kernel_checks.FAILED}"
