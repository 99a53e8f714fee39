"""Per-token FP8 (e4m3) quantization of activations: the input side of the W8A8 projections."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import grid_dependency, jit_unspecialized
from .elementwise import silu_mul


@triton.jit
def _row_chunk(row, k, K, SILU_MUL: tl.constexpr):
    """Columns ``k`` of one input row in fp32; with SILU_MUL the row is gate|up (width 2K) and the
    chunk is ``silu(gate) * up`` rounded as `silu_and_mul` rounds it."""
    if SILU_MUL:
        g = tl.load(row + k, mask=k < K, other=0.0)
        u = tl.load(row + K + k, mask=k < K, other=0.0)
        return silu_mul(g, u, row).to(tl.float32)
    return tl.load(row + k, mask=k < K, other=0.0).to(tl.float32)


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
    SILU_MUL: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    r_ptr=None,
    nw_ptr=None,
    ro_ptr=None,
    eps=0.0,
    NORM: tl.constexpr = False,
    HAS_RES: tl.constexpr = False,
):
    """Row ``m`` of ``x`` to e4m3 with its own scale: ``s = max(amax(|x[m]|) / FP8_MAX, MIN_SCALE)``
    (or the one STATIC scale), ``q = clamp(x / s)`` rounded to nearest. With SILU_MUL the row is a
    gate|up row and what is quantized is ``silu(gate) * up`` (the down projection's input, formed
    here instead of by a `silu_and_mul` launch).

    One program per row. When the row fits one BLOCK_K chunk (ONE_PASS) it is read once and kept in registers
    (one load, the amax, the write); otherwise two passes (the amax, then the quantized write, the
    row read again from L2). The divisions are IEEE-rounded (``div_rn``), as torch's are, so the
    result equals `fp8_quantize_rows_reference` bit for bit.

    NORM (ONE_PASS only, not with SILU_MUL): what is quantized is the RMSNorm of ``x (+ residual)``
    with weight ``nw``, rounded to x's dtype as `rms_norm` returns it, so the norm before an FP8
    projection is not a launch of its own; the residual sum goes to ``ro`` (HAS_RES)."""
    m = tl.program_id(0).to(tl.int64)
    grid_dependency(PDL)
    row = x_ptr + m * stride_x
    if ONE_PASS:
        k = tl.arange(0, BLOCK_K)
        if NORM:
            xr = tl.load(row + k, mask=k < K, other=0.0)
            if HAS_RES:
                r = tl.load(r_ptr + m * K + k, mask=k < K, other=0.0)
                xr = (xr.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
                tl.store(ro_ptr + m * K + k, xr, mask=k < K)
            xf = xr.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / K + eps)
            nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            x = (xf * rstd * nw).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            x = _row_chunk(row, k, K, SILU_MUL)
        if STATIC:
            s = tl.load(static_ptr).to(tl.float32)
        else:
            s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), FP8_MAX), MIN_SCALE)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + m * K + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    else:
        if STATIC:
            s = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                amax = tl.maximum(amax, tl.abs(_row_chunk(row, k0 + tl.arange(0, BLOCK_K), K, SILU_MUL)))
            s = tl.maximum(tl.math.div_rn(tl.max(amax, 0), FP8_MAX), MIN_SCALE)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            q = tl.minimum(tl.maximum(tl.math.div_rn(_row_chunk(row, k, K, SILU_MUL), s), -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + m * K + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + m, s)


@jit_unspecialized("M")
def fp8_gemm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``y = (xq @ wq.T) * xs[:, None] * ws[None, :] (+ b)`` for e4m3 ``xq [M, K]`` and ``wq [N, K]``
    (both rows contiguous): the W8A8 GEMM on the tensor cores, fp32 accumulation, the per-token and
    per-channel scales applied once in the epilogue. One [BLOCK_M, BLOCK_N] tile per program."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(x_ptr + m.to(tl.int64)[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + n.to(tl.int64)[None, :] * K + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
    xs = tl.load(xs_ptr + m, mask=m_ok, other=0.0)
    ws = tl.load(ws_ptr + n, mask=n_ok, other=0.0)
    y = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _x_tile_t(x_ptr, m, m_ok, k, k_ok, K, stride_x, SILU_MUL: tl.constexpr):
    """Rows ``m`` of the input at columns ``k``, transposed (``[BLOCK_K, BLOCK_M]``), in fp32; with
    SILU_MUL the rows are gate|up and the tile is ``silu(gate) * up`` rounded like `silu_and_mul`."""
    ptrs = x_ptr + m.to(tl.int64)[None, :] * stride_x + k[:, None]
    ok = k_ok[:, None] & m_ok[None, :]
    if SILU_MUL:
        g = tl.load(ptrs, mask=ok, other=0.0)
        u = tl.load(ptrs + K, mask=ok, other=0.0)
        return silu_mul(g, u, x_ptr).to(tl.float32)
    return tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)


@jit_unspecialized("M")
def fp8_swapab_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x,
    HAS_BIAS: tl.constexpr,
    QUANT_X: tl.constexpr,
    SILU_MUL: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_ROW: tl.constexpr = False,
    PDL: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1,
    part_ptr=None,
    lock_ptr=None,
):
    """``y = (xq @ wq.T) * xs[:, None] * ws[None, :] (+ b)`` for a few rows (M <= BLOCK_M = 16):
    the swapped-operand W8A8 product ``y.T [N, M] = wq [N, K] @ xq.T [K, M]``. The weight is the
    tensor cores' wide operand and the rows (padded to 16 by masked loads) the narrow one, so e4m3
    weight bytes go from memory into the MMA with no per-element conversion on the CUDA cores:
    what bounds the one-row FP8 GEMV (`gemv_kernel` widens every e4m3 weight to fp32). One
    program per BLOCK_N output channels, the whole K.

    QUANT_X: ``x`` is the float input and each program quantizes it per token itself, exactly as
    `fp8_quant_rows_kernel` does (amax pass over the row, then IEEE-rounded divisions, clamp,
    round to nearest): the same codes, no quantization launch; the input is a few KiB read from L2
    by every program. Otherwise ``x`` is already e4m3 with its scales in ``xs``. SILU_MUL (with
    QUANT_X): ``x`` is gate|up and ``silu(gate) * up`` is formed on the fly (the down projection).
    ONE_ROW (M = 1, with QUANT_X): the row is quantized as a vector and placed in column 0 of the
    padded tile, so the divisions and the SiLU run once per element, not for 15 padding rows.

    SPLIT_K > 1: SPLIT_K programs share each BLOCK_N tile, each over its own run of K chunks, so a
    narrow output (o and down of an 8B layer: 4,096 channels, 32-64 tiles) still puts a program on
    every SM. Each writes its fp32 partial product to ``part [SPLIT_K, BLOCK_M, N]`` and counts
    itself in the tile's ``lock``; the last to arrive sums the partials, applies the epilogue and
    resets the lock to 0 (so the locks stay zero between calls and CUDA graph replays: no memset
    launch)."""
    pid = tl.program_id(0)
    pid_k = pid % SPLIT_K
    pid = pid // SPLIT_K
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    rows = w_ptr + n.to(tl.int64)[:, None] * K
    grid_dependency(PDL)
    if QUANT_X:
        if ONE_ROW:  # one row: its amax, quantized as a vector, then placed in column 0 of the tile
            amax1 = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                amax1 = tl.maximum(amax1, tl.abs(_row_chunk(x_ptr, k, K, SILU_MUL)))
            s1 = tl.maximum(tl.math.div_rn(tl.max(amax1, 0), FP8_MAX), MIN_SCALE)
            s = tl.where(m == 0, s1, 0.0)
        else:
            amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                xt = _x_tile_t(x_ptr, m, m_ok, k, k < K, K, stride_x, SILU_MUL)
                amax = tl.maximum(amax, tl.max(tl.abs(xt), 0))
            s = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    else:
        s = tl.load(xs_ptr + m, mask=m_ok, other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * k_per
    for k0 in range(k_lo, tl.minimum(k_lo + k_per, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        if QUANT_X and ONE_ROW:
            q1 = tl.minimum(tl.maximum(tl.math.div_rn(_row_chunk(x_ptr, k, K, SILU_MUL), s1), -FP8_MAX), FP8_MAX)
            xq = tl.where(m[None, :] == 0, q1[:, None], 0.0).to(w_ptr.dtype.element_ty)
        elif QUANT_X:
            xt = _x_tile_t(x_ptr, m, m_ok, k, k_ok, K, stride_x, SILU_MUL)
            xq = tl.minimum(tl.maximum(tl.math.div_rn(xt, s[None, :]), -FP8_MAX), FP8_MAX).to(w_ptr.dtype.element_ty)
        else:
            xq = tl.load(
                x_ptr + m.to(tl.int64)[None, :] * stride_x + k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0
            )
        acc = tl.dot(w, xq, acc)
    if SPLIT_K > 1:
        parts = part_ptr + m[None, :] * N + n[:, None]
        tl.store(parts + pid_k * BLOCK_M * N, acc, mask=n_ok[:, None])
        tl.debug_barrier()  # every thread's partial is written before the count says so (release)
        if tl.atomic_add(lock_ptr + pid, 1) != SPLIT_K - 1:
            return
        tl.debug_barrier()
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for j in range(SPLIT_K):  # from L2 (.cg): the other programs ran on other SMs
            acc += tl.load(parts + j * BLOCK_M * N, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(lock_ptr + pid, 0)
    y = acc * s[None, :] * tl.load(ws_ptr + n, mask=n_ok, other=0.0)[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = y_ptr + m.to(tl.int64)[None, :] * N + n[:, None]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
