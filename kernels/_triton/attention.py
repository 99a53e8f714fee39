"""Paged attention: the pointer kernel (prefill, decode, split-KV), the TMA decode kernel, and the
merge of split-KV partials."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import grid_dependency, jit_unspecialized


@jit_unspecialized("num_seqs", "num_q_blocks", "stride_bt")
def paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    m_ptr,
    l_ptr,
    bt_ptr,
    qsl_ptr,
    seqlen_ptr,
    ks_ptr,
    vs_ptr,
    scale_log2,
    num_seqs,
    num_q_blocks,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_os,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ms,
    stride_mt,
    QPK: tl.constexpr,
    QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEG: tl.constexpr,
    IEEE: tl.constexpr,
    K_NATURAL: tl.constexpr,
    HEAD_FASTEST: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_SCALED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Unified causal paged attention (decode, prefill, chunked prefill, mixed).

    Grid ``(num_q_blocks, Hkv, NUM_SEG)``, or ``(num_q_blocks * Hkv, 1, NUM_SEG)``
    with HEAD_FASTEST. A q block is BLOCK_Q consecutive query
    tokens of one sequence times the QPK query heads that share one KV head, packed
    into BLOCK_M = BLOCK_Q * QPK_PAD rows, so each K/V tile is read once for the
    whole GQA group and the QK^T / PV products are real matrix products even for
    decode. ``num_q_blocks = T // BLOCK_Q + num_seqs`` is a bound computed from
    shapes only: each program finds its sequence by binary search over
    ``query_start_loc`` on the device, so nothing syncs with the host and the launch
    can be captured in a CUDA graph. Programs are taken heaviest-first (reverse
    order: late q blocks of a causal sequence see the most keys), which trims the
    tail of long prefills.

    Keys are streamed in TILE_N tiles gathered through the block table (a tile may
    span several pages); K_NATURAL loads a K tile as [TILE_N, D] rows (the cache's
    own order) and transposes it for the product instead of loading it as [D, N]. Tiles that
    every row of the q block may see run without the causal mask; only the last few (diagonal)
    tiles pay for it. With NUM_SEG > 1 (split-KV / flash-decoding) each program handles one contiguous slice of the key
    tiles and writes an unnormalised partial result plus its row max and sum (log2
    domain) for `reduce_segments_kernel`; that keeps the GPU full when there are few
    sequences with long contexts.

    An FP8 cache is read as it is stored and converted to the query's dtype for the products
    (exact: every e4m3 value is a bf16/fp16 value); with KV_SCALED the KV head's key scale is
    folded into the softmax scale and its value scale into the output, so dequantizing costs
    two loads per program, not a multiply per element.
    """
    grid_dependency(PDL)
    if HEAD_FASTEST:
        # The KV heads of one q block are neighbours in launch order, so programs
        # running together read whole pages (all heads of a token are adjacent in
        # the cache) instead of one 2*D-byte slice per page.
        kvh = tl.program_id(0) % NUM_KV_HEADS
        pid = num_q_blocks - 1 - tl.program_id(0) // NUM_KV_HEADS
    else:
        kvh = tl.program_id(1)
        pid = num_q_blocks - 1 - tl.program_id(0)
    seg = tl.program_id(2)

    # Sequence of this q block: last b with qsl[b] // BLOCK_Q + b <= pid.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start_blk = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if start_blk <= pid:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    q_start = tl.load(qsl_ptr + b).to(tl.int32)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
    qb = pid - (q_start // BLOCK_Q + b)
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seqlen_ptr + b).to(tl.int32)
    ctx = seq_len - q_len
    if KV_SCALED:
        scale_log2 = scale_log2 * tl.load(ks_ptr + kvh)

    offs_m = tl.arange(0, BLOCK_M)
    tok_local = qb * BLOCK_Q + offs_m // QPK_PAD
    head = kvh * QPK + offs_m % QPK_PAD
    row_ok = (tok_local < q_len) & (offs_m % QPK_PAD < QPK)
    tok = (q_start + tok_local).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_D
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # Keys [0, kv_end) are needed; keys [0, nomask_end) are visible to every row.
    kv_end = ctx + tl.minimum((qb + 1) * BLOCK_Q, q_len)
    nomask_end = ctx + qb * BLOCK_Q + 1
    num_tiles = tl.cdiv(kv_end, TILE_N)
    nomask_tiles = nomask_end // TILE_N
    if NUM_SEG > 1:
        per_seg = tl.cdiv(num_tiles, NUM_SEG)
        t_begin = seg * per_seg
        t_end = tl.minimum(t_begin + per_seg, num_tiles)
    else:
        t_begin = 0
        t_end = num_tiles

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    qk_dtype = q_ptr.dtype.element_ty

    # Full tiles below the diagonal: no masks at all.
    for t in range(t_begin, tl.minimum(t_end, nomask_tiles)):
        n = t * TILE_N + offs_n
        blk = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
        slot_k = blk * stride_kb + (n % BLOCK_SIZE) * stride_ks
        slot_v = blk * stride_vb + (n % BLOCK_SIZE) * stride_vs
        if HEAD_D == D_PAD:
            if K_NATURAL:
                k = tl.trans(tl.load(k_base + slot_k[:, None] + offs_d[None, :]))
            else:
                k = tl.load(k_base + slot_k[None, :] + offs_d[:, None])
        else:
            k = tl.load(k_base + slot_k[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, k.to(qk_dtype), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(qk_dtype))
        s = s * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HEAD_D == D_PAD:
            v = tl.load(v_base + slot_v[:, None] + offs_d[None, :])
        else:
            v = tl.load(v_base + slot_v[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(qk_dtype), v.to(qk_dtype), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(qk_dtype), v.to(qk_dtype))
        m_i = m_new

    # Diagonal / ragged tiles: causal mask and key-range mask.
    q_pos = ctx + tok_local
    for t in range(tl.maximum(t_begin, nomask_tiles), t_end):
        n = t * TILE_N + offs_n
        n_ok = n < kv_end
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot_k = blk * stride_kb + (n % BLOCK_SIZE) * stride_ks
        slot_v = blk * stride_vb + (n % BLOCK_SIZE) * stride_vs
        if K_NATURAL:
            k = tl.trans(
                tl.load(k_base + slot_k[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            )
        else:
            k = tl.load(k_base + slot_k[None, :] + offs_d[:, None], mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, k.to(qk_dtype), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(qk_dtype))
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot_v[:, None] + offs_d[None, :], mask=d_ok[None, :] & n_ok[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(qk_dtype), v.to(qk_dtype), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(qk_dtype), v.to(qk_dtype))
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if KV_SCALED:
        acc = acc * tl.load(vs_ptr + kvh)
    if NUM_SEG > 1:
        # Partial result for this key slice (fp32, unnormalised) + row stats.
        po = (
            o_ptr
            + seg.to(tl.int64) * stride_os
            + tok[:, None] * stride_ot
            + head[:, None] * stride_oh
            + offs_d[None, :]
        )
        tl.store(po, acc, mask=out_mask)
        stat = seg.to(tl.int64) * stride_ms + tok * stride_mt + head
        tl.store(m_ptr + stat, m_i, mask=row_ok)
        tl.store(l_ptr + stat, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        po = o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(po, o.to(o_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc):
    """Fold one tile of scores ``s`` (log2 domain, [M, N]) and values ``v`` ([N, D]) into the
    running max, sum and unnormalised output."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@jit_unspecialized("stride_bt")
def paged_decode_tma_kernel(
    q_ptr,
    k_desc,
    v_desc,
    o_ptr,
    m_ptr,
    l_ptr,
    bt_ptr,
    qsl_ptr,
    seqlen_ptr,
    ks_ptr,
    vs_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_os,
    stride_ms,
    stride_mt,
    stride_bt,
    QPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_SEG: tl.constexpr,
    KV_SCALED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Decode attention (one query token per sequence) reading K/V one page per step with TMA.

    Grid ``(num_seqs * Hkv,)``, the KV heads of a sequence adjacent in launch order. ``k_desc``
    / ``v_desc`` describe the per-layer cache as ``[num_blocks, block_size, Hkv * D]`` with a
    ``[1, block_size, D]`` box: one page of one KV head is one TMA load (Hopper's TMA cannot
    gather rows, but a page is a rectangle), issued asynchronously and software-pipelined by
    ``num_stages`` with no per-element address arithmetic. It reads K/V faster than
    `paged_attention_kernel` from about 3 programs per SM (docs/kernels.md); with one to three,
    a program cannot keep enough pages in flight and the pointer kernel wins. Sequences without
    a query token (CUDA-graph padding) do nothing.
    One query token per sequence is the caller's promise (``max_query_len=1``, which the
    engine's decode batches and graphs keep); a sequence with more gets NaN for all but its
    newest token. (Looping over extra tokens around the page loop was slower: the nested page loop
    pipelined worse.)

    With NUM_SEG > 1 (grid ``(num_seqs * Hkv, NUM_SEG)``) each program reads one contiguous
    run of the pages and writes an unnormalised fp32 partial plus its row max and sum for
    `reduce_segments_kernel`, exactly like the pointer kernel's split-KV: with fewer programs
    than SMs (small decode batches) every SM still gets several, each with pages in flight; there
    it matches or beats the pointer kernel's split.

    An FP8 cache: pages are loaded as FP8 (half the bytes) and converted to the query's dtype;
    KV_SCALED scales as in `paged_attention_kernel`.
    """
    grid_dependency(PDL)
    pid = tl.program_id(0)
    seg = tl.program_id(1)
    kvh = pid % NUM_KV_HEADS
    b = pid // NUM_KV_HEADS
    q_start = tl.load(qsl_ptr + b).to(tl.int32)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
    if q_len == 0:
        return
    seq_len = tl.load(seqlen_ptr + b).to(tl.int32)
    if KV_SCALED:
        scale_log2 = scale_log2 * tl.load(ks_ptr + kvh)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < QPK
    head = kvh * QPK + offs_m % QPK
    offs_d = tl.arange(0, HEAD_D)
    tok = (q_start + q_len - 1).to(tl.int64)  # the sequence's (one) query token: the newest
    q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    col = kvh * HEAD_D
    full_pages = seq_len // BLOCK_SIZE
    if NUM_SEG > 1:
        per_seg = tl.cdiv(tl.cdiv(seq_len, BLOCK_SIZE), NUM_SEG)
        p_begin = seg * per_seg
        p_end = p_begin + per_seg
    else:
        p_begin = 0
        p_end = full_pages + 1
    for pg in range(p_begin, tl.minimum(p_end, full_pages)):  # no branch in the pipelined loop
        blk = tl.load(bt_row + pg).to(tl.int32)
        k = k_desc.load([blk, 0, col]).reshape(BLOCK_SIZE, HEAD_D).to(q.dtype)
        v = v_desc.load([blk, 0, col]).reshape(BLOCK_SIZE, HEAD_D).to(q.dtype)
        m_i, l_i, acc = _online_softmax_step(tl.dot(q, tl.trans(k)) * scale_log2, v, m_i, l_i, acc)
    # The last, partly filled page (later slots hold stale data), in the segment that owns it.
    if (full_pages * BLOCK_SIZE < seq_len) & (p_begin <= full_pages) & (full_pages < p_end):
        blk = tl.load(bt_row + full_pages).to(tl.int32)
        k = k_desc.load([blk, 0, col]).reshape(BLOCK_SIZE, HEAD_D).to(q.dtype)
        v = v_desc.load([blk, 0, col]).reshape(BLOCK_SIZE, HEAD_D).to(q.dtype)
        n_ok = full_pages * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE) < seq_len
        s = tl.where(n_ok[None, :], tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, tl.where(n_ok[:, None], v, 0.0), m_i, l_i, acc)
    # A sequence with more than one query token breaks the caller's max_query_len=1 promise: its
    # earlier tokens get NaN (loud), not a silently wrong attention.
    nan = tl.full([BLOCK_M, HEAD_D], float("nan"), tl.float32)
    nan_row = tl.full([BLOCK_M], float("nan"), tl.float32)
    if KV_SCALED:
        acc = acc * tl.load(vs_ptr + kvh)
    if NUM_SEG > 1:
        # Partial for this page run (a run past the sequence's end keeps m = -inf, l = 0).
        po = o_ptr + seg.to(tl.int64) * stride_os + head[:, None] * stride_oh + offs_d[None, :]
        stat = seg.to(tl.int64) * stride_ms + head
        tl.store(po + tok * stride_ot, acc, mask=row_ok[:, None])
        tl.store(m_ptr + stat + tok * stride_mt, m_i, mask=row_ok)
        tl.store(l_ptr + stat + tok * stride_mt, l_i, mask=row_ok)
        for t in range(0, q_len - 1):
            t64 = (q_start + t).to(tl.int64)
            tl.store(po + t64 * stride_ot, nan, mask=row_ok[:, None])
            tl.store(m_ptr + stat + t64 * stride_mt, nan_row, mask=row_ok)
            tl.store(l_ptr + stat + t64 * stride_mt, nan_row, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        tl.store(
            o_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
        for t in range(0, q_len - 1):
            tl.store(
                o_ptr + (q_start + t).to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                nan.to(o_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )


@jit_unspecialized("num_seqs")
def reduce_segments_kernel(
    po_ptr,
    m_ptr,
    l_ptr,
    o_ptr,
    qsl_ptr,
    num_seqs,
    stride_pos,
    stride_pot,
    stride_poh,
    stride_ms,
    stride_mt,
    stride_ot,
    stride_oh,
    HQ: tl.constexpr,
    HEAD_D: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SEG: tl.constexpr,
    H_BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Merge NUM_SEG split-KV partials of one token (H_BLOCK heads per program).

    Each segment's sum and output are rescaled to the global row max; segments that
    saw no keys carry m = -inf, l = 0 and drop out. Tokens past
    ``query_start_loc[-1]`` (padding of a graph-sized batch) are skipped, read from
    the device so the launch needs no host value."""
    grid_dependency(PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    total = tl.load(qsl_ptr + num_seqs).to(tl.int32)
    if t >= total:
        return
    t64 = t.to(tl.int64)
    segs = tl.arange(0, NUM_SEG)
    hs = hb * H_BLOCK + tl.arange(0, H_BLOCK)
    h_ok = hs < HQ
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_D
    stat = segs[:, None] * stride_ms + t64 * stride_mt + hs[None, :]  # [S, H]
    m = tl.load(m_ptr + stat, mask=h_ok[None, :], other=float("-inf"))
    l_sum = tl.load(l_ptr + stat, mask=h_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max[None, :])  # [S, H]
    denom = tl.sum(l_sum * w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    acc = tl.zeros([H_BLOCK, D_PAD], tl.float32)
    for s in range(NUM_SEG):
        ws = tl.sum(tl.where(segs[:, None] == s, w, 0.0), 0)  # [H]
        p = tl.load(
            po_ptr + s * stride_pos + t64 * stride_pot + hs[:, None] * stride_poh + offs_d[None, :],
            mask=h_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc += p * ws[:, None]
    o = acc / denom[:, None]
    tl.store(
        o_ptr + t64 * stride_ot + hs[:, None] * stride_oh + offs_d[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=h_ok[:, None] & d_ok[None, :],
    )
