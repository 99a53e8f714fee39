"""Run the Triton kernels under Triton's interpreter on the CPU.

`kvmesh.kernels` sends CPU tensors to the Triton kernels when ``TRITON_INTERPRET=1`` was set when
it was imported (`kvmesh.kernels._dispatch.INTERPRET`). Each test sets that flag and points the kernel
lookup at an interpreted copy of the kernel bodies (tests/kernels/triton_interpreter.py), both undone
after the test, so the engine's CPU path in other test directories stays on the fast reference.
"""

from __future__ import annotations

import pytest
import torch
from seeds import seed_for
from triton_interpreter import interpreted_kernels

from kvmesh.kernels import _dispatch


@pytest.fixture(autouse=True)
def triton_interpret(monkeypatch):
    monkeypatch.setattr(_dispatch, "INTERPRET", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's own checks read it at launch (its knobs)
    compiled = _dispatch.kernels_for
    interpreted = interpreted_kernels()
    monkeypatch.setattr(_dispatch, "kernels_for", lambda t: compiled(t) if t.is_cuda else interpreted)
    yield


@pytest.fixture
def gen(request):
    """A generator seeded with the test's fixed seed (tests/seeds.py; KVMESH_TEST_SEED=random for sweeps)."""
    return torch.Generator().manual_seed(seed_for(request.node.nodeid))


@pytest.fixture
def rope_case(gen):
    """``make(T, D, hq, hkv, dtype, scale=1.0) -> (positions, cos_sin_cache, q, k, v)``: random positions
    under 64, the rotate-half cache of 64 positions, and q / k / v as the model's split views of one qkv
    row block (random, times ``scale``), drawn from ``gen`` in that order."""

    def make(T, D, hq, hkv, dtype, scale=1.0):
        pos = torch.randint(0, 64, (T,), generator=gen)
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
        fr = torch.outer(torch.arange(64).float(), inv)
        cs = torch.cat([fr.cos(), fr.sin()], -1)
        qkv = (torch.randn(T, (hq + 2 * hkv) * D, generator=gen) * scale).to(dtype)
        q, k, v = (t.view(T, -1, D) for t in qkv.split([hq * D, hkv * D, hkv * D], -1))
        return pos, cs, q, k, v

    return make
