"""The one-row GEMV of decode at batch 1 (optionally fused with SiLU-and-multiply, or with the
RMSNorm before it)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import grid_dependency
from .elementwise import silu_mul


@triton.jit
def _gemv_w(rows, n_ok, k, k_ok, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] weight tile, streamed once (``evict_first``)."""
    if EVEN_K:
        if EVEN_N:
            w = tl.load(rows + k[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(rows + k[None, :], mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
    return w


@triton.jit
def _widen(w, W_BITS: tl.constexpr):
    """A weight tile in fp32. W_BITS: ``w`` holds e4m3 bytes (as uint8) and becomes fp32 by integer
    ops instead of conversions: sign to bit 31, exponent and mantissa (7 bits) to bits 20-26, which
    is the e4m3 value times 2^-120 exactly, normals and denormals alike (the caller scales the
    input by 2^64 and the sum by 2^56)."""
    if W_BITS:
        b = w.to(tl.uint32)
        return (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
    return w.to(tl.float32)


@triton.jit
def _gemv_x(x_ptr, k, k_ok, K, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
    """The input chunk at ``k`` in fp32; with SILU_MUL ``silu(gate) * up`` rounded like `silu_and_mul`."""
    if SILU_MUL:
        if EVEN_K:
            g = tl.load(x_ptr + k)
            u = tl.load(x_ptr + K + k)
        else:
            g = tl.load(x_ptr + k, mask=k_ok, other=0.0)
            u = tl.load(x_ptr + K + k, mask=k_ok, other=0.0)
        xf = silu_mul(g, u, x_ptr).to(tl.float32)
    else:
        if EVEN_K:
            xf = tl.load(x_ptr + k).to(tl.float32)
        else:
            xf = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
    return xf


@triton.jit
def _norm_in(x_ptr, r_ptr, k, k_ok, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr):
    """The RMSNorm's input chunk at ``k``: ``x + residual`` rounded to x's dtype, as `rms_norm_kernel` forms it."""
    if EVEN_K:
        x = tl.load(x_ptr + k)
    else:
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
    if HAS_RES:
        if EVEN_K:
            r = tl.load(r_ptr + k)
        else:
            r = tl.load(r_ptr + k, mask=k_ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def _normed_row(
    x_ptr,
    r_ptr,
    nw_ptr,
    ro_ptr,
    xo_ptr,
    k,
    k_ok,
    K,
    eps,
    first,
    HAS_RES: tl.constexpr,
    STORE_X: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The whole input row (one chunk), normalised, in fp32: rounded to x's dtype first as `rms_norm`
    returns it (its weight in x's dtype, multiplied in fp32). The ``first`` program also stores the
    residual sum (HAS_RES) and the normalised row (STORE_X) for the kernels after this one."""
    x = _norm_in(x_ptr, r_ptr, k, k_ok, HAS_RES, EVEN_K)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / K + eps)
    if EVEN_K:
        nw = tl.load(nw_ptr + k)
    else:
        nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0)
    y = (xf * rstd * nw.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if HAS_RES:
        tl.store(ro_ptr + k, x, mask=k_ok & first)
    if STORE_X:
        tl.store(xo_ptr + k, y, mask=k_ok & first)
    return y.to(tl.float32)


@triton.jit
def gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    xs_ptr,
    N,
    K,
    stride_w,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    W_SCALE: tl.constexpr = False,
    X_SCALE: tl.constexpr = False,
    W_BITS: tl.constexpr = False,
    r_ptr=None,
    nw_ptr=None,
    ro_ptr=None,
    xo_ptr=None,
    eps=0.0,
    NORM: tl.constexpr = False,
    HAS_RES: tl.constexpr = False,
    STORE_X: tl.constexpr = False,
):
    """``y = w @ x (+ b)`` for ONE input row: the decode step at batch 1, where every
    projection is a matrix-vector product bound by reading the weights once.

    Each program owns BLOCK_N output rows and streams their weights in BLOCK_K
    chunks, keeping a [BLOCK_N, BLOCK_K] fp32 partial product that is summed once at
    the end (so the loop body is loads and FMAs only). Weights are loaded with
    ``evict_first``: they are read once per step and would otherwise push the KV
    and activations out of L2. With SILU_MUL the input is a gate|up row of width 2K
    and ``silu(gate) * up`` is formed on the fly, rounded like `silu_and_mul`, which
    removes that launch before the down projection. The first weight tile is loaded
    before `grid_dependency`: weights do not depend on the kernel before this one, so
    under programmatic dependent launch their stream starts while that kernel finishes.

    FP8 weights (e4m3, half the bytes of bf16) stream through the same loop, widened to fp32 as
    they arrive; W_SCALE multiplies each output row by its per-channel scale ``ws[n]`` once at
    the end. X_SCALE takes an e4m3 input row with its per-token scale ``xs[0]`` (W8A8); without it
    the input stays in its own dtype (W8A16: no quantization error on the activation side, and
    no extra launch to quantize it). W_BITS: the e4m3 weight comes as its bytes and is widened by
    integer ops (`_widen`), not by the conversion instructions that bound the e4m3 stream.

    NORM (a row of one BLOCK_K chunk only): the input is the RMSNorm of ``x (+ residual)`` with weight
    ``nw`` (x's dtype), formed by every program from the row it loads anyway instead of by a launch
    before this one, rounded as `rms_norm` rounds its output. What that costs is each program also
    reading the residual and the norm's weight (from L2), twice the input bytes of the plain GEMV;
    the wrapper keeps it to projections whose programs hold several rows each. Program 0 stores the
    residual sum (HAS_RES) and the normalised row (STORE_X) for the kernels after this one."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    k = tl.arange(0, BLOCK_K)
    k_ok = k < K
    w = _gemv_w(rows, n_ok, k, k_ok, EVEN_N, EVEN_K)
    grid_dependency(PDL)
    xb = 1.0
    if W_BITS:
        xb = 18446744073709551616.0  # 2^64: see _widen
    if NORM:  # the whole row is one chunk (the wrapper's rule): normalised once, from registers
        xk = _normed_row(x_ptr, r_ptr, nw_ptr, ro_ptr, xo_ptr, k, k_ok, K, eps, pid == 0, HAS_RES, STORE_X, EVEN_K)
    else:
        xk = _gemv_x(x_ptr, k, k_ok, K, SILU_MUL, EVEN_K)
    acc = _widen(w, W_BITS) * (xk * xb)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = _gemv_w(rows, n_ok, k, k_ok, EVEN_N, EVEN_K)
        xk = _gemv_x(x_ptr, k, k_ok, K, SILU_MUL, EVEN_K)
        acc += _widen(w, W_BITS) * (xk * xb)[None, :]
    y = tl.sum(acc, 1)
    if W_BITS:
        y = y * 72057594037927936.0  # 2^56: with the input's 2^64, undoes _widen's 2^-120
    if X_SCALE:
        y = y * tl.load(xs_ptr)
    if W_SCALE:
        y = y * tl.load(ws_ptr + n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
