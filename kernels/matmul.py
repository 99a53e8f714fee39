"""Projections: ``x @ weight.T`` by cuBLAS, or by the one-row GEMV kernel (kernels/gemv.py) at batch
1, where decode is bound by streaming the weights and one launch per projection (fused with
SiLU-and-multiply for the down projection) beats cuBLAS's. Which one runs is the caller's
`KernelChoices` (``gemv_kernel``; for an `Fp8Weight` the FP8 choices too)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from kvmesh.common.kernel_choices import DEFAULT_KERNEL_CHOICES, KernelChoices

from . import fp8 as _fp8
from . import reference as _ref
from ._checks import FLOATS, check_device, check_dim, check_dtype, fail
from ._dispatch import backend
from .elementwise import rms_norm, silu_and_mul
from .fp8 import (
    Fp8Weight,
    check_fp8_linear,
    fp8_gemv_applies,
    fp8_gemv_config,
    fp8_matmul,
    fp8_quantize_rows,
    fp8_swapab,
    norm_fuses,
    one_row_path,
)
from .gemv import RowNorm, gemv_config, norm_fits
from .gemv import gemv as _gemv


def _linear_checks(fn, x, weight, bias, k_mult: int):
    check_dim(fn, "x", x, 2)
    check_dim(fn, "weight", weight, 2)
    check_dtype(fn, "x", x, FLOATS)
    check_dtype(fn, "weight", weight, FLOATS)
    if x.shape[1] != weight.shape[1] * k_mult:
        fail(fn, f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        fail(fn, f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    check_device(fn, "x", x, weight=weight, bias=bias)


def _gemv_applies(x, weight, bias, choices: KernelChoices) -> bool:
    return (
        x.shape[0] == 1
        and choices.gemv_kernel
        and x.dtype == weight.dtype
        and x.is_contiguous()
        and weight.stride(1) == 1
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    config=None,
    *,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]``: the GEMV kernel when M is 1 (decode at
    batch 1, weight-bandwidth bound) unless ``choices.gemv_kernel`` is off, cuBLAS otherwise.
    ``config`` overrides `kvmesh.kernels.gemv.gemv_config`. An `Fp8Weight` takes the FP8 paths (kernels/fp8.py)."""
    fn = "linear"
    if isinstance(weight, Fp8Weight):
        return _fp8_linear(fn, x, weight, bias, False, config, choices)
    _linear_checks(fn, x, weight, bias, 1)
    if backend(x) == "reference" or not _gemv_applies(x, weight, bias, choices):
        return F.linear(x, weight, bias)
    return _gemv(x, weight, bias, False, config, pdl_on=choices.pdl)


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    *,
    want_normed: bool = False,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``linear(rms_norm(x (+ residual)), weight, bias)``: a pre-norm decoder's norm and the projection
    after it. Returns ``(y, normed, residual_out)``: ``normed`` the norm's output when
    ``want_normed`` (else None), ``residual_out`` the residual stream after the add (``x`` itself
    when ``residual`` is None), as `rms_norm` returns them.

    With ``choices.fused_norm_gemv`` the kernel that reads the projection's input forms the norm
    itself, one launch instead of two: at one row the GEMV where its row is one chunk and its programs
    hold several output rows (`norm_fits`: q|k|v and the MoE router of Qwen3-30B-A3B's shape, not a
    wide lm_head or dense gate|up, whose many 2-row programs would each re-read the row); for an FP8 weight
    whose path quantizes its input (the W8A8 one-row kernels, and the scaled GEMM at any number of
    rows) the per-token quantization (`fp8_quantize_rows`). Otherwise `rms_norm`, then `linear`."""
    fn = "rms_norm_linear"
    check_device(fn, "x", x, norm_weight=norm_weight, residual=residual)
    if choices.fused_norm_gemv and backend(x) != "reference":
        fused = _fused_rms_norm_linear(fn, x, norm_weight, eps, residual, weight, bias, want_normed, choices)
        if fused is not None:
            return fused
    if residual is None:
        normed, residual_out = rms_norm(x, norm_weight, eps, choices=choices), x
    else:
        normed, residual_out = rms_norm(x, norm_weight, eps, residual, choices=choices)
    return linear(normed, weight, bias, choices=choices), normed if want_normed else None, residual_out


def _fused_rms_norm_linear(fn, x, norm_weight, eps, residual, weight, bias, want_normed, choices):
    """`rms_norm_linear` in one launch where a kernel can form the norm; None where none can. The
    buffers the kernel writes are made only once it is chosen, so a fallback allocates nothing extra."""
    # whether the row fits; the residual sum's buffer, made below, has the residual's shape and dtype
    if not norm_fuses(x, RowNorm(norm_weight, eps, residual, residual)):
        return None
    N, K = weight.shape
    if isinstance(weight, Fp8Weight):
        check_fp8_linear(fn, x, weight, bias, 1)
        path = _fp8_path(x, weight, bias, choices)
        if (
            want_normed
            or path not in NORM_PATHS
            or (path == "gemv" and not norm_fits(K, fp8_gemv_config(N, K, x.device)))
        ):
            return None
    else:
        _linear_checks(fn, x, weight, bias, 1)
        if not (_gemv_applies(x, weight, bias, choices) and norm_fits(K, gemv_config(N, K, x.device))):
            return None
    residual_out = torch.empty_like(x) if residual is not None else None
    spec = RowNorm(norm_weight, eps, residual, residual_out)
    if isinstance(weight, Fp8Weight):
        y, normed = _fp8_linear(fn, x, weight, bias, False, None, choices, spec), None
    else:
        normed = torch.empty_like(x) if want_normed else None
        y = _gemv(x, weight, bias, False, norm=replace(spec, x_out=normed), pdl_on=choices.pdl)
    return y, normed, residual_out if residual_out is not None else x


def silu_mul_linear(
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Weight,
    config=None,
    *,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
) -> torch.Tensor:
    """``linear(silu_and_mul(x), weight)`` for a gate|up activation ``x [M, 2K]``; at M = 1 the
    activation is formed inside the GEMV (one launch instead of two)."""
    fn = "silu_mul_linear"
    if isinstance(weight, Fp8Weight):
        return _fp8_linear(fn, x, weight, None, True, config, choices)
    _linear_checks(fn, x, weight, None, 2)
    if backend(x) == "reference":
        return _ref.silu_mul_linear_reference(x, weight)
    if not _gemv_applies(x, weight, None, choices):
        return F.linear(silu_and_mul(x, choices=choices), weight)
    return _gemv(x, weight, None, True, config, pdl_on=choices.pdl)


# The FP8 paths (`_fp8_path`) whose kernel reads the input row(s) through a quantization or the GEMV, which
# can form the RMSNorm before them (`rms_norm_linear`); the swapped-operand product on bf16 rows cannot.
NORM_PATHS = ("swapab_q", "gemv", "gemv_q", "matmul")


def _fp8_path(x, w: Fp8Weight, bias, choices: KernelChoices) -> str:
    """Which FP8 kernel path rows ``x`` take on a device: at one row the shape's one-row kernel
    (`one_row_path`: ``swapab`` on the bf16 row, ``swapab_q`` on its quantization, or the GEMV,
    ``gemv`` W8A16 or ``gemv_q`` with ``choices.fp8_gemv_w8a8``); ``swapab_rows`` up to
    ``SWAPAB_MAX_ROWS`` rows; ``matmul`` (per-token quantization + the scaled GEMM) otherwise."""
    if fp8_gemv_applies(x, bias, choices):
        path = one_row_path(w.shape[0], w.shape[1], choices)
        if path in ("swapab", "swapab_q"):
            return path
        return "gemv_q" if choices.fp8_gemv_w8a8 else "gemv"
    if 1 < x.shape[0] <= _fp8.SWAPAB_MAX_ROWS and (bias is None or bias.is_contiguous()):
        return "swapab_rows"
    return "matmul"


def _fp8_linear(
    fn: str, x, w: Fp8Weight, bias, silu_mul: bool, config, choices: KernelChoices, norm: RowNorm | None = None
) -> torch.Tensor:
    """An e4m3 weight: the upcasting W8A8 reference on the CPU; on a device at M = 1 the shape's
    one-row kernel (`one_row_path`: the swapped-operand W8A8 product on the tensor cores, or the
    GEMV W8A16 with conversions or integer widening; ``choices.fp8_gemv_w8a8`` quantizes the
    GEMV's row), per-token quantization and the scaled GEMM otherwise (or the swapped product up
    to ``SWAPAB_MAX_ROWS`` rows). ``config`` is the chosen kernel's. ``norm``: the input is that
    RMSNorm of ``x``, formed by the path's kernel (only for `NORM_PATHS`, see `rms_norm_linear`)."""
    check_fp8_linear(fn, x, w, bias, 2 if silu_mul else 1)
    if backend(x) == "reference":
        return _ref.fp8_linear_reference(
            _ref.silu_and_mul_reference(x) if silu_mul else x, w.weight, w.scale, bias, w.input_scale
        )
    path = _fp8_path(x, w, bias, choices)
    if norm is not None and path not in NORM_PATHS:
        raise ValueError(f"{fn}: the FP8 path {path} cannot form the norm")
    N, K = w.shape
    if path == "swapab":
        return fp8_swapab(x, w, bias, silu_mul, config, choices=choices)
    if path == "swapab_q":
        xq, xs = fp8_quantize_rows(x, w.input_scale, silu_mul, norm, choices=choices)
        return fp8_swapab(xq, w, bias, False, config, x_scale=xs, out_dtype=x.dtype, choices=choices)
    if path in ("gemv", "gemv_q"):
        cfg = config or fp8_gemv_config(N, K, x.device)
        bits = one_row_path(N, K, choices) == "bits"
        if path == "gemv":
            return _gemv(x, w.weight, bias, silu_mul, cfg, w_scale=w.scale, w_bits=bits, norm=norm, pdl_on=choices.pdl)
        xq, xs = fp8_quantize_rows(x, w.input_scale, silu_mul, norm, choices=choices)
        return _gemv(
            xq,
            w.weight,
            bias,
            False,
            cfg,
            w_scale=w.scale,
            x_scale=xs,
            out_dtype=x.dtype,
            w_bits=bits,
            pdl_on=choices.pdl,
        )
    if path == "swapab_rows":
        return fp8_swapab(x, w, bias, silu_mul, config, choices=choices)
    return fp8_matmul(x, w, bias, silu_mul, norm, choices=choices)
