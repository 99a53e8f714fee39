"""Experiment: paged decode attention with one TMA load per page (Hopper tensor descriptors).

The production kernel (`kernels/_triton_kernels.py`, `paged_attention_kernel`) gathers each
key tile through the block table with pointer loads; it reads 97-100% of what SDPA reads on
contiguous KV (BENCHMARKS.md, "Kernels, H200"). Hopper's TMA cannot gather rows (that is a
Blackwell feature), but a page of one KV head -- 16 tokens x 128 dims, rows 2 KB apart in the
cache -- is one rectangular box, so a descriptor over ``[num_blocks, block_size, Hkv * D]``
(the engine's own strided per-layer view) loads it with one instruction, asynchronously, without
per-element address arithmetic. This script asks whether that reads faster.

Decode only (one query token per sequence, the GQA group of 4 padded to 16 rows), one page per
loop iteration, software-pipelined by Triton (``num_stages``). Checked against a float32
reference on fresh random inputs (poisoned output), then timed inside CUDA graphs after an L2
flush beside the production kernel and SDPA on contiguous KV, at the issue's three shapes.

    python3 bench/gpu_tma_decode.py [--quick] [--ordered] [--session8] [--persistent]   # H200; $OUT/tma_decode.json

Outcome (2026-11-30, BENCHMARKS.md "Kernels, H200", session 8): one page per step with 2 warps and
6 stages won from ~3 programs per SM and is now `paged_decode_tma_kernel` in kvmesh.kernels (flat,
without this script's two-pages variant; ``--session8`` reruns that sweep). Session 9's default sweep
asks two more questions: does one TMA box over several KV heads' slices of a page (``tma_heads_kernel``)
read faster (no: 2 heads tie, 4 lose), and does page order matter (``--ordered``: 0.3-0.6%).
Session 10 (``--persistent``): persistent programs that each read several (sequence, KV head) items'
pages in one flattened loop, so the next item's pages are in flight while the current one finishes
(``tma_flat_kernel``; the first form, ``tma_persistent_kernel``, carried the item state across
iterations and Triton did not pipeline it). Both lose to the grid-per-item kernel at every shape
(flat: 90-92% of it at 128 x 576, 89-92% at 128 x 4,096; 95% even without the V mask): the per-page bookkeeping (item
lookup, a query load per page, masks on every page) costs more than the pipeline ramps it saves.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_kernels as G  # noqa: E402  (shared helpers: paged inputs, timers, copy bandwidth)


@triton.jit
def _one_page(q, k, v, m_i, l_i, acc, scale_log2):
    s = tl.dot(q, tl.trans(k)) * scale_log2
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _masked_page(q, k, v, n_ok, m_i, l_i, acc, scale_log2):
    """`_one_page` for a page whose keys outside ``n_ok`` do not count (their V rows may hold anything)."""
    s = tl.where(n_ok[None, :], tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return (m_new, l_i * alpha + tl.sum(p, 1),
            acc * alpha[:, None] + tl.dot(p.to(v.dtype), tl.where(n_ok[:, None], v, 0.0)))


@triton.jit
def tma_decode_kernel(q_ptr, k_desc, v_desc, o_ptr, bt_ptr, seqlen_ptr, scale_log2,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                      QPK: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                      NUM_KV_HEADS: tl.constexpr, PAIRS: tl.constexpr):
    pid = tl.program_id(0)
    kvh = pid % NUM_KV_HEADS  # heads of one sequence adjacent in launch order
    b = pid // NUM_KV_HEADS
    seq_len = tl.load(seqlen_ptr + b).to(tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < QPK
    head = kvh * QPK + offs_m % QPK
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    full_pages = seq_len // BS
    first_single = 0
    if PAIRS:
        # two pages per iteration: twice the bytes in flight per pipeline stage, one rescale
        for i in range(0, full_pages // 2):
            b0 = tl.load(bt_row + 2 * i).to(tl.int32)
            b1 = tl.load(bt_row + 2 * i + 1).to(tl.int32)
            k0 = k_desc.load([b0, 0, kvh * D]).reshape(BS, D)
            k1 = k_desc.load([b1, 0, kvh * D]).reshape(BS, D)
            v0 = v_desc.load([b0, 0, kvh * D]).reshape(BS, D)
            v1 = v_desc.load([b1, 0, kvh * D]).reshape(BS, D)
            s0 = tl.dot(q, tl.trans(k0)) * scale_log2
            s1 = tl.dot(q, tl.trans(k1)) * scale_log2
            m_new = tl.maximum(m_i, tl.maximum(tl.max(s0, 1), tl.max(s1, 1)))
            p0 = tl.math.exp2(s0 - m_new[:, None])
            p1 = tl.math.exp2(s1 - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p0, 1) + tl.sum(p1, 1)
            acc = acc * alpha[:, None] + tl.dot(p0.to(v0.dtype), v0) + tl.dot(p1.to(v1.dtype), v1)
            m_i = m_new
        first_single = (full_pages // 2) * 2
    for pg in range(first_single, full_pages):
        blk = tl.load(bt_row + pg).to(tl.int32)
        k = k_desc.load([blk, 0, kvh * D]).reshape(BS, D)
        v = v_desc.load([blk, 0, kvh * D]).reshape(BS, D)
        m_i, l_i, acc = _one_page(q, k, v, m_i, l_i, acc, scale_log2)
    if full_pages * BS < seq_len:  # the last, partly filled page
        blk = tl.load(bt_row + full_pages).to(tl.int32)
        k = k_desc.load([blk, 0, kvh * D]).reshape(BS, D)
        v = v_desc.load([blk, 0, kvh * D]).reshape(BS, D)
        n_ok = full_pages * BS + tl.arange(0, BS) < seq_len
        k = tl.where(n_ok[:, None], k, 0.0)
        v = tl.where(n_ok[:, None], v, 0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def descriptor(cache: torch.Tensor) -> TensorDescriptor:
    """[num_blocks, bs, Hkv, D] strided per-layer view -> 3-D descriptor of one head's page."""
    nb, bs, hkv, d = cache.shape
    assert cache.stride(3) == 1 and cache.stride(2) == d and cache.stride(1) == hkv * d
    view = torch.as_strided(cache, (nb, bs, hkv * d), (cache.stride(0), cache.stride(1), 1))
    return TensorDescriptor.from_tensor(view, [1, bs, d])


def _launch_pages(kernel, grid, q, k, v, bt, sl, scale, out, descs, extra=(), **kw):
    """Launch one of this probe's one-page-per-load kernels: queries, the two page descriptors,
    output, block table, lengths, scale in log2 units, ``extra`` scalars, strides, then shapes."""
    _, hq, d = q.shape
    _, bs, hkv, _ = k.shape
    kd, vd = descs or (descriptor(k), descriptor(v))
    kernel[grid](q, kd, vd, out, bt, sl, scale * 1.4426950408889634, *extra,
                 q.stride(0), q.stride(1), out.stride(0), out.stride(1), bt.stride(0),
                 QPK=hq // hkv, BLOCK_M=16, D=d, BS=bs, NUM_KV_HEADS=hkv, **kw)
    return out


def _sm_count(t: torch.Tensor) -> int:
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 4


def tma_decode(q, k, v, bt, sl, scale, out, num_warps=4, num_stages=3, descs=None, pairs=False):
    return _launch_pages(tma_decode_kernel, (q.shape[0] * k.shape[2],), q, k, v, bt, sl, scale, out, descs,
                         PAIRS=pairs, num_warps=num_warps, num_stages=num_stages)


@triton.jit
def tma_persistent_kernel(q_ptr, k_desc, v_desc, o_ptr, bt_ptr, seqlen_ptr, scale_log2, n_items,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                          QPK: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                          NUM_KV_HEADS: tl.constexpr, STORE_IF: tl.constexpr):
    """Persistent decode: program p owns the (sequence, KV head) items p, p + P, p + 2P, ... and
    reads all their pages in ONE flattened, software-pipelined loop. The grid-per-item kernel
    starts every item with an empty pipeline (q, block-table entry, then `num_stages` page loads
    before the first product) and, with equal contexts, all items of a wave start and end
    together; here the next item's first pages are already in flight while the current item's
    last ones are multiplied. The item state (sequence, head, page, length) advances with selects,
    not branches, so page addresses never depend on the softmax and the pipeliner can run ahead.
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    total = 0
    for it in range(pid, n_items, P):  # pages this program reads, over all its items
        total += tl.cdiv(tl.load(seqlen_ptr + it // NUM_KV_HEADS).to(tl.int32), BS)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < QPK
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BS)
    item = pid
    b = item // NUM_KV_HEADS
    kvh = item % NUM_KV_HEADS
    seq_len = tl.load(seqlen_ptr + b, mask=item < n_items, other=0).to(tl.int32)
    n_pg = tl.cdiv(seq_len, BS)
    pg = 0
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + (kvh * QPK + offs_m % QPK)[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None] & (item < n_items), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for _ in range(0, total):
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + pg).to(tl.int32)
        k = k_desc.load([blk, 0, kvh * D]).reshape(BS, D)
        v = v_desc.load([blk, 0, kvh * D]).reshape(BS, D)
        m_i, l_i, acc = _masked_page(q, k, v, pg * BS + offs_n < seq_len, m_i, l_i, acc, scale_log2)
        last = pg == n_pg - 1
        o_rows = o_ptr + b.to(tl.int64) * stride_ot + (kvh * QPK + offs_m % QPK)[:, None] * stride_oh + offs_d[None, :]
        if STORE_IF:
            if last:
                tl.store(o_rows, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            tl.store(o_rows, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & last)
        # next item's state (selected in where the current one ends)
        nxt = item + P
        nb = nxt // NUM_KV_HEADS
        nh = nxt % NUM_KV_HEADS
        nlen = tl.load(seqlen_ptr + nb, mask=last & (nxt < n_items), other=0).to(tl.int32)
        nq = tl.load(q_ptr + nb.to(tl.int64) * stride_qt + (nh * QPK + offs_m % QPK)[:, None] * stride_qh
                     + offs_d[None, :], mask=row_ok[:, None] & last & (nxt < n_items), other=0.0)
        q = tl.where(last, nq, q)
        item = tl.where(last, nxt, item)
        b = tl.where(last, nb, b)
        kvh = tl.where(last, nh, kvh)
        seq_len = tl.where(last, nlen, seq_len)
        n_pg = tl.where(last, tl.cdiv(nlen, BS), n_pg)
        pg = tl.where(last, 0, pg + 1)
        m_i = tl.where(last, float("-inf"), m_i)
        l_i = tl.where(last, 0.0, l_i)
        acc = tl.where(last, 0.0, acc)


def persistent_programs(n_items: int, per_sm: int, sms: int) -> int:
    """As many programs as fit (per_sm per SM), then as few as give every program the same
    number of items (1,024 items on 132 x 4 slots: 512 programs of 2, not 528 of 1-2)."""
    per = -(-n_items // max(1, min(n_items, per_sm * sms)))
    return -(-n_items // per)


def tma_persistent(q, k, v, bt, sl, scale, out, per_sm=4, num_warps=2, num_stages=6, descs=None,
                   store_if=False, programs=None):
    n = q.shape[0] * k.shape[2]
    grid = programs or persistent_programs(n, per_sm, _sm_count(q))
    return _launch_pages(tma_persistent_kernel, (grid,), q, k, v, bt, sl, scale, out, descs, (n,),
                         STORE_IF=store_if, num_warps=num_warps, num_stages=num_stages)


@triton.jit
def tma_flat_kernel(q_ptr, k_desc, v_desc, o_ptr, bt_ptr, seqlen_ptr, scale_log2, n_items,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    QPK: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                    NUM_KV_HEADS: tl.constexpr, ITEMS: tl.constexpr, STORE_IF: tl.constexpr,
                    VMASK: tl.constexpr = True):
    """Persistent decode, second form: program p owns at most ITEMS (sequence, KV head) items,
    p, p + P, ..., and reads their pages in one flattened loop whose page address is a function
    of the loop index alone (item = how many of the program's cumulative page counts are <= j),
    so the pipeliner can issue loads `num_stages` pages ahead across item boundaries; the first
    form (`tma_persistent_kernel`) carried the item state from iteration to iteration and was not
    pipelined. Softmax state resets and the output store happen by select / branch at the
    item's first and last page."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    slot = tl.arange(0, ITEMS)
    ids = pid + slot * P
    lens = tl.load(seqlen_ptr + ids // NUM_KV_HEADS, mask=ids < n_items, other=0).to(tl.int32)
    npg = tl.cdiv(lens, BS)
    ends = tl.cumsum(npg, 0)
    starts = ends - npg
    total = tl.sum(npg, 0)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < QPK
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BS)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for j in range(0, total):
        i = tl.sum((ends <= j).to(tl.int32), 0)
        sel = slot == i
        pg = j - tl.sum(tl.where(sel, starts, 0), 0)
        seq_len = tl.sum(tl.where(sel, lens, 0), 0)
        item = pid + i * P
        b = item // NUM_KV_HEADS
        kvh = item % NUM_KV_HEADS
        head = kvh * QPK + offs_m % QPK
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + pg).to(tl.int32)
        k = k_desc.load([blk, 0, kvh * D]).reshape(BS, D)
        v = v_desc.load([blk, 0, kvh * D]).reshape(BS, D)
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        first = pg == 0  # a new item: m = -inf makes alpha 0, which also clears acc (finite)
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        n_ok = pg * BS + offs_n < seq_len
        s = tl.where(n_ok[None, :], tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if VMASK:  # slots past the end may hold anything (0 * NaN); the probe's pool is finite
            v = tl.where(n_ok[:, None], v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        last = (pg + 1) * BS >= seq_len
        o_rows = o_ptr + b.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        if STORE_IF:
            if last:
                tl.store(o_rows, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            tl.store(o_rows, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & last)


def tma_flat(q, k, v, bt, sl, scale, out, items=2, num_warps=2, num_stages=6, descs=None, store_if=True,
             per_sm=4, vmask=True):
    """Programs: enough that each owns at most ``items`` items, and at least ~``per_sm`` per SM's
    worth of items when there are fewer (then one item each, as the grid-per-item kernel)."""
    n = q.shape[0] * k.shape[2]
    per = max(1, min(items, -(-n // (per_sm * _sm_count(q)))))
    return _launch_pages(tma_flat_kernel, (-(-n // per),), q, k, v, bt, sl, scale, out, descs, (n,),
                         ITEMS=triton.next_power_of_2(per), STORE_IF=store_if, VMASK=vmask,
                         num_warps=num_warps, num_stages=num_stages)


@triton.jit
def tma_heads_kernel(q_ptr, k_desc, v_desc, o_ptr, bt_ptr, seqlen_ptr, scale_log2,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                     QPK: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                     NUM_KV_HEADS: tl.constexpr, HPP: tl.constexpr, W: tl.constexpr):
    """HPP adjacent KV heads of one sequence per program: one TMA box of [16, HPP * D] per page
    (HPP * D * 2 contiguous bytes per token), the GQA groups stacked as rows against a
    block-diagonal query (row r sees only its own head's D columns), so QK^T and PV are plain
    products over HPP * D columns; each row keeps its own head's D columns at the end."""
    pid = tl.program_id(0)
    G: tl.constexpr = NUM_KV_HEADS // HPP
    h0 = (pid % G) * HPP
    b = pid // G
    seq_len = tl.load(seqlen_ptr + b).to(tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < QPK * HPP
    grp = offs_m // QPK  # which of the program's heads a row belongs to
    head = h0 * QPK + offs_m
    offs_c = tl.arange(0, HPP * D)
    mine = (offs_c[None, :] // D == grp[:, None]) & row_ok[:, None]
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + head[:, None] * stride_qh + (offs_c[None, :] % D),
                mask=mine, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HPP * D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    full_pages = seq_len // BS
    c0 = h0 * D // W
    for pg in range(0, full_pages):
        blk = tl.load(bt_row + pg).to(tl.int32)
        k = k_desc.load([blk, 0, c0, 0]).reshape(BS, HPP * D)
        v = v_desc.load([blk, 0, c0, 0]).reshape(BS, HPP * D)
        m_i, l_i, acc = _one_page(q, k, v, m_i, l_i, acc, scale_log2)
    if full_pages * BS < seq_len:
        blk = tl.load(bt_row + full_pages).to(tl.int32)
        k = k_desc.load([blk, 0, c0, 0]).reshape(BS, HPP * D)
        v = v_desc.load([blk, 0, c0, 0]).reshape(BS, HPP * D)
        m_i, l_i, acc = _masked_page(q, k, v, full_pages * BS + tl.arange(0, BS) < seq_len, m_i, l_i, acc,
                                     scale_log2)
    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    tl.store(o_ptr + b.to(tl.int64) * stride_ot + head[:, None] * stride_oh + (offs_c[None, :] % D),
             out.to(o_ptr.dtype.element_ty), mask=mine)


def heads_descriptor(cache: torch.Tensor, hpp: int) -> tuple[TensorDescriptor, int]:
    """4-D view ``[num_blocks, bs, Hkv * D / W, W]`` (W = min(HPP * D, 256): TMA boxes are at most
    256 elements a side) with a box of ``[1, bs, HPP * D / W, W]``: HPP heads' page in one load."""
    nb, bs, hkv, d = cache.shape
    w = min(hpp * d, 256)
    view = torch.as_strided(cache, (nb, bs, hkv * d // w, w), (cache.stride(0), cache.stride(1), w, 1))
    return TensorDescriptor.from_tensor(view, [1, bs, hpp * d // w, w]), w


def tma_heads(q, k, v, bt, sl, scale, out, hpp, num_warps=4, num_stages=4, descs=None):
    B, hq, d = q.shape
    _, bs, hkv, _ = k.shape
    (kd, w), (vd, _) = descs or (heads_descriptor(k, hpp), heads_descriptor(v, hpp))
    qpk = hq // hkv
    tma_heads_kernel[(B * hkv // hpp,)](q, kd, vd, out, bt, sl, scale * 1.4426950408889634,
                                        q.stride(0), q.stride(1), out.stride(0), out.stride(1), bt.stride(0),
                                        QPK=qpk, BLOCK_M=max(16, triton.next_power_of_2(qpk * hpp)), D=d, BS=bs,
                                        NUM_KV_HEADS=hkv, HPP=hpp, W=w, num_warps=num_warps, num_stages=num_stages)
    return out


def reference(p, scale):
    """float32 attention over each sequence's pages gathered in order."""
    q, k, v, bt, sl = p["q"], p["k"], p["v"], p["bt"], p["sl"]
    hq, hkv = q.shape[1], k.shape[2]
    outs = []
    for b in range(q.shape[0]):
        n = int(sl[b])
        pages = bt[b, :(n + k.shape[1] - 1) // k.shape[1]].long()
        kk = k[pages].reshape(-1, hkv, k.shape[3])[:n].float().repeat_interleave(hq // hkv, 1)
        vv = v[pages].reshape(-1, hkv, v.shape[3])[:n].float().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kk) * scale
        outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vv))
    return torch.stack(outs)


def _verdict(label, out, ref) -> bool:
    """Finite and within the bf16 attention bound of the float32 reference; prints one line."""
    err = G.rel_err(out.float(), ref)
    good = bool(torch.isfinite(out).all()) and err < G.ATT_BOUND[torch.bfloat16]
    print(f"check {label}: rel err {err:.2e} (bound {G.ATT_BOUND[torch.bfloat16]:.1e}) {'ok' if good else 'FAIL'}",
          flush=True)
    return good


def check(gen, shapes):
    ok = True
    scale = 128 ** -0.5
    for B, L in shapes:
        p = G.make_paged([1] * B, [L - 1] * B, 32, 8, 128, 16, torch.bfloat16, num_layers=2, layer=1, gen=gen)
        args = (p["q"], p["k"], p["v"], p["bt"], p["sl"], scale)
        ref = reference(p, scale)
        runs = [(f"heads/program={hpp}", lambda out, hpp=hpp: tma_heads(*args, out, hpp)) for hpp in (1, 2, 4)]
        runs += [(f"persistent store_if={s} programs={n}",
                  lambda out, s=s, n=n: tma_persistent(*args, out, store_if=s, programs=n))
                 for s, n in ((False, None), (True, None), (False, 3), (True, 5))]
        runs += [(f"pairs={pairs}", lambda out, pairs=pairs: tma_decode(*args, out, pairs=pairs))
                 for pairs in (False, True)]
        for label, run in runs:
            out = torch.full_like(p["q"], float("nan"))
            try:
                run(out)
            except Exception as e:  # a variant that does not compile is a failed check, not the end of the run
                print(f"check B={B} L={L} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                ok = False
                continue
            ok &= _verdict(f"B={B} L={L} {label}", out, ref)
    # contexts of different lengths, several items per persistent program
    p = G.make_paged([1] * 6, [4, 299, 16, 63, 999, 0], 32, 8, 128, 16, torch.bfloat16, num_layers=2, layer=1,
                     gen=gen)
    args = (p["q"], p["k"], p["v"], p["bt"], p["sl"], scale)
    ref = reference(p, scale)
    for items in (2, 4, 8, 1):
        out = torch.full_like(p["q"], float("nan"))
        tma_flat(*args, out, items=items, per_sm=1)
        ok &= _verdict(f"mixed lengths flat items={items}", out, ref)
    for store_if, programs in ((False, 5), (True, 7), (False, 48)):
        out = torch.full_like(p["q"], float("nan"))
        tma_persistent(*args, out, store_if=store_if, programs=programs)
        ok &= _verdict(f"mixed lengths persistent store_if={store_if} programs={programs}", out, ref)
    return ok


# ("pages", two pages per iteration, warps, stages); session 8's first sweep (1 page; w4 s2/3/4/6, w8 s3,
# w2 s4) found more stages and fewer warps better: 1 page w4 s6 read 90 / 79 / 64% of SDPA, w2 s4 99% at
# 128 x 4,096; second sweep (these): 1 page w2 s6/s8 and 2 pages w2 s6 reached 99-101% of SDPA at 64 x 2,048
# and 128 x 4,096, 69-90% at 32 x 16,384
SESSION8_CONFIGS = [("pages", *c) for c in [(0, 2, 5), (0, 2, 6), (0, 2, 7), (0, 2, 8), (0, 2, 10), (1, 2, 5),
                                            (1, 2, 6), (1, 2, 7), (1, 2, 8), (1, 4, 8), (1, 4, 10), (0, 1, 8)]]
# ("heads", KV heads per program, warps, stages): session 9, several heads' page slices per TMA load
# ("persist", programs per SM, warps, stages, store under a branch): session 10, one flattened page loop
# per persistent program over several (sequence, KV head) items
# (first form, item state carried across iterations: 27-90% of SDPA, not pipelined; 2026-11-30 12:19 UTC)
# ("flat", items per program, warps, stages, store under a branch): the page address a function of the
# loop index alone
# (first sweep, 12:23 UTC, with acc also reset by select: best 1 warp / 8 stages, 3.43 / 2.94 / 4.01 / 3.90
# TB/s at 128 x 576 / 64 x 576 / 128 x 4,096 / 64 x 2,048 against 3.72-3.74 / 3.20 / 4.34 / 4.01 for the
# grid-per-item kernels; 2 warps 3.21 / 3.04 / 3.54 / 3.55; the masked store instead of a branch 10-15% slower)
# (..., V masked on every page: 0 = not, to price the select on the probe's finite pool)
PERSIST_CONFIGS = [("pages", 0, 2, 6)] + [("flat", *c) for c in [
    (2, 1, 8, 1, 1), (2, 1, 8, 1, 0), (2, 1, 10, 1, 1), (2, 1, 12, 1, 1), (2, 2, 6, 1, 1), (2, 2, 6, 1, 0),
    (2, 2, 8, 1, 0), (2, 1, 8, 1, 1, 2), (2, 1, 8, 1, 1, 8)]]
CONFIGS = [("pages", 0, 2, 6), ("heads", 1, 2, 6), ("heads", 2, 2, 4), ("heads", 2, 4, 4), ("heads", 2, 4, 6),
           ("heads", 2, 2, 6), ("heads", 4, 4, 3), ("heads", 4, 4, 4), ("heads", 4, 8, 3)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="checks only, small shapes")
    ap.add_argument("--session8", action="store_true", help="session 8's sweep (one or two pages per step)")
    ap.add_argument("--persistent", action="store_true", help="session 10's sweep: persistent flattened kernel")
    ap.add_argument("--ordered", action="store_true",
                    help="also time kvmesh and the configs with each sequence's pages consecutive in the pool")
    ap.add_argument("--shapes", default="64x2048,128x4096,32x16384",
                    help="B x context, comma-separated (the engine's decode: 128x576,64x576,32x576)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":  # CPU smoke test of --quick: the interpreter fixes
        importlib.import_module(G.K.__name__ + "._triton_kernels")._fix_interpreter()  # the kvmesh kernels get
    gen = torch.Generator(device=G.DEV)
    gen.manual_seed(int.from_bytes(os.urandom(4), "little"))
    ok = check(gen, [(3, 37), (2, 300), (5, 16), (4, 1000)])
    if args.quick or not ok:
        return 0 if ok else 1
    copy = G.copy_bandwidth()
    print(f"copy bandwidth {copy:.2f} TB/s", flush=True)
    rows = []
    hq, hkv, d, bs = 32, 8, 128, 16
    configs = SESSION8_CONFIGS if args.session8 else PERSIST_CONFIGS if args.persistent else CONFIGS
    for B, L in [tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")]:
        p = G.make_paged([1] * B, [L - 1] * B, hq, hkv, d, bs, torch.bfloat16, num_layers=2, layer=0,
                         extra_blocks=0, gen=gen)
        gb = 2 * B * L * hkv * d * 2
        out = torch.empty_like(p["q"])
        orders = ["random", "ordered"] if args.ordered else ["random"]
        row = dict(B=B, L=L)
        for order in orders:
            if order == "ordered":  # each sequence's pages consecutive in the pool: DRAM locality probe
                nb = -(-L // bs)
                p["bt"][:, :nb] = torch.arange(B * nb, dtype=torch.int32, device=G.DEV).view(B, nb)
            sfx = "" if order == "random" else " (ordered pages)"
            descs = {}
            for rnd in range(2):
                ms = G.graph_ms(lambda: G.K.paged_attention(p["q"], p["k"], p["v"], p["bt"], p["qsl"], p["sl"],
                                                            d ** -0.5, out=out, max_query_len=1, max_seq_len=L))
                row.setdefault("kvmesh" + sfx, []).append(gb / ms / 1e9)
                for kind, a, w, st, *rest in configs:
                    if kind == "flat":
                        per_sm = rest[2] if len(rest) > 2 else 4
                        name = (f"flat {a} items w{w} s{st}{' if' if rest[0] else ''}"
                                f"{'' if rest[1] else ' no-vmask'} {per_sm}/SM")
                        ds = descs.setdefault("pages", (descriptor(p["k"]), descriptor(p["v"])))
                        fn = (lambda: tma_flat(p["q"], p["k"], p["v"], p["bt"], p["sl"], d ** -0.5, out,
                                               a, w, st, ds, bool(rest[0]), per_sm, bool(rest[1])))
                    elif kind == "persist":
                        name = f"persistent {a}/SM w{w} s{st}{' if' if rest[0] else ''}"
                        ds = descs.setdefault("pages", (descriptor(p["k"]), descriptor(p["v"])))
                        fn = (lambda: tma_persistent(p["q"], p["k"], p["v"], p["bt"], p["sl"], d ** -0.5, out,
                                                     a, w, st, ds, bool(rest[0])))
                    elif kind == "pages":
                        name = f"tma {'2 pages' if a else '1 page'} w{w} s{st}"
                        ds = descs.setdefault(name, (descriptor(p["k"]), descriptor(p["v"])))
                        fn = (lambda: tma_decode(p["q"], p["k"], p["v"], p["bt"], p["sl"], d ** -0.5, out,
                                                 w, st, ds, a))
                    else:
                        name = f"heads/program {a} w{w} s{st}"
                        ds = descs.setdefault(a, (heads_descriptor(p["k"], a), heads_descriptor(p["v"], a)))
                        fn = (lambda: tma_heads(p["q"], p["k"], p["v"], p["bt"], p["sl"], d ** -0.5, out, a,
                                                w, st, ds))
                    try:
                        ms = G.graph_ms(fn)
                    except Exception as e:  # a config that does not compile must not end the run
                        print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    row.setdefault(name + sfx, []).append(gb / ms / 1e9)
        del p, out, descs, fn
        torch.cuda.empty_cache()
        q = torch.randn(B, hq, 1, d, dtype=torch.bfloat16, device=G.DEV, generator=gen)
        k = torch.randn(B, hkv, L, d, dtype=torch.bfloat16, device=G.DEV, generator=gen)
        v = torch.randn_like(k)
        row["sdpa"] = [gb / G.graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)) / 1e9
                       for _ in range(2)]
        del q, k, v
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nTB/s of K+V read (two rounds each), copy {copy:.2f} TB/s")
    names = [k for k in rows[0] if k not in ("B", "L")]
    print("| config | " + " | ".join(f"{r['B']} x {r['L']}" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for n in names:
        cells = []
        for r in rows:
            x = r.get(n)
            cells.append("" if not x else f"{max(x):.2f} ({max(x) / max(r['sdpa']):.1%})")
        print(f"| {n} | " + " | ".join(cells) + " |")
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "tma_decode.json"), "w") as f:
        json.dump(dict(copy_TBps=copy, rows=rows, torch=torch.__version__, triton=triton.__version__,
                       device=torch.cuda.get_device_name()), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
