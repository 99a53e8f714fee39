"""Triton kernel bodies of `kvmesh.kernels` (launched only through `kvmesh.kernels.ops`).

This file is imported twice by `ops`: once as a normal module whose kernels are
compiled with ``triton.jit`` (CUDA), and once, lazily, with the global
``_FORCE_INTERPRET`` set, so that every kernel is a Triton *interpreter* function
that runs on CPU tensors. Triton otherwise decides interpreter-or-compiler once, at
decoration time, from ``TRITON_INTERPRET``; loading the module twice makes the
choice per call instead, so tests can run the interpreter in-process no matter who
imported triton first, and a test that sets ``TRITON_INTERPRET`` does not turn the
engine's CPU path into the (very slow) interpreter for the rest of the session.

Index arithmetic that can exceed 2**31 (block index times block stride of the
engine's all-layer KV tensor) is done in int64.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def _fix_interpreter() -> None:
    """Work around three Triton 3.6 interpreter gaps (interpreter only; idempotent).

    1. Scalars are 1-element arrays converted with ``int(array)``, which numpy
       >= 2.4 refuses, so ``range(scalar_tensor)`` fails: re-patch ``__index__``.
    2. ``tl.dot`` on bfloat16 runs ``np.matmul`` on the raw uint16 bit patterns
       (numpy has no bf16): widen bf16 operands to fp32 first, which is exact and
       is what the tensor cores do before accumulating in fp32.
    3. Triton's own helpers written in Triton (``tl.cdiv``, ``tl.sum``, ``tl.cumsum``
       and their combine functions) are interpreter functions only if triton was
       imported with ``TRITON_INTERPRET=1`` already set; imported before (by
       transformers, say), they are compiler objects and an interpreted kernel that
       calls one fails ("Cannot call @triton.jit'd outside of the scope of a
       kernel"). While an interpreted kernel runs, those module attributes are
       swapped for interpreter functions, and put back after it (the compiled path
       in the same process keeps seeing the originals).

    Known remaining difference: the interpreter rounds fp32 -> bf16 casts toward
    zero where the GPU rounds to nearest even, so interpreted bf16 outputs may be 1
    ulp off the GPU's; the tests' bf16 tolerances allow for that."""
    import numpy as np
    from triton.runtime import interpreter as interp

    orig = interp._patch_lang_tensor
    if not getattr(orig, "_kvmesh_patched", False):
        try:
            int(np.zeros(1, dtype=np.int32))
        except TypeError:
            def patched(tensor, scope):
                orig(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

            patched._kvmesh_patched = True
            interp._patch_lang_tensor = patched

    builder = interp.InterpreterBuilder
    orig_dot = builder.create_dot
    if not getattr(orig_dot, "_kvmesh_patched", False):
        def widen(h):
            if h.dtype == tl.bfloat16:
                data = interp._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interp.TensorHandle(data, tl.float32)
            return h

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

        create_dot._kvmesh_patched = True
        builder.create_dot = create_dot

    orig_patch_lang = interp._patch_lang
    if not getattr(orig_patch_lang, "_kvmesh_patched", False):
        from triton.runtime.jit import JITFunction

        wrapped = {}

        def patch_lang(fn):
            scope = orig_patch_lang(fn)
            for obj in (tl, tl.standard, tl.math, tl.core.tensor):
                for name, value in list(vars(obj).items()):
                    if isinstance(value, JITFunction):  # keyed by id: hashing one walks its globals
                        if id(value) not in wrapped:
                            wrapped[id(value)] = (value, interp.InterpretedFunction(value.fn))
                        scope.set_attr(obj, name, wrapped[id(value)][1])
            return scope

        patch_lang._kvmesh_patched = True
        interp._patch_lang = patch_lang


if globals().get("_FORCE_INTERPRET", False):
    from triton.runtime.interpreter import InterpretedFunction as _jit

    _fix_interpreter()

    def _jit_unspecialized(*names):
        return _jit
else:
    _jit = triton.jit

    def _jit_unspecialized(*names):
        """``triton.jit`` that does not specialise the named int arguments on their value (1, or
        divisible by 16). They change with every batch (sequence count, block-table width), and
        each new specialisation is a compile of seconds in the middle of serving; what the kernel
        would gain from knowing them is nothing measurable (loop bounds, one row stride)."""
        return lambda fn: triton.jit(fn, do_not_specialize=names)


@_jit
def _grid_dependency(PDL: tl.constexpr):
    """Programmatic dependent launch (Hopper and newer; ``ops`` passes PDL with ``launch_pdl``).

    A kernel launched that way may start while the one before it in the stream is still
    finishing; it first waits until that kernel has completed and its writes are visible
    (so no read or write of this kernel can race with it), then lets the next kernel's
    programs launch in turn. What this saves is the gap between two dependent kernels:
    launch latency and program setup overlap the previous kernel's tail. At batch 1 a
    decode step is ~300 short kernels, so that gap is a real part of the step. Every
    kernel calls this before touching memory; with PDL off it is nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# --------------------------------------------------------------------------- KV write
@_jit
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    HKV: tl.constexpr, HKV_PAD: tl.constexpr, HEAD_D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per token: copy its [Hkv, D] key and value into the slot's page.

    Padding slots (-1) return before touching memory, which is what lets the
    runner pad a batch to a CUDA-graph size without a scratch block."""
    _grid_dependency(PDL)
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
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- attention
@_jit_unspecialized("num_seqs", "num_q_blocks", "stride_bt")
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr,
    bt_ptr, qsl_ptr, seqlen_ptr,
    scale_log2, num_seqs, num_q_blocks,
    stride_qt, stride_qh,
    stride_ot, stride_oh, stride_os,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ms, stride_mt,
    QPK: tl.constexpr, QPK_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SEG: tl.constexpr, IEEE: tl.constexpr, K_NATURAL: tl.constexpr,
    HEAD_FASTEST: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
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
    own order) and transposes it for the product instead of loading it as [D, N]. Tiles that every row of the q block may see run without the
    causal mask; only the last few (diagonal) tiles pay for it. With NUM_SEG > 1
    (split-KV / flash-decoding) each program handles one contiguous slice of the key
    tiles and writes an unnormalised partial result plus its row max and sum (log2
    domain) for `reduce_segments_kernel`; that keeps the GPU full when there are few
    sequences with long contexts.
    """
    _grid_dependency(PDL)
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

    offs_m = tl.arange(0, BLOCK_M)
    tok_local = qb * BLOCK_Q + offs_m // QPK_PAD
    head = kvh * QPK + offs_m % QPK_PAD
    row_ok = (tok_local < q_len) & (offs_m % QPK_PAD < QPK)
    tok = (q_start + tok_local).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_D
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

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
            k = tl.trans(tl.load(k_base + slot_k[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                                 other=0.0))
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
    if NUM_SEG > 1:
        # Partial result for this key slice (fp32, unnormalised) + row stats.
        po = o_ptr + seg.to(tl.int64) * stride_os + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(po, acc, mask=out_mask)
        stat = seg.to(tl.int64) * stride_ms + tok * stride_mt + head
        tl.store(m_ptr + stat, m_i, mask=row_ok)
        tl.store(l_ptr + stat, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        po = o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(po, o.to(o_ptr.dtype.element_ty), mask=out_mask)


@_jit
def _online_softmax_step(s, v, m_i, l_i, acc):
    """Fold one tile of scores ``s`` (log2 domain, [M, N]) and values ``v`` ([N, D]) into the
    running max, sum and unnormalised output."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@_jit_unspecialized("stride_bt")
def paged_decode_tma_kernel(
    q_ptr, k_desc, v_desc, o_ptr, m_ptr, l_ptr,
    bt_ptr, qsl_ptr, seqlen_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_ms, stride_mt, stride_bt,
    QPK: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, NUM_SEG: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Decode attention (one query token per sequence) reading K/V one page per step with TMA.

    Grid ``(num_seqs * Hkv,)``, the KV heads of a sequence adjacent in launch order. ``k_desc``
    / ``v_desc`` describe the per-layer cache as ``[num_blocks, block_size, Hkv * D]`` with a
    ``[1, block_size, D]`` box: one page of one KV head is one TMA load (Hopper's TMA cannot
    gather rows, but a page is a rectangle), issued asynchronously and software-pipelined by
    ``num_stages`` with no per-element address arithmetic. On the H200 this read 2-5% more
    bytes per second than `paged_attention_kernel` when there are at least ~3 programs per SM
    (docs/kernels.md); with one to three, a program cannot keep enough pages in flight and
    the pointer kernel wins. Sequences without a query token (CUDA-graph padding) do nothing.
    One query token per sequence is the caller's promise (``max_query_len=1``, which the
    engine's decode batches and graphs keep); a sequence with more gets NaN for all but its
    newest token. (A version looping over extra tokens around the page loop was clearly slower
    at 128 x 576 and 128 x 4,096: the nested page loop pipelined worse.)

    With NUM_SEG > 1 (grid ``(num_seqs * Hkv, NUM_SEG)``) each program reads one contiguous
    run of the pages and writes an unnormalised fp32 partial plus its row max and sum for
    `reduce_segments_kernel`, exactly like the pointer kernel's split-KV: with fewer programs
    than SMs (small decode batches) every SM still gets several, each with pages in flight; there
    it matched or beat the pointer kernel's split (12% at 8 x 576).
    """
    _grid_dependency(PDL)
    pid = tl.program_id(0)
    seg = tl.program_id(1)
    kvh = pid % NUM_KV_HEADS
    b = pid // NUM_KV_HEADS
    q_start = tl.load(qsl_ptr + b).to(tl.int32)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
    if q_len == 0:
        return
    seq_len = tl.load(seqlen_ptr + b).to(tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < QPK
    head = kvh * QPK + offs_m % QPK
    offs_d = tl.arange(0, HEAD_D)
    tok = (q_start + q_len - 1).to(tl.int64)  # the sequence's (one) query token: the newest
    q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
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
        k = k_desc.load([blk, 0, col]).reshape(BLOCK_SIZE, HEAD_D)
        v = v_desc.load([blk, 0, col]).reshape(BLOCK_SIZE, HEAD_D)
        m_i, l_i, acc = _online_softmax_step(tl.dot(q, tl.trans(k)) * scale_log2, v, m_i, l_i, acc)
    # The last, partly filled page (later slots hold stale data), in the segment that owns it.
    if (full_pages * BLOCK_SIZE < seq_len) & (p_begin <= full_pages) & (full_pages < p_end):
        blk = tl.load(bt_row + full_pages).to(tl.int32)
        k = k_desc.load([blk, 0, col]).reshape(BLOCK_SIZE, HEAD_D)
        v = v_desc.load([blk, 0, col]).reshape(BLOCK_SIZE, HEAD_D)
        n_ok = full_pages * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE) < seq_len
        s = tl.where(n_ok[None, :], tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, tl.where(n_ok[:, None], v, 0.0), m_i, l_i, acc)
    # A sequence with more than one query token breaks the caller's max_query_len=1 promise: its
    # earlier tokens get NaN (loud), not a silently wrong attention.
    nan = tl.full([BLOCK_M, HEAD_D], float("nan"), tl.float32)
    nan_row = tl.full([BLOCK_M], float("nan"), tl.float32)
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
        tl.store(o_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        for t in range(0, q_len - 1):
            tl.store(o_ptr + (q_start + t).to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     nan.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@_jit_unspecialized("num_seqs")
def reduce_segments_kernel(
    po_ptr, m_ptr, l_ptr, o_ptr, qsl_ptr, num_seqs,
    stride_pos, stride_pot, stride_poh,
    stride_ms, stride_mt,
    stride_ot, stride_oh,
    HQ: tl.constexpr, HEAD_D: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SEG: tl.constexpr, H_BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Merge NUM_SEG split-KV partials of one token (H_BLOCK heads per program).

    Each segment's sum and output are rescaled to the global row max; segments that
    saw no keys carry m = -inf, l = 0 and drop out. Tokens past
    ``query_start_loc[-1]`` (padding of a graph-sized batch) are skipped, read from
    the device so the launch needs no host value."""
    _grid_dependency(PDL)
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
    l = tl.load(l_ptr + stat, mask=h_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max[None, :])  # [S, H]
    denom = tl.sum(l * w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    acc = tl.zeros([H_BLOCK, D_PAD], tl.float32)
    for s in range(NUM_SEG):
        ws = tl.sum(tl.where(segs[:, None] == s, w, 0.0), 0)  # [H]
        p = tl.load(po_ptr + s * stride_pos + t64 * stride_pot + hs[:, None] * stride_poh + offs_d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        acc += p * ws[:, None]
    o = acc / denom[:, None]
    tl.store(o_ptr + t64 * stride_ot + hs[:, None] * stride_oh + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------- block moves
@_jit
def block_copy_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
    stride_src, stride_dst, numel,
    SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr, CHUNK: tl.constexpr,
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


# --------------------------------------------------------------------------- fused elementwise
@_jit
def rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr,
    stride_x, stride_r, stride_y, stride_ro, eps, hidden,
    HAS_RES: tl.constexpr, W_SAME: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One row per program: (x + residual) in x's dtype, then RMS in fp32.

    Rounding follows the reference exactly: the residual sum is rounded to x's
    dtype before it is normalised (that rounded sum is also what is returned), and
    the weight multiply happens in fp32 when weight and x share a dtype, else after
    rounding, in the promoted dtype."""
    _grid_dependency(PDL)
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


@_jit
def rope_kernel(
    pos_ptr, x_ptr, y_ptr, cs_ptr,
    stride_xt, stride_xh, stride_yt, stride_yh, stride_cs, num_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, H_BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Rotate-half RoPE of one token's heads; cos/sin read once per token, fp32 math."""
    _grid_dependency(PDL)
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


@_jit
def _silu_mul(g, u, like_ptr):
    """``silu(g) * u`` in ``like_ptr``'s element type, rounded as torch rounds it: silu rounded to
    that type first, the product in fp32 (`silu_and_mul` and the GEMV's fused input share it)."""
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(like_ptr.dtype.element_ty).to(tl.float32)
    return (s * u.to(tl.float32)).to(like_ptr.dtype.element_ty)


@_jit
def silu_and_mul_kernel(
    x_ptr, y_ptr, stride_x, stride_y, d,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``silu(gate) * up``; silu rounded to the dtype before the multiply, as torch does."""
    _grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0)
    tl.store(y_ptr + row * stride_y + offs, _silu_mul(g, u, y_ptr), mask=mask)


# --------------------------------------------------------------------------- fused decode helpers
@_jit
def rope_write_kv_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, qo_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HQ: tl.constexpr, HQ_PAD: tl.constexpr, HKV: tl.constexpr, HKV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per token: rotate its query heads (written to ``qo``), rotate its key heads
    and write them with its values straight into the token's cache slot.

    This is `rope_kernel` twice plus `write_kv_kernel` in one launch: at batch 1 each of
    those moves a few KiB, so three launches per layer cost more than their work. The
    rotated key never goes back to memory except in the cache, where attention reads it."""
    _grid_dependency(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + j, mask=j_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + j, mask=j_ok, other=0.0).to(tl.float32)

    hq = tl.arange(0, HQ_PAD)
    mq = (hq[:, None] < HQ) & j_ok[None, :]
    qb = q_ptr + t * stride_qt + hq[:, None] * stride_qh + j[None, :]
    q1 = tl.load(qb, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(qb + HALF, mask=mq, other=0.0).to(tl.float32)
    ob = qo_ptr + t * stride_qot + hq[:, None] * stride_qoh + j[None, :]
    tl.store(ob, (q1 * cos[None, :] - q2 * sin[None, :]).to(qo_ptr.dtype.element_ty), mask=mq)
    tl.store(ob + HALF, (q2 * cos[None, :] + q1 * sin[None, :]).to(qo_ptr.dtype.element_ty), mask=mq)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        hk = tl.arange(0, HKV_PAD)
        mk = (hk[:, None] < HKV) & j_ok[None, :]
        kb = k_ptr + t * stride_kt + hk[:, None] * stride_kh + j[None, :]
        k1 = tl.load(kb, mask=mk, other=0.0).to(tl.float32)
        k2 = tl.load(kb + HALF, mask=mk, other=0.0).to(tl.float32)
        # round to the key's dtype first: that is what the unfused path stores and then casts
        r1 = (k1 * cos[None, :] - k2 * sin[None, :]).to(k_ptr.dtype.element_ty)
        r2 = (k2 * cos[None, :] + k1 * sin[None, :]).to(k_ptr.dtype.element_ty)
        kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + hk[:, None] * stride_kch + j[None, :]
        tl.store(kc, r1.to(k_cache_ptr.dtype.element_ty), mask=mk)
        tl.store(kc + HALF, r2.to(k_cache_ptr.dtype.element_ty), mask=mk)
        vb = v_ptr + t * stride_vt + hk[:, None] * stride_vh + j[None, :]
        vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + hk[:, None] * stride_vch + j[None, :]
        tl.store(vc, tl.load(vb, mask=mk).to(v_cache_ptr.dtype.element_ty), mask=mk)
        tl.store(vc + HALF, tl.load(vb + HALF, mask=mk).to(v_cache_ptr.dtype.element_ty), mask=mk)


@_jit
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


@_jit
def _gemv_x(x_ptr, k, k_ok, K, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
    """The input chunk at ``k`` in fp32; with SILU_MUL ``silu(gate) * up`` rounded like `silu_and_mul`."""
    if SILU_MUL:
        if EVEN_K:
            g = tl.load(x_ptr + k)
            u = tl.load(x_ptr + K + k)
        else:
            g = tl.load(x_ptr + k, mask=k_ok, other=0.0)
            u = tl.load(x_ptr + K + k, mask=k_ok, other=0.0)
        xf = _silu_mul(g, u, x_ptr).to(tl.float32)
    else:
        if EVEN_K:
            xf = tl.load(x_ptr + k).to(tl.float32)
        else:
            xf = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
    return xf


@_jit
def gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
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
    before `_grid_dependency`: weights do not depend on the kernel before this one, so
    under programmatic dependent launch their stream starts while that kernel finishes."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    k = tl.arange(0, BLOCK_K)
    k_ok = k < K
    w = _gemv_w(rows, n_ok, k, k_ok, EVEN_N, EVEN_K)
    _grid_dependency(PDL)
    acc = w.to(tl.float32) * _gemv_x(x_ptr, k, k_ok, K, SILU_MUL, EVEN_K)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = _gemv_w(rows, n_ok, k, k_ok, EVEN_N, EVEN_K)
        acc += w.to(tl.float32) * _gemv_x(x_ptr, k, k_ok, K, SILU_MUL, EVEN_K)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


# --------------------------------------------------------------------------- sampling
@_jit
def _tempered(base, idx, end, t):
    """``x / T`` at ``idx`` in float32 (IEEE quotient, as torch's); -inf from ``end`` on."""
    return tl.math.div_rn(tl.load(base + idx, mask=idx < end, other=float("-inf")).to(tl.float32), t)


@_jit_unspecialized("V", "CHUNK")
def softmax_stats_kernel(x_ptr, temp_ptr, m_ptr, s_ptr, stride_x, V, CHUNK, BLOCK: tl.constexpr):
    """First half of `softmax_temperature`: the max of ``x / T`` over one CHUNK of one row and
    the sum of ``exp(x / T - max)`` there, per lane online, lanes merged once."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    base = x_ptr + row.to(tl.int64) * stride_x
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    acc = tl.zeros((BLOCK,), tl.float32)
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    for off in range(start, end, BLOCK):
        z = _tempered(base, off + tl.arange(0, BLOCK), end, t)
        m_new = tl.maximum(m, z)
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # a lane that saw only -inf: 0 (no inf - inf)
        acc = acc * tl.exp(m - ref) + tl.exp(z - ref)
        m = m_new
    mx = tl.max(m, 0)
    total = tl.sum(acc * tl.exp(m - tl.where(mx > float("-inf"), mx, 0.0)), 0)
    out = row * tl.num_programs(1) + c
    tl.store(m_ptr + out, mx)
    tl.store(s_ptr + out, total)


@_jit_unspecialized("V", "CHUNK")
def softmax_write_kernel(x_ptr, temp_ptr, m_ptr, s_ptr, p_ptr, stride_x, stride_p, V, CHUNK,
                         CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Second half of `softmax_temperature`: the row's max and sum from its chunks' partials,
    then ``exp(x / T - max) / sum`` over one CHUNK."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    n = tl.num_programs(1)
    t = tl.load(temp_ptr + row)
    j = tl.arange(0, CHUNKS_PAD)
    ms = tl.load(m_ptr + row * n + j, mask=j < n, other=float("-inf"))
    ss = tl.load(s_ptr + row * n + j, mask=j < n, other=0.0)
    mx = tl.max(ms, 0)
    mx = tl.where(mx > float("-inf"), mx, 0.0)
    total = tl.sum(ss * tl.exp(ms - mx), 0)
    base = x_ptr + row.to(tl.int64) * stride_x
    pbase = p_ptr + row.to(tl.int64) * stride_p
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        z = _tempered(base, idx, end, t)
        tl.store(pbase + idx, tl.math.div_rn(tl.exp(z - mx), total), mask=idx < end)


@_jit_unspecialized("V", "CHUNK")
def top_p_hist_kernel(probs_ptr, prefix_ptr, hist_ptr, top_p_ptr, stride_row, V, CHUNK,
                      SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """One radix pass of `top_p_threshold` over one CHUNK of one row: the probability mass of
    each BITS-bit digit (bits SHIFT.. of the float32 bit pattern) among the tokens whose higher
    bits equal the row's prefix so far (every token in the FIRST pass), added into the row's
    histogram.

    Tokens below ``floor = (1 - top_p) / (2 V)`` are left out: together they hold at most half of
    ``1 - top_p``, so the tokens at or above the floor hold more than ``top_p``, the threshold is
    at or above the floor, and every mass the select compares (digits at or above the
    threshold's; a digit straddling the floor still counts more than ``top_p``) is unchanged.
    A trained LM's row has almost all of its vocabulary far below it, and those tokens all fell
    into a few digits whose atomics serialised (the first pass took longer on such rows than
    on flat ones). Rows with ``top_p`` within 1e-4 of 1 count every token (normalisation
    rounding could otherwise exceed the margin); rows with ``top_p >= 1`` (no top-p) do nothing.

    Masses are fixed-point integers, ``p * 2**62`` (exact for every p above 2**-39; smaller
    ones lose less than 2**-62 each), summed with int64 atomics: integer addition does not
    depend on order, so every program of a row can add into one histogram and the result is
    the same bit for bit on every run (a seeded request's draw must not change with timing),
    where float atomics would reorder the sums. A row's total stays below 2**63."""
    NB: tl.constexpr = 1 << BITS
    row = tl.program_id(0)
    c = tl.program_id(1)
    tp = tl.load(top_p_ptr + row)
    if tp >= 1.0:
        return
    floor = tl.where(tp <= 0.9999, 0.5 * (1.0 - tp) / V, 0.0)
    if FIRST:
        prefix = 0
    else:
        prefix = tl.load(prefix_ptr + row)
    base = probs_ptr + row.to(tl.int64) * stride_row
    hist = hist_ptr + row.to(tl.int64) * NB
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        ok = idx < end
        p = tl.load(base + idx, mask=ok, other=0.0)
        ok = ok & (p >= floor)
        key = p.to(tl.int32, bitcast=True)
        if not FIRST:
            ok = ok & ((key >> (SHIFT + BITS)) == prefix)
        mass = (p * 4611686018427387904.0).to(tl.int64)  # 2**62
        tl.atomic_add(hist + ((key >> SHIFT) & (NB - 1)), mass, mask=ok & (mass > 0), sem="relaxed")


@_jit
def top_p_select_kernel(hist_ptr, top_p_ptr, prefix_ptr, above_ptr, out_ptr,
                        BITS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr):
    """After a `top_p_hist_kernel` pass, one program per row: the largest digit at which the
    mass at or above it (plus the mass above the prefix) exceeds ``top_p`` joins the prefix
    (the last digit when none does, as the mass can fall short of 1 by rounding); the mass of
    the larger digits joins ``above``. After the LAST pass the prefix is the threshold's bit
    pattern (0 where ``top_p >= 1``)."""
    NB: tl.constexpr = 1 << BITS
    row = tl.program_id(0)
    d = tl.arange(0, NB)
    h = tl.load(hist_ptr + row.to(tl.int64) * NB + NB - 1 - d)  # largest digit first
    tp = tl.load(top_p_ptr + row)
    limit = (tl.minimum(tp, 1.0) * 4611686018427387904.0).to(tl.int64)
    if FIRST:
        above = tl.zeros((), dtype=tl.int64)
        prefix = 0
    else:
        above = tl.load(above_ptr + row)
        prefix = tl.load(prefix_ptr + row)
    mass_ge = above + tl.cumsum(h, 0)
    j = tl.minimum(tl.sum((mass_ge <= limit).to(tl.int32), 0), NB - 1)
    above = tl.sum(tl.where(d == j, mass_ge - h, 0), 0)
    prefix = (prefix << BITS) | (NB - 1 - j)
    tl.store(prefix_ptr + row, prefix)
    tl.store(above_ptr + row, above)
    if LAST:
        tl.store(out_ptr + row, tl.where(tp < 1.0, prefix.to(tl.float32, bitcast=True), 0.0))


@_jit
def _exp_noise(w):
    """``Exp(1)`` noise from a 32-bit Philox word (`race_noise_reference` defines it): ``u`` =
    (top 23 bits + 1/2) / 2**23 is uniform in (0, 1), exact in float32 (no zero or infinite
    noise), and the noise is ``-log(u)``; where that is small (``1 - u`` below 1/64, also exact)
    by its series in ``1 - u``, since a fast ``log`` near 1 loses the relative precision that
    decides how often a rare token wins the race."""
    k = (w >> 9).to(tl.float32)
    u = (k + 0.5) * 1.1920928955078125e-07
    v = (8388607.5 - k) * 1.1920928955078125e-07
    series = v * (1.0 + v * (0.5 + v * (0.3333333432674408 + v * 0.25)))
    return tl.where(v < 0.015625, series, -tl.log(u))


@_jit
def _noise_group(key, ctr, off, LANES: tl.constexpr):
    """The noise of tokens ``off + j * LANES + [0, LANES)``, j = 0..3 (``off`` a multiple of
    4 * LANES): one Philox-4x32 block per lane, its four words the four sub-blocks. The Philox
    counter is the lane's index in the row (low word) and the row's draw counter ``ctr`` (high
    word), the key the row's seed, so a token's noise depends on nothing but (seed, draw, token)."""
    g = (off // (4 * LANES)) * LANES + tl.arange(0, LANES)
    w0, w1, w2, w3 = tl.randint4x(key, (ctr << 32) | g.to(tl.int64))
    return _exp_noise(w0), _exp_noise(w1), _exp_noise(w2), _exp_noise(w3)


@_jit
def _race_step(pbase, idx, e, end, lo, best, best_i):
    """One tile of the race: ``p / E`` where ``p >= lo`` replaces a lane's best when strictly larger."""
    ok = idx < end
    p = tl.load(pbase + idx, mask=ok, other=0.0)
    r = tl.where(ok & (p >= lo), tl.math.div_rn(p, e), -1.0)
    take = r > best
    return tl.where(take, r, best), tl.where(take, idx, best_i)


@_jit_unspecialized("V", "CHUNK")
def race_argmax_kernel(probs_ptr, noise_ptr, seed_ptr, lo_ptr, val_ptr, idx_ptr, stride_p, stride_n, V, CHUNK,
                       BLOCK: tl.constexpr, SEEDED: tl.constexpr):
    """`race_argmax` over one CHUNK of one row: the largest ``p / E`` among the tokens with
    ``p >= lo`` and its first index, written as this (row, chunk)'s partial. Each lane keeps its
    own best (strictly larger replaces, so the first index wins among equals) and the lanes
    meet once at the end. The quotient is IEEE-rounded (``div_rn``), as torch's, so the
    kernel and the reference rank the same values. SEEDED: ``E`` is not read but made here from
    the row's (seed, draw counter) at ``seed_ptr`` (`_noise_group`, BLOCK = 4 lanes' groups)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    lo = tl.load(lo_ptr + row)
    pbase = probs_ptr + row.to(tl.int64) * stride_p
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    if SEEDED:
        LANES: tl.constexpr = BLOCK // 4
        key = tl.load(seed_ptr + 2 * row)
        ctr = tl.load(seed_ptr + 2 * row + 1)
        best = tl.full((LANES,), -1.0, dtype=tl.float32)
        best_i = tl.zeros((LANES,), dtype=tl.int32)
        for off in range(start, end, BLOCK):
            e0, e1, e2, e3 = _noise_group(key, ctr, off, LANES)
            lane = off + tl.arange(0, LANES)
            best, best_i = _race_step(pbase, lane, e0, end, lo, best, best_i)
            best, best_i = _race_step(pbase, lane + LANES, e1, end, lo, best, best_i)
            best, best_i = _race_step(pbase, lane + 2 * LANES, e2, end, lo, best, best_i)
            best, best_i = _race_step(pbase, lane + 3 * LANES, e3, end, lo, best, best_i)
    else:
        nbase = noise_ptr + row.to(tl.int64) * stride_n
        best = tl.full((BLOCK,), -1.0, dtype=tl.float32)
        best_i = tl.zeros((BLOCK,), dtype=tl.int32)
        for off in range(start, end, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            e = tl.load(nbase + idx, mask=idx < end, other=1.0)
            best, best_i = _race_step(pbase, idx, e, end, lo, best, best_i)
    m = tl.max(best, 0)
    i = tl.min(tl.where(best == m, best_i, 2147483647), 0)
    out = row * tl.num_programs(1) + c
    tl.store(val_ptr + out, m)
    tl.store(idx_ptr + out, i)


@_jit_unspecialized("V", "CHUNK")
def race_noise_kernel(seed_ptr, noise_ptr, stride_n, V, CHUNK, BLOCK: tl.constexpr):
    """The noise `race_argmax_kernel` makes with SEEDED, written out (`race_noise`): what the
    tests compare with the reference, and what the seeded race must rank the same as."""
    LANES: tl.constexpr = BLOCK // 4
    row = tl.program_id(0)
    c = tl.program_id(1)
    key = tl.load(seed_ptr + 2 * row)
    ctr = tl.load(seed_ptr + 2 * row + 1)
    nbase = noise_ptr + row.to(tl.int64) * stride_n
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    for off in range(start, end, BLOCK):
        e0, e1, e2, e3 = _noise_group(key, ctr, off, LANES)
        lane = off + tl.arange(0, LANES)
        tl.store(nbase + lane, e0, mask=lane < end)
        tl.store(nbase + lane + LANES, e1, mask=lane + LANES < end)
        tl.store(nbase + lane + 2 * LANES, e2, mask=lane + 2 * LANES < end)
        tl.store(nbase + lane + 3 * LANES, e3, mask=lane + 3 * LANES < end)
