"""The fused mixture-of-experts GEMM: one grouped GEMM over the experts of a routed batch."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import grid_dependency, jit_unspecialized
from .elementwise import silu_mul


@jit_unspecialized("num_pairs")  # T * k changes with every batch
def fused_moe_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    A_DIV: tl.constexpr,
    GATE_UP: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``C[pair] = A[pair // A_DIV] @ W[expert(pair)].T`` over (token, slot) pairs sorted by expert.

    ``sorted_ids`` lists the pairs grouped by expert, each expert's group padded to a multiple of
    BLOCK_M with the sentinel ``num_pairs``, so every BLOCK_M-row tile belongs to one expert
    (``expert_ids[tile]``) and is one ``[BLOCK_M, K] x [K, BLOCK_N]`` product against that
    expert's weights: a grouped GEMM, the weights of an expert read once per tile. Tiles past
    ``num_padded`` (the grid is sized for the worst case, so the launch needs no host sync and a
    CUDA graph can hold it) exit at once.

    GATE_UP: W is ``[E, 2N, K]`` (gate rows, then up rows): two accumulators, and the tile
    stores ``silu(gate) * up`` (each rounded to C's dtype first, as the reference rounds its
    matmul output), the expert MLP's activation. Otherwise C is the down projection, times the
    pair's routing weight when MUL_WEIGHT (rounded like the reference: product of the rounded
    values). Row ``pair`` of C is written, so the caller sums the k slots of each token."""
    grid_dependency(PDL)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    valid = ids < num_pairs
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    rows = (ids // A_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + e * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        if GATE_UP:
            wu = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc_up = tl.dot(a, wu, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, wu, acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dt = c_ptr.dtype.element_ty
    if GATE_UP:
        out = silu_mul(acc.to(dt), acc_up.to(dt), c_ptr)
    elif MUL_WEIGHT:
        wt = tl.load(topk_w_ptr + ids, mask=valid, other=0.0).to(tl.float32)
        out = (acc.to(dt).to(tl.float32) * wt[:, None]).to(dt)
    else:
        out = acc.to(dt)
    c_ptrs = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out, mask=valid[:, None] & n_ok[None, :])


@jit_unspecialized("num_pairs", "cap")
def moe_align_kernel(
    ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    base_ptr,
    num_pairs,
    cap,
    E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """`moe_align` of a small batch in ONE program (decode: up to a few thousand pairs), the same
    output as the torch path, which takes a dozen launches that cost more than the expert GEMMs of
    a batch-1 step. ``BLOCK_E > E`` so bin ``E`` can hold the padding lanes' sentinel expert.

    Pairs are sorted by the key ``expert * BLOCK_P + pair`` (stable by construction); a pair at
    sorted position ``j`` goes to ``padded_start[e] + j - start[e]`` of ``sorted_ids``, the
    per-expert offsets read back from ``base`` (a scratch of BLOCK_E ints, written first: a
    register tensor cannot be indexed by another). Tile ``t``'s expert is the number of padded
    group ends ``<= t * BLOCK_M`` (searchsorted, right), clamped to ``E - 1``."""
    grid_dependency(PDL)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < num_pairs
    e = tl.load(ids_ptr + p, mask=p_ok, other=E).to(tl.int32)
    eb = tl.arange(0, BLOCK_E)
    counts = tl.where(eb < E, tl.histogram(e, BLOCK_E), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(base_ptr + eb, ends - padded - (tl.cumsum(counts, 0) - counts))
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    for t0 in range(0, cap, BLOCK_P):
        r = t0 + p
        tl.store(sorted_ids_ptr + r, num_pairs + 0 * r, mask=r < cap)
    keys = tl.sort(e * BLOCK_P + p)
    tl.debug_barrier()  # the offsets in base and the sentinel fill are written before they are read/overwritten
    se = keys // BLOCK_P
    dest = tl.load(base_ptr + se, mask=p_ok, other=0) + p
    tl.store(sorted_ids_ptr + dest, keys % BLOCK_P, mask=p_ok)
    tb = tl.arange(0, BLOCK_T)
    for t0 in range(0, cap // BLOCK_M, BLOCK_T):
        t = t0 + tb
        le = (ends[None, :] <= (t * BLOCK_M)[:, None]) & (eb < E)[None, :]
        ex = tl.minimum(tl.sum(le.to(tl.int32), 1), E - 1)
        tl.store(expert_ids_ptr + t, ex, mask=t < cap // BLOCK_M)


@triton.jit
def moe_routing_kernel(
    logits_ptr,
    w_ptr,
    ids_ptr,
    E,
    stride_l,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Top-k routing of one token (`moe_routing_reference`'s rule): softmax over the E logits in
    fp32, the k largest in descending order (ties to the lower expert), renormalised to sum 1 when
    RENORM, weights stored in the output's dtype. One launch instead of torch's softmax, top-k,
    sum, division and cast: at batch 1 each of those costs as much as the work itself."""
    t = tl.program_id(0).to(tl.int64)
    grid_dependency(PDL)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(e < E, p, -1.0)
    vals = tl.zeros((BLOCK_E,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_E,), dtype=tl.int32)
    total = 0.0
    for j in tl.static_range(TOP_K):
        m = tl.max(p, 0)
        i = tl.min(tl.where(p == m, e, BLOCK_E), 0)
        total += m
        p = tl.where(e == i, -1.0, p)
        vals = tl.where(e == j, m, vals)
        ids = tl.where(e == j, i, ids)
    if RENORM:
        vals = vals / total
    tl.store(ids_ptr + t * TOP_K + e, ids.to(ids_ptr.dtype.element_ty), mask=e < TOP_K)
    tl.store(w_ptr + t * TOP_K + e, vals.to(w_ptr.dtype.element_ty), mask=e < TOP_K)


@triton.jit
def moe_gemv_gate_up_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    ids_ptr,
    N,
    stride_x,
    stride_we,
    stride_wn,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``act[p] = silu(gate_e(x_t)) * up_e(x_t)`` for one (token, slot) pair ``p = t * TOP_K + j`` and
    BLOCK_N of its N intermediate rows, ``e = ids[p]``: the gate|up product of a few pairs (decode at
    batch 1) as matrix-vector products, with no alignment pass and no padded tiles. The grid is
    ``(pairs, cdiv(N, BLOCK_N))``: at one token and top-8 of 768-wide experts, hundreds of programs
    streaming the eight experts' rows, where the grouped GEMM has a handful of 16-row tiles. K (the
    model's hidden size) is a constant so the chunk loop unrolls and the compiler can issue the next
    chunks' loads before the first is summed. Gate and up are each rounded to the activation's dtype
    before ``silu * up``, as `fused_moe_kernel` rounds."""
    p = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    grid_dependency(PDL)
    e = tl.load(ids_ptr + p).to(tl.int64)
    rows = w_ptr + e * stride_we + n.to(tl.int64)[:, None] * stride_wn
    xrow = x_ptr + (p // TOP_K) * stride_x
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        m = n_ok[:, None] & k_ok[None, :]
        xf = tl.load(xrow + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        g = tl.load(rows + k[None, :], mask=m, other=0.0, eviction_policy="evict_first")
        u = tl.load(rows + N * stride_wn + k[None, :], mask=m, other=0.0, eviction_policy="evict_first")
        acc += g.to(tl.float32) * xf
        acc_up += u.to(tl.float32) * xf
    dt = act_ptr.dtype.element_ty
    out = silu_mul(tl.sum(acc, 1).to(dt), tl.sum(acc_up, 1).to(dt), act_ptr)
    tl.store(act_ptr + p * N + n, out, mask=n_ok)


@triton.jit
def moe_gemv_down_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    topk_w_ptr,
    ids_ptr,
    N,
    stride_we,
    stride_wn,
    stride_o,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``out[t] = sum_j w[t, j] * down_e(act[t * TOP_K + j])`` for BLOCK_N output columns of one token:
    the down products of its k slots and their weighted sum in one program, so no ``[T, k, H]``
    buffer and no summing launch. Each slot's product is rounded to the output dtype, times its
    routing weight rounded again (the reference's order), and the k terms are summed in fp32 and
    rounded once, as torch sums ``[T, k, H]`` over k.

    At one token the grid is only ``H / BLOCK_N`` programs, each reading k experts' rows: a program
    loads all k slots' rows of a K chunk as one ``[k, BLOCK_N, BLOCK_K]`` tile, k times the bytes in
    flight of a slot-by-slot loop, which waits for each slot's rows in turn (on an H100: 27.8 against
    32.0 us for a MoE layer at T = 1, BENCHMARKS.md)."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    grid_dependency(PDL)
    dt = out_ptr.dtype.element_ty
    j = tl.arange(0, TOP_K_PAD)
    j_ok = j < TOP_K
    p = t * TOP_K + j
    e = tl.load(ids_ptr + p, mask=j_ok, other=0).to(tl.int64)
    rows = w_ptr + e[:, None, None] * stride_we + n.to(tl.int64)[None, :, None] * stride_wn
    m_rows = j_ok[:, None, None] & n_ok[None, :, None]
    acc3 = tl.zeros((TOP_K_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(act_ptr + p[:, None] * K + k[None, :], mask=j_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(
            rows + k[None, None, :], mask=m_rows & k_ok[None, None, :], other=0.0, eviction_policy="evict_first"
        )
        acc3 += w.to(tl.float32) * a.to(tl.float32)[:, None, :]
    wt = tl.load(topk_w_ptr + p, mask=j_ok, other=0.0).to(dt).to(tl.float32)
    terms = (tl.sum(acc3, 2).to(dt).to(tl.float32) * wt[:, None]).to(dt).to(tl.float32)
    total = tl.sum(tl.where(j_ok[:, None], terms, 0.0), 0)
    tl.store(out_ptr + t * stride_o + n, total.to(dt), mask=n_ok)
