"""Batched LoRA: every row of a batch through its own adapter (or none) in two launches per projection.

A LoRA projection is ``y = x W^T + (x A^T) B^T * alpha / r``. A batch mixes rows of several adapters
and of the base model, so the adapter is a per-row index (``slots``: the row's slot in the engine's
device pool, -1 = the base model) and the two small matmuls run as a *shrink* (``x`` to rank ``R``)
and an *expand* (rank ``R`` back to the output, added in place to the base projection's output).
A fused projection (q|k|v, gate|up) is ``n`` slices: one shrink reads ``x`` once for all slices,
the expand adds each slice's result to its column range of ``y``.

Layout of the pool, fixed at start so a decode step fits in a CUDA graph:
* ``a``: ``[S, n, R, K]``: slot, slice, rank (zero-padded to ``--max-lora-rank``), input features.
* ``b``: ``[S, n, N, R]``: slot, slice, output features (zero-padded to the widest slice), rank; the
  adapter's ``alpha / r`` is folded into ``b`` when it is loaded.

Zero padding makes a smaller rank or a narrower slice exact: padded rank columns add zeros.

CUDA tensors take the Triton kernels (kernels/_triton/lora.py; CPU tensors with ``TRITON_INTERPRET=1``
their interpreted copy, other CPU tensors the torch references): one launch each (and a torch sum of
the shrink's K splits at decode sizes), the slots read on the device, so a decode step with adapters
fits in a CUDA graph. Any strides are taken as they come.
A slot outside ``[0, S)`` is the base model in the kernels (no adapter read, nothing added); the
references skip negative slots and fail on slots ``>= S``: the engine passes ``-1`` or a pool slot.
"""

from __future__ import annotations

import torch

from . import _dispatch
from . import reference as _ref
from ._checks import FLOATS, INTS, check_device, check_dim, check_dtype, fail
from ._dispatch import backend, cdiv, num_sms, p2

# Slices one expand launch covers (q|k|v is three); a projection of more slices takes more launches.
EXPAND_MAX_SLICES = 4


# A program per (row block, pool slot) (the kernels' SLOT_GRID) while the batch has at most this many
# (row block, slot) pairs: decode batches, whose mixed adapters are then read in parallel; larger
# ones walk each block's slots in a loop (prefill, whose blocks are mostly one sequence).
SLOT_GRID_MAX = 64


def slot_grid(T: int, bm: int, S: int) -> bool:
    """Whether a call of ``T`` rows in ``bm``-row blocks over a pool of ``S`` slots takes SLOT_GRID."""
    return cdiv(T, bm) * S <= SLOT_GRID_MAX


def shrink_config(T: int, n: int, K: int, R: int, S: int, device: torch.device) -> tuple[int, int, int, int, bool]:
    """``(BLOCK_M, BLOCK_K, split_k, num_warps, SLOT_GRID)`` for a shrink of ``T`` rows, ``n`` slices,
    ``K`` inputs, rank ``R``, over a pool of ``S`` slots.

    The whole batch in one row block up to 64 rows. A row block and a slice give too few programs
    to stream the adapters' A at decode sizes (3 for q|k|v at batch 1), so K is split and the
    splits summed after the launch. Decode (SLOT_GRID): 16 splits while at most 8 programs have
    rows (``min(S, T)`` slots a block), else 8: on an H100 (rank 16, 8 slots, Llama-3-8B's
    projections at T = 1, 32, 128, graph-timed) these were the fastest of 1 to 32 or within
    0.3 us of it; more splits cost more in the sum than they save (the down projection at T = 1:
    11.0 us at 112 splits, 6.8 at 16). Prefill: until the programs about fill the SMs."""
    bm = min(64, max(16, p2(T)))
    bk = 64 if bm == 64 and R > 32 else 128
    grid = slot_grid(T, bm, S)
    if grid:
        split = 16 if cdiv(T, bm) * n * min(S, T) <= 8 else 8
    else:
        split = cdiv(num_sms(device), cdiv(T, bm) * n)
    return bm, bk, max(1, min(cdiv(K, bk), split)), 4, grid


def expand_config(T: int, N: int, S: int, device: torch.device) -> tuple[int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, num_warps, SLOT_GRID)`` for an expand of ``T`` rows into slices up to ``N``
    wide over a pool of ``S`` slots: narrower column tiles at decode sizes, for more programs."""
    bm = min(64, max(16, p2(T)))
    return bm, 64 if T <= 16 else 128, 4, slot_grid(T, bm, S)


def _check(fn: str, x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor) -> None:
    check_dim(fn, "x", x, 2)
    check_dim(fn, "weights", w, 4)
    check_dim(fn, "slots", slots, 1)
    check_dtype(fn, "x", x, FLOATS)
    check_dtype(fn, "weights", w, FLOATS)
    check_dtype(fn, "slots", slots, INTS)
    check_device(fn, "x", x, weights=w, slots=slots)
    if slots.shape[0] != x.shape[0]:
        fail(fn, f"slots has {slots.shape[0]} rows but x has {x.shape[0]}")


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, *, config: tuple[int, int, int, int, bool] | None = None
) -> torch.Tensor:
    """``h[i, t] = x[t] @ a[slots[t], i].T`` as float32 ``[n, T, R]``; rows with slot -1 get zeros.
    ``config`` overrides `shrink_config` (tests and benchmarks)."""
    fn = "lora_shrink"
    _check(fn, x, a, slots)
    if a.shape[-1] != x.shape[1]:
        fail(fn, f"a has {a.shape[-1]} input features but x has {x.shape[1]}")
    T, K = x.shape
    S, n, R = a.shape[0], a.shape[1], a.shape[2]
    if backend(x) == "reference" or 0 in (T, S, n, R):
        return _ref.lora_shrink_reference(x, a, slots)
    bm, bk, split, warps, grid = config or shrink_config(T, n, K, R, S, x.device)
    k_per_split = cdiv(cdiv(max(K, 1), split), bk) * bk
    split = max(1, cdiv(K, k_per_split))
    out = torch.empty((split, n, T, R), dtype=torch.float32, device=x.device)
    _dispatch.kernels_for(x).lora_shrink_kernel[(cdiv(T, bm) * (S if grid else 1), n, split)](
        x,
        a,
        slots,
        out,
        T,
        K,
        R,
        S,
        k_per_split,
        x.stride(0),
        x.stride(1),
        a.stride(0),
        a.stride(1),
        a.stride(2),
        a.stride(3),
        slots.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        F32=x.dtype == torch.float32 or x.dtype != a.dtype,
        SLOT_GRID=grid,
        BLOCK_M=bm,
        BLOCK_K=bk,
        BLOCK_R=max(16, p2(R)),
        num_warps=warps,
    )
    return out[0] if split == 1 else out.sum(0)


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    offsets: tuple[int, ...],
    *,
    config: tuple[int, int, int, bool] | None = None,
) -> torch.Tensor:
    """Adds ``h[i, t] @ b[slots[t], i, :w_i].T`` to ``y[t, offsets[i]:offsets[i+1]]`` in place
    (``w_i`` the slice's width) and returns ``y``; rows with slot -1 are left as they are.

    ``h`` is ``[n, T, R]`` (`lora_shrink`'s, each row's own slot), or ``[T, S, n, R]``: every slot's
    shrink of every row, as a base projection with the slots' A stacked under its weight computes it
    (engine/lora/pool.py), of which row ``t`` takes ``h[t, slots[t]]``.
    ``config`` overrides `expand_config` (tests and benchmarks)."""
    fn = "lora_expand"
    _check(fn, y, b, slots)
    stacked = isinstance(h, torch.Tensor) and h.dim() == 4
    if not stacked:
        check_dim(fn, "h", h, 3)
    n = b.shape[1]
    if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != y.shape[1]:
        fail(fn, f"offsets must be 0..{y.shape[1]} with {n + 1} entries (one slice per b slice), got {offsets}")
    if any(offsets[i + 1] - offsets[i] > b.shape[2] for i in range(n)):
        fail(fn, f"a slice of offsets {offsets} is wider than b's {b.shape[2]} output rows")
    T, R, S = y.shape[0], b.shape[3], b.shape[0]
    if stacked and tuple(h.shape) != (T, S, n, R):
        fail(fn, f"a stacked h must be [{T}, {S}, {n}, {R}] (rows, slots, slices, rank), got {tuple(h.shape)}")
    if not stacked and tuple(h.shape) != (n, T, R):
        fail(fn, f"h must be [{n}, {T}, {R}] (slices, rows, rank), got {tuple(h.shape)}")
    check_dtype(fn, "h", h, FLOATS)
    check_device(fn, "y", y, h=h)
    if backend(y) == "reference" or 0 in (T, S, n, R):
        if stacked:  # each row's own slot (a base row's is never read)
            h = h[torch.arange(T, device=h.device), slots.clamp(0, S - 1)].permute(1, 0, 2).float()
        return _ref.lora_expand_reference(y, h, b, slots, offsets)
    # strides of h as (slot, slice, row, rank); the slot's is 0 for an unstacked h
    hs = (h.stride(1), h.stride(2), h.stride(0), h.stride(3)) if stacked else (0, *h.stride())
    widest = max(offsets[i + 1] - offsets[i] for i in range(n))
    if widest == 0:
        return y
    bm, bn, warps, grid = config or expand_config(T, widest, S, y.device)
    for g in range(0, n, EXPAND_MAX_SLICES):
        m = min(EXPAND_MAX_SLICES, n - g)
        offs = list(offsets[g : g + m + 1]) + [offsets[g + m]] * (EXPAND_MAX_SLICES - m)
        hg = h[:, :, g : g + m] if stacked else h[g : g + m]
        bg = b[:, g : g + m]
        _dispatch.kernels_for(y).lora_expand_kernel[(cdiv(T, bm) * (S if grid else 1), m, cdiv(widest, bn))](
            y,
            hg,
            bg,
            slots,
            T,
            R,
            S,
            *offs,
            y.stride(0),
            y.stride(1),
            *hs,
            bg.stride(0),
            bg.stride(1),
            bg.stride(2),
            bg.stride(3),
            slots.stride(0),
            IEEE=y.dtype == torch.float32,
            SLOT_GRID=grid,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_R=max(16, p2(R)),
            num_warps=warps,
        )
    return y
