"""Batched LoRA: the shrink (``x`` to rank R) and the expand (rank R back to the output, added in place)
over per-row adapter slots, the two launches of a LoRA projection (kernels/lora.py).

Both kernels tile the batch in BLOCK_M-row blocks whose rows may belong to different adapters, and
multiply the block's rows of one slot (the others masked to zero) by that slot's weights with
``tl.dot``; nothing is read back to the host, so a CUDA graph can hold either launch. Which
slots a program takes:

* walking (prefill): a program per row block walks the distinct slots of its block in ascending
  order, a data-dependent loop. A prefill block is mostly one sequence, so one slot: one
  iteration, a tensor-core tile, as Punica's SGMV without sorting the rows.
* SLOT_GRID (decode): a program per (row block, pool slot): at most one slot each, so a block of
  mixed adapters reads them in parallel programs rather than one after another in a loop whose
  every iteration waits on its loads; a program whose slot has no row in its block stores nothing.

Each adapter's weights are read once per row block either way, not once per row (Punica's
BGMV). Rows whose slot is outside ``[0, S)`` (-1: the base model) take no slot: the shrink writes
zeros for them, the expand leaves them untouched.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import jit_unspecialized


@triton.jit
def _block_slots(slots_ptr, stride_s, S, T, BLOCK_M: tl.constexpr, SLOT_GRID: tl.constexpr):
    """The program's rows, their slots (int32), which of them have an adapter (slot in ``[0, S)``),
    which of those this program computes (``mine``: all of them, or with SLOT_GRID those of the
    program's slot) and that slot (0 when walking)."""
    pid = tl.program_id(0)
    own = 0
    if SLOT_GRID:
        own = pid % S
        pid = pid // S
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    slot = tl.load(slots_ptr + rows.to(tl.int64) * stride_s, mask=row_ok, other=-1).to(tl.int32)
    valid = row_ok & (slot >= 0) & (slot < S)
    mine = valid
    if SLOT_GRID:
        mine = valid & (slot == own)
    return rows, slot, valid, mine, own


@triton.jit
def _shrink_slot(
    acc, x_rows, stride_xk, a_base, stride_ak, sel, r_ok, k_lo, k_hi, F32: tl.constexpr, BLOCK_K: tl.constexpr
):
    """``acc += x[sel rows, k_lo:k_hi] @ A[:, k_lo:k_hi].T`` for one slot's A (``a_base``: its rank rows)."""
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_hi
        xt = tl.load(x_rows + k[None, :] * stride_xk, mask=sel[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_base + k[:, None] * stride_ak, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if F32:
            acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, at, acc)
    return acc


@triton.jit
def _expand_slot(acc, h_rows, b_tile, sel, r_ok, c_ok, IEEE: tl.constexpr):
    """``acc += h[sel rows] @ B_tile`` for one slot's B columns (``b_tile``: ``[BLOCK_R, BLOCK_N]`` pointers)."""
    ht = tl.load(h_rows, mask=sel[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    bt = tl.load(b_tile, mask=r_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    if IEEE:
        acc = tl.dot(ht, bt, acc, input_precision="ieee")
    else:
        acc = tl.dot(ht, bt, acc)
    return acc


@jit_unspecialized("T")  # the batch's row count changes with every step
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    h_ptr,
    T,
    K,
    R,
    S,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ai,
    stride_ar,
    stride_ak,
    stride_s,
    stride_hs,
    stride_hi,
    stride_hm,
    F32: tl.constexpr,
    SLOT_GRID: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """``h[split, i, t] = x[t, ks] @ a[slots[t], i, :, ks].T`` over the split's K range ``ks``.

    Grid ``(row blocks (times S with SLOT_GRID), slices, K splits)``: at decode sizes a row
    block and a slice are far too few programs to stream the adapters' A, so K is split too and
    the caller sums the splits (a fixed order: deterministic, unlike atomics). F32: both operands
    as fp32 with an exact (IEEE) dot, for fp32 inputs or mixed dtypes; otherwise the inputs' own
    dtype on the tensor cores (bf16/fp16 products are exact in the fp32 accumulator). Rows
    without an adapter get zeros from the program of slot 0 (with SLOT_GRID) or of their block."""
    i = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows, slot, valid, mine, own = _block_slots(slots_ptr, stride_s, S, T, BLOCK_M, SLOT_GRID)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if SLOT_GRID:
        out = mine | ((rows < T) & ~valid & (own == 0))
    else:
        out = rows < T
    if tl.max(out.to(tl.int32), 0) == 0:
        return  # (SLOT_GRID) no row of this program's slot in its block
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    a_slice = a_ptr + i.to(tl.int64) * stride_ai + r[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if SLOT_GRID:
        if tl.max(mine.to(tl.int32), 0) > 0:
            a_base = a_slice + own.to(tl.int64) * stride_as
            acc = _shrink_slot(acc, x_rows, stride_xk, a_base, stride_ak, mine, r_ok, k_lo, k_hi, F32, BLOCK_K)
    else:
        rem = mine
        s = tl.min(tl.where(rem, slot, S), 0)
        while s < S:
            sel = rem & (slot == s)
            a_base = a_slice + s.to(tl.int64) * stride_as
            acc = _shrink_slot(acc, x_rows, stride_xk, a_base, stride_ak, sel, r_ok, k_lo, k_hi, F32, BLOCK_K)
            rem = rem & (slot != s)
            s = tl.min(tl.where(rem, slot, S), 0)
    h = h_ptr + pid_k * stride_hs + i * stride_hi + rows.to(tl.int64)[:, None] * stride_hm + r[None, :]
    tl.store(h, acc, mask=out[:, None] & r_ok[None, :])


@jit_unspecialized("T")
def lora_expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    slots_ptr,
    T,
    R,
    S,
    off0,
    off1,
    off2,
    off3,
    off4,
    stride_ym,
    stride_yn,
    stride_hs,
    stride_hi,
    stride_hm,
    stride_hr,
    stride_bs,
    stride_bi,
    stride_bn,
    stride_br,
    stride_s,
    IEEE: tl.constexpr,
    SLOT_GRID: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """``y[t, off_i + j] += h[i, t] @ b[slots[t], i, j].T`` for the columns ``j`` of slice ``i``.

    ``h`` holds one rank-R row per (slice, row), or with ``stride_hs`` one per (slot, slice, row):
    the stacked shrink, whose row ``t`` reads its slot's (kernels/lora.py).

    Grid ``(row blocks (times S with SLOT_GRID), slices, column tiles of the widest slice)``;
    slice ``i`` spans columns ``off_i .. off_{i+1}`` of ``y`` (up to four slices a launch; the
    wrapper launches again for more), and a tile past its slice's width exits at once, as does a
    program with no row to add to. The sum is formed in fp32 (``h`` is
    fp32, ``b`` widened) and added to ``y`` in fp32, rounded once to ``y``'s dtype, as the
    reference does. IEEE: an exact fp32 dot (fp32 ``y``); otherwise TF32, whose rounding of ``h``
    and ``b`` is far below a bf16/fp16 output's."""
    i = tl.program_id(1)
    pid_n = tl.program_id(2)
    lo = tl.where(i == 0, off0, tl.where(i == 1, off1, tl.where(i == 2, off2, off3)))
    hi = tl.where(i == 0, off1, tl.where(i == 1, off2, tl.where(i == 2, off3, off4)))
    width = hi - lo
    if pid_n * BLOCK_N >= width:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < width
    rows, slot, valid, mine, own = _block_slots(slots_ptr, stride_s, S, T, BLOCK_M, SLOT_GRID)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    if tl.max(mine.to(tl.int32), 0) == 0:
        return  # no row of this program's slot (SLOT_GRID) or no adapter row in its block
    h_rows = h_ptr + i.to(tl.int64) * stride_hi + rows.to(tl.int64)[:, None] * stride_hm + r[None, :] * stride_hr
    b_slice = b_ptr + i.to(tl.int64) * stride_bi + cols.to(tl.int64)[None, :] * stride_bn + r[:, None] * stride_br
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SLOT_GRID:
        h_own = h_rows + own.to(tl.int64) * stride_hs
        acc = _expand_slot(acc, h_own, b_slice + own.to(tl.int64) * stride_bs, mine, r_ok, c_ok, IEEE)
    else:
        rem = mine
        s = tl.min(tl.where(rem, slot, S), 0)
        while s < S:
            sel = rem & (slot == s)
            h_s = h_rows + s.to(tl.int64) * stride_hs
            acc = _expand_slot(acc, h_s, b_slice + s.to(tl.int64) * stride_bs, sel, r_ok, c_ok, IEEE)
            rem = rem & (slot != s)
            s = tl.min(tl.where(rem, slot, S), 0)
    mask = mine[:, None] & c_ok[None, :]
    y = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + (lo + cols).to(tl.int64)[None, :] * stride_yn
    old = tl.load(y, mask=mask, other=0.0)
    tl.store(y, (old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)
