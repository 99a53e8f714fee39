"""FP8 (e4m3) kernels vs their torch references, under TRITON_INTERPRET=1 on the CPU.

Per-token quantization must equal `fp8_quantize_rows_reference` bit for bit (IEEE-rounded
divisions, round-to-nearest casts). The GEMV on an e4m3 weight sums in another order than the
float64 reference of the same quantized operands, so it gets the bf16 GEMV's bounds
(||y - ref|| / ||ref||: 1e-5 fp32, 8e-3 bf16 output rounding).
"""

from __future__ import annotations

import pytest
import torch

import kvmesh.kernels as K
from kvmesh.kernels import fp8, matmul

pytestmark = pytest.mark.unit

GEMV_BOUND = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def weight(gen, n, k, dtype=torch.float32):
    return K.quantize_weight((torch.randn(n, k, generator=gen) / k**0.5).to(dtype))


def ref64(x, w: K.Fp8Weight, bias=None):
    """``x @ W.T * scale (+ bias)`` in float64 on the inputs as given (x already e4m3 or not)."""
    y = (x.double() @ w.weight.double().T) * w.scale.double()[None, :]
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(5, 96), (2, 2500), (2, 16500)])
def test_quantize_rows_exact(gen, dtype, m, k):
    """Dynamic scales (an all-zero row and a huge row included; rows in one pass and, beyond 16,384
    columns, in two) and a static scale (values beyond its range clamp to +-448): codes and scales
    equal the reference."""
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]).to(dtype)
    x[0] = 0
    for static in (None, torch.tensor(0.01)):
        q, s = K.fp8_quantize_rows(x, static)
        rq, rs = K.fp8_quantize_rows_reference(x, static)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert torch.equal(s, rs)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert (q.float().abs() == 448).any(), "the static scale should have clamped some values"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [96, 16500])
def test_quantize_rows_fused_silu_mul(gen, dtype, k):
    """silu_mul=True quantizes ``silu_and_mul`` of a gate|up row in the same pass: equal, codes and
    scales, to the `silu_and_mul` kernel followed by the quantization."""
    x = (torch.randn(3, 2 * k, generator=gen) * 3).to(dtype)
    q, s = K.fp8_quantize_rows(x, silu_mul=True)
    rq, rs = K.fp8_quantize_rows(K.silu_and_mul(x))
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    with pytest.raises(ValueError, match="even width"):
        K.fp8_quantize_rows(x[:, :-1], silu_mul=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias", [(48, 64, False), (37, 96, True), (64, 1000, False)])
def test_fp8_gemv(gen, dtype, n, k, bias):
    """One row on an e4m3 weight (W8A16): the GEMV kernel against the float64 product of the same
    quantized weight; the tuned and the heuristic configuration."""
    w = weight(gen, n, k)
    x = torch.randn(1, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    ref = ref64(x, w, b)
    for cfg in ((8, 32, 4, 1), None):
        y = K.linear(x, w, b, config=cfg)
        assert y.dtype == dtype and y.shape == (1, n)
        assert rel_err(y, ref) < GEMV_BOUND[dtype]
    assert rel_err(K.fp8_gemv_reference(x, w.weight, w.scale, b), ref) < GEMV_BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_silu_mul_gemv(gen, dtype):
    n, k = 40, 96
    w = weight(gen, n, k)
    x = torch.randn(1, 2 * k, generator=gen).to(dtype)
    y = K.silu_mul_linear(x, w, config=(8, 64, 4, 1))
    ref = ref64(K.silu_and_mul(x), w)  # the activation rounded as the kernel rounds it
    assert rel_err(y, ref) < GEMV_BOUND[dtype]


def test_fp8_gemv_w8a8(gen):
    """``fp8_gemv_w8a8``: the row quantized per token first, then the GEMV on e4m3 x e4m3."""
    c = K.KernelChoices(fp8_gemv_w8a8=True)
    w = weight(gen, 48, 128)
    x = torch.randn(1, 256, generator=gen)
    for silu in (False, True):
        h = K.silu_and_mul_reference(x) if silu else x[:, :128]
        y = K.silu_mul_linear(x, w, choices=c) if silu else K.linear(h, w, choices=c)
        xq, xs = K.fp8_quantize_rows_reference(h)
        assert rel_err(y, ref64(xq, w) * xs.double()[:, None]) < 1e-5
        assert rel_err(y, K.fp8_linear_reference(h, w.weight, w.scale)) < 1e-5


def test_fp8_matmul_rows(gen):
    """More than one row: the quantization kernel, then the scaled product (the upcasting
    reference here; torch._scaled_mm on a GPU): equal to the W8A8 reference."""
    w = weight(gen, 32, 64)
    x = torch.randn(7, 64, generator=gen)
    b = torch.randn(32, generator=gen)
    y = K.linear(x, w, b)
    assert torch.equal(y, K.fp8_linear_reference(x, w.weight, w.scale, b))
    y2 = K.silu_mul_linear(torch.cat([x, x], 1), w)
    assert torch.equal(y2, K.fp8_linear_reference(K.silu_and_mul(torch.cat([x, x], 1)), w.weight, w.scale))


def test_fp8_dispatch_and_errors(gen, monkeypatch):
    """Single rows take the GEMV (with the weight's scales), more rows do not; ``gemv_kernel`` off
    turns it off; bad shapes and weights are clear errors."""
    calls = []
    real = matmul._gemv
    monkeypatch.setattr(matmul, "_gemv", lambda *a, **kw: calls.append(kw["w_scale"] is not None) or real(*a, **kw))
    w = weight(gen, 16, 32)
    K.linear(torch.randn(1, 32, generator=gen), w)
    K.linear(torch.randn(3, 32, generator=gen), w)
    K.linear(torch.randn(1, 32, generator=gen), w, choices=K.KernelChoices(gemv_kernel=False))
    assert calls == [True]
    with pytest.raises(ValueError, match="does not match weight"):
        K.linear(torch.randn(1, 31), w)
    with pytest.raises(ValueError, match="bias must be"):
        K.linear(torch.randn(1, 32), w, torch.randn(15))
    with pytest.raises(ValueError, match="one entry per row"):
        fp8.Fp8Weight(w.weight, w.scale[:3])
    with pytest.raises(ValueError, match="dtype"):
        fp8.Fp8Weight(w.weight.float(), w.scale)


def test_kernel_checks_fp8(gen, monkeypatch):
    """tests/kernel_checks.py's FP8 checks (what tests/gpu and bench/gpu_fp8.py run on a GPU) pass
    in the interpreter."""
    import kernel_checks

    monkeypatch.setattr(kernel_checks, "DEV", "cpu")
    kernel_checks.FAILED.clear()
    kernel_checks.check_fp8(gen)
    assert not kernel_checks.FAILED, kernel_checks.FAILED


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,bias", [(1, 70, 300, False), (5, 48, 64, False), (37, 70, 96, True)])
def test_fp8_gemm_triton(gen, dtype, m, n, k, bias):
    """The Triton W8A8 GEMM (tiles not multiples of the shapes included) against the float64
    product of the same quantized operands; and through `linear` with ``fp8_gemm="triton"``."""
    w = weight(gen, n, k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    xq, xs = K.fp8_quantize_rows(x)
    ref = ref64(xq, w) * xs.double()[:, None]
    ref = ref if b is None else ref + b.double()
    y = fp8.fp8_gemm(xq, xs, w, b, dtype, config=(16, 32, 32, 4, 1))
    assert y.dtype == dtype and rel_err(y, ref) < GEMV_BOUND[dtype]
    if m > 1:  # one row takes the GEMV (W8A16) whatever the GEMM
        assert rel_err(K.linear(x, w, b, choices=K.KernelChoices(fp8_gemm="triton")), ref) < GEMV_BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,bias", [(1, 70, 300, True), (5, 48, 64, False), (16, 40, 96, False)])
def test_fp8_swapab(gen, dtype, m, n, k, bias):
    """The swapped-operand W8A8 product (`fp8_swapab`): the row quantized inside the kernel, plain
    and of a gate|up row (silu_mul), and an already quantized row; against the float64 product of
    the operands `fp8_quantize_rows` makes (the in-kernel quantization is the same rule)."""
    w = weight(gen, n, k)
    x = torch.randn(m, k, generator=gen).to(dtype) * torch.logspace(-2, 2, m)[:, None].to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    xq, xs = K.fp8_quantize_rows(x)
    ref = ref64(xq, w) * xs.double()[:, None]
    ref = ref if b is None else ref + b.double()
    for y in (fp8.fp8_swapab(x, w, b, config=(16, 32, 4, 1)), fp8.fp8_swapab(xq, w, b, x_scale=xs, out_dtype=dtype)):
        assert y.dtype == dtype and y.shape == (m, n)
        assert rel_err(y, ref) < GEMV_BOUND[dtype]
    gu = torch.randn(m, 2 * k, generator=gen).to(dtype)
    gq, gs = K.fp8_quantize_rows(gu, silu_mul=True)
    y = fp8.fp8_swapab(gu, w, None, silu_mul=True, config=(32, 64, 4, 1))
    assert rel_err(y, ref64(gq, w) * gs.double()[:, None]) < GEMV_BOUND[dtype]
    with pytest.raises(ValueError, match="at most 16 rows"):
        fp8.fp8_swapab(torch.randn(17, k), w, None)
    with pytest.raises(ValueError, match="x_scale"):
        fp8.fp8_swapab(xq, w, None)


@pytest.mark.parametrize("m,split", [(1, 3), (4, 2), (1, 8)])
def test_fp8_swapab_split_k(gen, m, split):
    """Split-K: several programs per output tile, each over its own K chunks, the last one summing
    the partials. Equal to W8A8 within the same bound (8 splits of 5 chunks: some programs get no
    chunk); the tile locks are back at zero after the call, so a second call (a graph replay) gives
    the same output bit for bit."""
    n, k = 40, 160
    w = weight(gen, n, k)
    x = torch.randn(m, k, generator=gen)
    xq, xs = K.fp8_quantize_rows(x)
    ref = ref64(xq, w) * xs.double()[:, None]
    y = fp8.fp8_swapab(x, w, None, config=(16, 32, 4, 1), split_k=split)
    assert rel_err(y, ref) < GEMV_BOUND[torch.float32]
    part, lock = fp8._SPLIT_BUFFERS[x.device]
    assert lock.numel() >= 3 and not lock.any()
    assert torch.equal(fp8.fp8_swapab(x, w, None, config=(16, 32, 4, 1), split_k=split), y)


@pytest.mark.parametrize("path", ["bits", "swapab", "swapab_q"])
def test_fp8_one_row_paths(gen, path):
    """``fp8_one_row_kernel`` picks the one-row kernel: integer widening (exact on denormal e4m3 weights:
    a row whose outlier pushes the rest below 2^-6) equals the GEMV with conversions; the swapped
    product (row quantized in the kernel or by the quantization kernel first) equals W8A8; an
    unknown name is a clear error."""
    w = weight(gen, 40, 96)
    wt = w.weight.clone()
    wt[3] = (torch.randn(96, generator=gen) * 0.01).to(torch.float8_e4m3fn)  # denormals among them
    w = fp8.Fp8Weight(wt, w.scale)
    assert (w.weight[3].view(torch.uint8) & 0x78 == 0).sum() > 10
    x = torch.randn(1, 96, generator=gen)
    g = torch.randn(1, 192, generator=gen)
    base = (K.linear(x, w, config=(8, 32, 4, 1)), K.silu_mul_linear(g, w, config=(8, 32, 4, 1)))
    c = K.KernelChoices(fp8_one_row_kernel=path)
    if path == "bits":
        got = (
            K.linear(x, w, config=(8, 32, 4, 1), choices=c),
            K.silu_mul_linear(g, w, config=(8, 32, 4, 1), choices=c),
        )
        for y, r in zip(got, base):
            assert rel_err(y, r) < 1e-6
    else:
        for y, h in ((K.linear(x, w, choices=c), x), (K.silu_mul_linear(g, w, choices=c), K.silu_and_mul(g))):
            xq, xs = K.fp8_quantize_rows(h)
            assert rel_err(y, ref64(xq, w) * xs.double()[:, None]) < 1e-5
    with pytest.raises(ValueError, match="fp8_one_row_kernel"):
        K.KernelChoices(fp8_one_row_kernel="nope")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("res", [True, False])
def test_quantize_rows_forms_the_rms_norm(gen, dtype, res):
    """A norm in the quantization pass: codes and scales equal `rms_norm` followed by the quantization,
    and the residual sum equals `rms_norm`'s; rows too wide for one pass are refused."""
    x = (torch.randn(3, 96, generator=gen) * 3).to(dtype)
    r = torch.randn(3, 96, generator=gen).to(dtype) if res else None
    nw = (1 + 0.3 * torch.randn(96, generator=gen)).to(dtype)
    ro = torch.empty_like(x) if res else None
    q, s = fp8.fp8_quantize_rows(x, norm=fp8.RowNorm(nw, 1e-6, r, ro))
    if res:
        normed, ref_ro = K.rms_norm(x, nw, 1e-6, r)
        assert torch.equal(ro, ref_ro)
    else:
        normed = K.rms_norm(x, nw, 1e-6)
    rq, rs = K.fp8_quantize_rows(normed)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    wide = torch.randn(1, 16500, generator=gen)
    with pytest.raises(ValueError, match="ONE_PASS_MAX"):
        fp8.fp8_quantize_rows(wide, norm=fp8.RowNorm(torch.ones(16500), 1e-6))


@pytest.mark.parametrize("path", ["convert", "swapab_q", "swapab", "rows"])
def test_rms_norm_linear_on_fp8_weights(gen, path, monkeypatch):
    """The norm before an FP8 projection: formed by the GEMV or the quantization where the path reads
    the row through one (one launch fewer; `rms_norm` is not called), by `rms_norm` first on the
    swapped product of bf16 rows; the result is the two-launch one's either way."""
    norms = []
    real = matmul.rms_norm
    monkeypatch.setattr(matmul, "rms_norm", lambda *a, **kw: norms.append(1) or real(*a, **kw))
    m = 4 if path == "rows" else 1
    w = weight(gen, 40, 96)
    x, r = torch.randn(m, 96, generator=gen), torch.randn(m, 96, generator=gen)
    nw = torch.rand(96, generator=gen) + 0.5
    c = K.KernelChoices(fp8_one_row_kernel=None if path == "rows" else path, fused_norm_gemv=True)
    y, normed, ro = K.rms_norm_linear(x, nw, 1e-6, r, w, choices=c)
    assert normed is None
    assert len(norms) == (1 if path == "swapab" else 0)
    ref_x, ref_r = real(x, nw, 1e-6, r)
    assert torch.equal(ro, ref_r)
    assert rel_err(y, K.linear(ref_x, w, choices=c)) < 1e-5
