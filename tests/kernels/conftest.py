"""Run the Triton kernels under Triton's interpreter on the CPU.

`kvmesh.kernels` decides per call: CPU tensors go to the interpreter when
``TRITON_INTERPRET=1`` is set *at call time* (it keeps a separately imported,
interpreted copy of its kernels), so setting the variable per test with
monkeypatch is enough and robust to import order; it does not leak into other
test directories (where the engine's CPU path must stay on the fast reference).
"""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def triton_interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def gen():
    """A fresh seed per test (printed, so a failure can be replayed)."""
    seed = int(os.environ.get("KVMESH_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed={seed}")
    g = torch.Generator()
    g.manual_seed(seed)
    return g
