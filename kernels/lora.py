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
"""

from __future__ import annotations

import torch

from . import reference as _ref
from ._checks import FLOATS, INTS, check_device, check_dim, check_dtype, fail


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


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``h[i, t] = x[t] @ a[slots[t], i].T`` as float32 ``[n, T, R]``; rows with slot -1 get zeros."""
    fn = "lora_shrink"
    _check(fn, x, a, slots)
    if a.shape[-1] != x.shape[1]:
        fail(fn, f"a has {a.shape[-1]} input features but x has {x.shape[1]}")
    return _ref.lora_shrink_reference(x, a, slots)


def lora_expand(
    y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, offsets: tuple[int, ...]
) -> torch.Tensor:
    """Adds ``h[i, t] @ b[slots[t], i, :w_i].T`` to ``y[t, offsets[i]:offsets[i+1]]`` in place
    (``w_i`` the slice's width) and returns ``y``; rows with slot -1 are left as they are."""
    fn = "lora_expand"
    _check(fn, y, b, slots)
    check_dim(fn, "h", h, 3)
    n = b.shape[1]
    if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != y.shape[1]:
        fail(fn, f"offsets must be 0..{y.shape[1]} with {n + 1} entries (one slice per b slice), got {offsets}")
    if any(offsets[i + 1] - offsets[i] > b.shape[2] for i in range(n)):
        fail(fn, f"a slice of offsets {offsets} is wider than b's {b.shape[2]} output rows")
    if tuple(h.shape) != (n, y.shape[0], b.shape[3]):
        fail(fn, f"h must be [{n}, {y.shape[0]}, {b.shape[3]}] (slices, rows, rank), got {tuple(h.shape)}")
    return _ref.lora_expand_reference(y, h, b, slots, offsets)
