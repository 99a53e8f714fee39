"""Run the Triton kernels under Triton's interpreter on the CPU.

`kvmesh.kernels` sends CPU tensors to the Triton kernels when ``TRITON_INTERPRET=1`` is set at
call time. Each test sets it and points the kernel lookup at an interpreted copy of the kernel
bodies (tests/kernels/triton_interpreter.py), both undone after the test, so the engine's CPU path in
other test directories stays on the fast reference.
"""

from __future__ import annotations

import os

import pytest
import torch
from triton_interpreter import interpreted_kernels

from kvmesh.kernels import _dispatch


@pytest.fixture(autouse=True)
def triton_interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    compiled = _dispatch.kernels_for
    interpreted = interpreted_kernels()
    monkeypatch.setattr(_dispatch, "kernels_for", lambda t: compiled(t) if t.is_cuda else interpreted)
    yield


@pytest.fixture
def gen():
    """A fresh seed per test (printed, so a failure can be replayed)."""
    seed = int(os.environ.get("KVMESH_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed={seed}")
    g = torch.Generator()
    g.manual_seed(seed)
    return g
