"""The batched-LoRA torch references (`lora_shrink_reference`, `lora_expand_reference`) against the
definition row by row: each row through its own slot's A and B, the base model's rows (slot -1)
untouched, every slice into its own column range of ``y``. They group rows by slot; this is the
plain loop they must equal. Also the wrappers' argument checks (CPU: the reference path), and
bench/gpu_lora.py's CPU smoke run."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import kvmesh.kernels as K

pytestmark = pytest.mark.unit


def per_row(x, a, b, slots, y, offsets):
    """``(h, y + delta)`` one row and one slice at a time, in float64."""
    n, R = a.shape[1], a.shape[2]
    h = torch.zeros(n, x.shape[0], R, dtype=torch.float64)
    out = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for i in range(n):
            h[i, t] = a[s, i].double() @ x[t].double()
            lo, hi = offsets[i], offsets[i + 1]
            out[t, lo:hi] += b[s, i, : hi - lo].double() @ h[i, t]
    return h, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths,slot_dtype", [((12,), torch.int64), ((10, 6, 6), torch.int32), ((9, 9), torch.int64)])
def test_reference_equals_the_per_row_loop(widths, slot_dtype, dtype):
    g = torch.Generator().manual_seed(len(widths))
    T, Kin, R, S = 9, 20, 8, 3
    n, N = len(widths), max(widths)
    x = torch.randn(T, Kin, generator=g).to(dtype)
    a = torch.randn(S, n, R, Kin, generator=g).to(dtype)
    b = torch.randn(S, n, N, R, generator=g).to(dtype)
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2, 0, 1], dtype=slot_dtype)
    offsets = tuple(int(v) for v in torch.tensor([0, *widths]).cumsum(0))
    y = torch.randn(T, offsets[-1], generator=g).to(dtype)
    h_loop, y_loop = per_row(x, a, b, slots, y, offsets)

    h = K.lora_shrink_reference(x, a, slots)
    assert h.dtype == torch.float32 and h.shape == (n, T, R)
    torch.testing.assert_close(h.double(), h_loop, rtol=1e-5, atol=1e-4)
    assert (h[:, slots < 0] == 0).all()

    before = y.clone()
    out = K.lora_expand_reference(y, h, b, slots, offsets)
    assert out is y and y.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=5e-2)
    torch.testing.assert_close(y.double(), y_loop, **tol)
    assert torch.equal(y[slots < 0], before[slots < 0])


def test_wrappers_take_the_reference_on_the_cpu_and_check_shapes():
    x, a = torch.randn(3, 8), torch.randn(2, 2, 4, 8)
    b, slots = torch.randn(2, 2, 6, 4), torch.tensor([1, -1, 0])
    h = K.lora_shrink(x, a, slots)
    torch.testing.assert_close(h, K.lora_shrink_reference(x, a, slots))
    y = torch.zeros(3, 10)
    K.lora_expand(y, h, b, slots, (0, 6, 10))
    torch.testing.assert_close(y, K.lora_expand_reference(torch.zeros(3, 10), h, b, slots, (0, 6, 10)))
    with pytest.raises(ValueError, match="offsets"):
        K.lora_expand(y, h, b, slots, (0, 6, 9))
    with pytest.raises(ValueError, match="wider"):
        K.lora_expand(y, h, b, slots, (0, 8, 10))
    with pytest.raises(ValueError, match="h must be"):
        K.lora_expand(y, h[:1], b, slots, (0, 6, 10))
    with pytest.raises(ValueError, match="h has dtype"):
        K.lora_expand(y, h.to(torch.int32), b, slots, (0, 6, 10))
    with pytest.raises(ValueError, match="slots"):
        K.lora_shrink(x, a, slots[:2])
    with pytest.raises(ValueError, match="input features"):
        K.lora_shrink(x[:, :7], a, slots)


def test_lora_benchmark_runs_end_to_end_on_the_cpu(tmp_path):
    """bench/gpu_lora.py --smoke: tiny shapes through the references, its table printed and its JSON written."""
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OUT": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "gpu_lora.py"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "8 adapters" in proc.stdout
    rows = json.loads((tmp_path / "gpu_lora.json").read_text())["lora"]
    assert {r["proj"] for r in rows} == {"q|k|v", "o", "gate|up", "down", "layer"}
    assert {r["T"] for r in rows} == {1, 4}
    assert all(max(r["one_rel_err"], r["eight_rel_err"], r["eight_walk_rel_err"]) < 1e-5 for r in rows)
