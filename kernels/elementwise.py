"""Row-wise kernels of the model's layers: RMSNorm (fused with the residual add), rotary
embedding (rotate-half, NeoX / Llama), SiLU-and-multiply of a fused gate|up projection."""

from __future__ import annotations

import torch

from kvmesh.common.kernel_choices import DEFAULT_KERNEL_CHOICES, KernelChoices

from . import _dispatch
from . import reference as _ref
from ._checks import FLOATS, check_device, check_dim, check_dtype, check_last_contig, check_rope, fail
from ._dispatch import backend, cdiv, p2, pdl


def _rows(fn, name, x):
    """2-D view [rows, hidden] without copying when the rows are evenly strided."""
    check_last_contig(fn, name, x)
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
):
    """RMSNorm in fp32 over the last dim, optionally fused with the residual add.

    Returns ``normed`` or ``(normed, x + residual)`` like the reference (new
    tensors; inputs are not modified)."""
    fn = "rms_norm"
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        fail(fn, "x must be a tensor with at least one dim")
    check_dtype(fn, "x", x, FLOATS)
    check_dim(fn, "weight", weight, 1)
    check_dtype(fn, "weight", weight, FLOATS)
    H = x.shape[-1]
    if weight.shape[0] != H:
        fail(fn, f"weight has {weight.shape[0]} entries for hidden size {H}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            fail(
                fn,
                f"residual must match x ({tuple(x.shape)}, {x.dtype}); got {tuple(residual.shape)}, {residual.dtype}",
            )
    check_device(fn, "x", x, weight=weight, residual=residual)
    be = backend(x)
    if be == "reference":
        return _ref.rms_norm_reference(x, weight, eps, residual)
    out_dtype = x.dtype if weight.dtype == x.dtype else torch.promote_types(x.dtype, weight.dtype)
    weight = weight.contiguous()
    x2 = _rows(fn, "x", x)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    y2 = y.view(-1, H)
    if residual is not None:
        r2 = _rows(fn, "residual", residual)
        ro = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = ro.view(-1, H)
    else:
        r2, ro2 = x2, y2
    rows = x2.shape[0]
    if rows == 0 or H == 0:
        return (y, ro) if residual is not None else y
    block = p2(H)
    _dispatch.kernels_for(x).rms_norm_kernel[(rows,)](
        x2,
        r2,
        weight,
        y2,
        ro2,
        x2.stride(0),
        r2.stride(0),
        y2.stride(0),
        ro2.stride(0),
        float(eps),
        H,
        HAS_RES=residual is not None,
        W_SAME=weight.dtype == x.dtype,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
        **pdl(x, rows, choices.pdl),
    )
    return (y, ro) if residual is not None else y


def rope(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
):
    """Rotate-half (NeoX / Llama) rotary embedding; returns new ``(query, key)``."""
    fn = "rope"
    check_rope(fn, positions, query, key, cos_sin_cache)
    T, _, D = query.shape
    be = backend(query)
    if be == "reference":
        return _ref.rope_reference(positions, query, key, cos_sin_cache)
    qo = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    ko = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if T == 0:
        return qo, ko
    half = D // 2
    kern = _dispatch.kernels_for(query)
    for x, y in ((query, qo), (key, ko)):
        H = x.shape[1]
        hb = min(p2(H), max(1, 2048 // p2(half)))
        kern.rope_kernel[(T, cdiv(H, hb))](
            positions,
            x,
            y,
            cos_sin_cache,
            x.stride(0),
            x.stride(1),
            y.stride(0),
            y.stride(1),
            cos_sin_cache.stride(0),
            H,
            HALF=half,
            HALF_PAD=p2(half),
            H_BLOCK=hb,
            num_warps=4,
            **pdl(x, T, choices.pdl),
        )
    return qo, ko


def silu_and_mul(x: torch.Tensor, *, choices: KernelChoices = DEFAULT_KERNEL_CHOICES) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for a fused gate/up projection of width ``2d``."""
    fn = "silu_and_mul"
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        fail(fn, "x must be a tensor with at least one dim")
    check_dtype(fn, "x", x, FLOATS)
    if x.shape[-1] % 2:
        fail(fn, f"last dim must be even (gate | up), got {x.shape[-1]}")
    be = backend(x)
    if be == "reference":
        return _ref.silu_and_mul_reference(x)
    d = x.shape[-1] // 2
    x2 = _rows(fn, "x", x)
    y = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    y2 = y.view(-1, d)
    if y2.shape[0] == 0 or d == 0:
        return y
    block = min(1024, p2(d))
    _dispatch.kernels_for(x).silu_and_mul_kernel[(x2.shape[0], cdiv(d, block))](
        x2,
        y2,
        x2.stride(0),
        y2.stride(0),
        d,
        BLOCK=block,
        num_warps=4,
        **pdl(x, x2.shape[0], choices.pdl),
    )
    return y
