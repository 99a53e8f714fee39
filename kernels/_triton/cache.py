"""Writes into the paged KV cache and whole-block moves; the decode inputs' advance to their next slots."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import grid_dependency, jit_unspecialized


@triton.jit
def _round_e4m3(x):
    """fp32 ``x`` (|x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, still in
    fp32: the cast that follows is then exact on the GPU and in Triton's interpreter alike (whose
    own fp32 -> fp8 conversion rounds ties up and loses the carry into the exponent). Integer
    arithmetic on the bits: normal values keep 3 mantissa bits (the add carries into the
    exponent); below 2^-6 (FP8 subnormals) the significand is rounded to a multiple of 2^-9."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    ab = bits & 0x7FFFFFFF
    normal = (ab + 0x7FFFF + ((ab >> 20) & 1)) & 0xFFF00000
    e = ((ab >> 23) & 0xFF).to(tl.int32) - 127
    m = ((ab & 0x7FFFFF) | 0x800000).to(tl.int32)  # 1.m * 2^23
    sh = tl.minimum(14 - e, 30)  # value / 2^-9 = m >> sh (sh >= 21 here)
    q = m >> sh
    rem = m - (q << sh)
    half = tl.full(m.shape, 1, tl.int32) << (sh - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    sub = (q.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    r = tl.where(e < -6, sub, normal)
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(x, s_ptr, h, h_ok, KV_SCALED: tl.constexpr, KV_FP8: tl.constexpr):
    """Keys or values ``x`` [H, D] as the cache stores them: divided by their KV head's scale,
    and for an FP8 cache clamped to +-448 (a cast beyond it gives NaN) and rounded to FP8
    (`_round_e4m3`); the caller casts. Unchanged when neither applies, so a bf16 cache compiles
    exactly as before."""
    if KV_SCALED:
        x = x.to(tl.float32) / tl.load(s_ptr + h, mask=h_ok, other=1.0)[:, None]
    if KV_FP8:
        x = _round_e4m3(tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0))
    return x


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    ks_ptr,
    vs_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HKV: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HEAD_D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_SCALED: tl.constexpr = False,
    KV_FP8: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """One program per token: copy its [Hkv, D] key and value into the slot's page (quantized by
    `_quantize`: scaled per KV head, clamped for FP8).

    Padding slots (-1) return before touching memory, which is what lets the
    runner pad a batch to a CUDA-graph size without a scratch block."""
    grid_dependency(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HKV_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h[:, None] < HKV) & (d[None, :] < HEAD_D)
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
    h_ok = h < HKV
    k = _quantize(k, ks_ptr, h, h_ok, KV_SCALED, KV_FP8)
    v = _quantize(v, vs_ptr, h, h_ok, KV_SCALED, KV_FP8)
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def block_copy_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    stride_src,
    stride_dst,
    numel,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Copy one CHUNK of block ``i``: ``dst[dst_ids[i]] = src[src_ids[i]]``.

    Serves copy_blocks (both sides indexed), gather (dst packed) and scatter (src
    packed); a block of the all-layer KV tensor is one contiguous byte range, so
    this is a plain vectorised memcpy per block."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    if SRC_INDEXED:
        s = tl.load(src_ids_ptr + i).to(tl.int64)
    else:
        s = i.to(tl.int64)
    if DST_INDEXED:
        d = tl.load(dst_ids_ptr + i).to(tl.int64)
    else:
        d = i.to(tl.int64)
    offs = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < numel
    x = tl.load(src_ptr + s * stride_src + offs, mask=mask)
    tl.store(dst_ptr + d * stride_dst + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _head_rms_norm(x1, x2, w_ptr, j, j_ok, eps, HALF: tl.constexpr, dtype: tl.constexpr):
    """RMSNorm of heads held as halves ``[heads, HALF]`` each, in fp32 with the weight multiplied in
    fp32 (`rms_norm_kernel`'s rounding for a weight of the activation's dtype), rounded to ``dtype``."""
    rs = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    y1 = (x1 * rs[:, None] * w1[None, :]).to(dtype).to(tl.float32)
    y2 = (x2 * rs[:, None] * w2[None, :]).to(dtype).to(tl.float32)
    return y1, y2


@triton.jit
def _norm_rotate(base, mask, cos, sin, w_ptr, j, j_ok, eps, HALF: tl.constexpr, NORM: tl.constexpr):
    """Heads ``[heads, 2 * HALF]`` at ``base`` loaded as their two halves, RMS-normalised first when NORM
    (`_head_rms_norm`, rounded to their dtype), then rotated (rotate-half RoPE): the two halves in fp32."""
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _head_rms_norm(x1, x2, w_ptr, j, j_ok, eps, HALF, base.dtype.element_ty)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def rope_write_kv_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    qo_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    cs_ptr,
    ks_ptr,
    vs_ptr,
    qn_ptr,
    kn_ptr,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_cs,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HQ: tl.constexpr,
    QH: tl.constexpr,
    Q_PROGS: tl.constexpr,
    HKV: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_SCALED: tl.constexpr = False,
    KV_FP8: tl.constexpr = False,
    QK_NORM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Programs ``(token, b)``: for ``b < Q_PROGS`` rotate the token's query heads ``[b*QH, (b+1)*QH)``
    (written to ``qo``); the last program of the token rotates its key heads and writes them with its
    values straight into the token's cache slot.

    This is `rope_kernel` twice plus `write_kv_kernel` in one launch: at batch 1 each of
    those moves a few KiB, so three launches per layer cost more than their work. The
    rotated key never goes back to memory except in the cache, where attention reads it.
    With QK_NORM each query and key head is first RMS-normalised over its D values with the
    weights at ``qn_ptr`` / ``kn_ptr`` (Qwen3's q_norm and k_norm) and rounded to its dtype, as
    `rms_norm_kernel` would store it: two launches fewer per layer. The heads are split over
    programs because at batch 1 one program would walk all of a token's heads (and their norms) alone."""
    grid_dependency(PDL)
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + j, mask=j_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + j, mask=j_ok, other=0.0).to(tl.float32)

    if b < Q_PROGS:
        hq = b * QH + tl.arange(0, QH)
        mq = (hq[:, None] < HQ) & j_ok[None, :]
        qb = q_ptr + t * stride_qt + hq[:, None] * stride_qh + j[None, :]
        r1, r2 = _norm_rotate(qb, mq, cos, sin, qn_ptr, j, j_ok, eps, HALF, QK_NORM)
        ob = qo_ptr + t * stride_qot + hq[:, None] * stride_qoh + j[None, :]
        tl.store(ob, r1.to(qo_ptr.dtype.element_ty), mask=mq)
        tl.store(ob + HALF, r2.to(qo_ptr.dtype.element_ty), mask=mq)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            hk = tl.arange(0, HKV_PAD)
            mk = (hk[:, None] < HKV) & j_ok[None, :]
            kb = k_ptr + t * stride_kt + hk[:, None] * stride_kh + j[None, :]
            r1, r2 = _norm_rotate(kb, mk, cos, sin, kn_ptr, j, j_ok, eps, HALF, QK_NORM)
            # round to the key's dtype first: that is what the unfused path stores and then casts
            r1 = r1.to(k_ptr.dtype.element_ty)
            r2 = r2.to(k_ptr.dtype.element_ty)
            hk_ok = hk < HKV
            r1 = _quantize(r1, ks_ptr, hk, hk_ok, KV_SCALED, KV_FP8)
            r2 = _quantize(r2, ks_ptr, hk, hk_ok, KV_SCALED, KV_FP8)
            kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + hk[:, None] * stride_kch + j[None, :]
            tl.store(kc, r1.to(k_cache_ptr.dtype.element_ty), mask=mk)
            tl.store(kc + HALF, r2.to(k_cache_ptr.dtype.element_ty), mask=mk)
            vb = v_ptr + t * stride_vt + hk[:, None] * stride_vh + j[None, :]
            vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + hk[:, None] * stride_vch + j[None, :]
            v1 = _quantize(tl.load(vb, mask=mk), vs_ptr, hk, hk_ok, KV_SCALED, KV_FP8)
            v2 = _quantize(tl.load(vb + HALF, mask=mk), vs_ptr, hk, hk_ok, KV_SCALED, KV_FP8)
            tl.store(vc, v1.to(v_cache_ptr.dtype.element_ty), mask=mk)
            tl.store(vc + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mk)


@jit_unspecialized("B", "stride_bt")
def advance_decode_kernel(
    tok_ptr,
    ids_ptr,
    pos_ptr,
    slots_ptr,
    lens_ptr,
    bt_ptr,
    stride_bt,
    B,
    block_size,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One decode step's inputs turned into the next one's, in place, for all ``B`` rows in one program:
    the ids become the drawn tokens, positions and sequence lengths grow by one, and each slot is the
    new position's in the row's block table. Replaces a dozen tiny torch launches between two steps of
    a decode round."""
    grid_dependency(PDL)
    r = tl.arange(0, BLOCK)
    ok = r < B
    tok = tl.load(tok_ptr + r, mask=ok, other=0)
    tl.store(ids_ptr + r, tok.to(ids_ptr.dtype.element_ty), mask=ok)
    p = tl.load(pos_ptr + r, mask=ok, other=0) + 1
    tl.store(pos_ptr + r, p, mask=ok)
    n = tl.load(lens_ptr + r, mask=ok, other=0)
    tl.store(lens_ptr + r, n + 1, mask=ok)
    blk = tl.load(bt_ptr + r.to(tl.int64) * stride_bt + p // block_size, mask=ok, other=0)
    tl.store(slots_ptr + r, (blk * block_size + p % block_size).to(slots_ptr.dtype.element_ty), mask=ok)
