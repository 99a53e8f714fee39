"""The fused mixture-of-experts GEMM: one grouped GEMM over the experts of a routed batch."""

from __future__ import annotations

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
