"""Per-token FP8 (e4m3) quantization of activations: the input side of the W8A8 projections."""

from __future__ import annotations

import triton.language as tl

from ._common import grid_dependency, jit_unspecialized


@jit_unspecialized("M")
def fp8_quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    static_ptr,
    M,
    K,
    stride_x,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    STATIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Row ``m`` of ``x`` to e4m3 with its own scale: ``s = max(amax(|x[m]|) / FP8_MAX, MIN_SCALE)``
    (or the one STATIC scale), ``q = clamp(x / s)`` rounded to nearest.

    One program per row, two passes over it (the amax, then the quantized write): a row is at most
    a few tens of KiB, so the second pass reads it from L2. The divisions are IEEE-rounded
    (``div_rn``), as torch's are, so the result equals `fp8_quantize_rows_reference` bit for bit."""
    m = tl.program_id(0).to(tl.int64)
    grid_dependency(PDL)
    row = x_ptr + m * stride_x
    if STATIC:
        s = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(row + k, mask=k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = tl.maximum(tl.math.div_rn(tl.max(amax, 0), FP8_MAX), MIN_SCALE)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(row + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + m * K + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + m, s)
