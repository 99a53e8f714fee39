"""Row-wise kernels: RMSNorm (with the residual add), rotary embedding, SiLU-and-multiply."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import grid_dependency


@triton.jit
def rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    y_ptr,
    ro_ptr,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    eps,
    hidden,
    HAS_RES: tl.constexpr,
    W_SAME: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One row per program: (x + residual) in x's dtype, then RMS in fp32.

    Rounding follows the reference exactly: the residual sum is rounded to x's
    dtype before it is normalised (that rounded sum is also what is returned), and
    the weight multiply happens in fp32 when weight and x share a dtype, else after
    rounding, in the promoted dtype."""
    grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(ro_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / hidden
    y = xf * tl.math.rsqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if W_SAME:
        y = y * w.to(tl.float32)
    else:
        y = y.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty) * w.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(
    pos_ptr,
    x_ptr,
    y_ptr,
    cs_ptr,
    stride_xt,
    stride_xh,
    stride_yt,
    stride_yh,
    stride_cs,
    num_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    H_BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Rotate-half RoPE of one token's heads; cos/sin read once per token, fp32 math."""
    grid_dependency(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + j, mask=j_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    h = hb * H_BLOCK + tl.arange(0, H_BLOCK)
    mask = (h[:, None] < num_heads) & j_ok[None, :]
    base = x_ptr + t * stride_xt + h[:, None] * stride_xh + j[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    ob = y_ptr + t * stride_yt + h[:, None] * stride_yh + j[None, :]
    tl.store(ob, o1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(ob + HALF, o2.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul(g, u, like_ptr):
    """``silu(g) * u`` in ``like_ptr``'s element type, rounded as torch rounds it: silu rounded to
    that type first, the product in fp32 (`silu_and_mul` and the GEMV's fused input share it)."""
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(like_ptr.dtype.element_ty).to(tl.float32)
    return (s * u.to(tl.float32)).to(like_ptr.dtype.element_ty)


@triton.jit
def silu_and_mul_kernel(
    x_ptr,
    y_ptr,
    stride_x,
    stride_y,
    d,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``silu(gate) * up``; silu rounded to the dtype before the multiply, as torch does."""
    grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0)
    tl.store(y_ptr + row * stride_y + offs, silu_mul(g, u, y_ptr), mask=mask)
