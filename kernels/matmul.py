"""Projections: ``x @ weight.T`` by cuBLAS, or by the one-row GEMV kernel at batch 1, where decode
is bound by streaming the weights and one launch per projection (fused with SiLU-and-multiply for
the down projection) beats cuBLAS's."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import _dispatch
from . import fp8 as _fp8
from . import reference as _ref
from ._checks import FLOATS, check_device, check_dim, check_dtype, fail
from ._dispatch import backend, cdiv, num_sms, p2, pdl
from .elementwise import silu_and_mul
from .fp8 import (
    Fp8Weight,
    check_fp8_linear,
    fp8_gemv_applies,
    fp8_gemv_config,
    fp8_matmul,
    fp8_quantize_rows,
    fp8_swapab,
    gemv_w8a8,
    one_row_path,
)


def gemv_enabled() -> bool:
    """The one-row GEMV kernel replaces cuBLAS for single-row projections unless
    ``KVMESH_GEMV=0`` (read per call, so a benchmark can build both variants in one process)."""
    return os.environ.get("KVMESH_GEMV", "1") != "0"


def gemv_config(N: int, K: int, device: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for an ``N x K`` one-row GEMV.

    Bound by streaming the weights, so what matters is bytes in flight per SM and
    enough programs to keep every SM busy to the end. From a graph-timed, L2-flushed
    sweep on the H200 (docs/kernels.md): wide outputs (qkv, gate_up, lm_head: at
    least ~40 rows per SM) do best with 2-row programs streaming 2,048-wide chunks
    with 8 warps (many programs, 8 KiB per iteration); a narrow output over a long
    K (down: 4096 x 14336) with 4 rows and 2,048-wide chunks; a narrow, short one
    (o: 4096 x 4096) with 4 rows and 512-wide chunks."""
    sms = num_sms(device)
    if N >= 40 * sms:
        return 2, min(2048, p2(K)), 8, 1
    if K >= 8192:
        return 4, 2048, 4, 3
    return 4, min(512, p2(K)), 4, 1


def _gemv(
    x, weight, bias, silu_mul: bool, config=None, w_scale=None, x_scale=None, out_dtype=None, w_bits=False
) -> torch.Tensor:
    """One-row GEMV; ``w_scale`` (per output channel) for an e4m3 weight, ``x_scale`` (one
    value) for an e4m3 input row (then ``out_dtype`` is the output's); ``w_bits``: widen the e4m3
    weight by integer ops (the kernel's W_BITS)."""
    N, K = weight.shape
    y = torch.empty((1, N), dtype=out_dtype or x.dtype, device=x.device)
    if N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.view(1, N))
    bn, bk, warps, stages = config or gemv_config(N, K, x.device)
    bk = min(bk, p2(K))
    _dispatch.kernels_for(x).gemv_kernel[(cdiv(N, bn),)](
        x,
        weight.view(torch.uint8) if w_bits else weight,
        bias if bias is not None else y,
        y,
        w_scale if w_scale is not None else y,
        x_scale if x_scale is not None else y,
        N,
        K,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        EVEN_N=N % bn == 0,
        EVEN_K=K % bk == 0,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=warps,
        num_stages=stages,
        W_SCALE=w_scale is not None,
        X_SCALE=x_scale is not None,
        W_BITS=w_bits,
        **pdl(x, 1),
    )
    return y


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


def _gemv_applies(x, weight, bias) -> bool:
    return (
        x.shape[0] == 1
        and gemv_enabled()
        and x.dtype == weight.dtype
        and x.is_contiguous()
        and weight.stride(1) == 1
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None, config=None
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]``: the GEMV kernel when M is 1 (decode at
    batch 1, weight-bandwidth bound), cuBLAS otherwise. ``config`` overrides `gemv_config`.
    An `Fp8Weight` takes the FP8 paths (kernels/fp8.py)."""
    fn = "linear"
    if isinstance(weight, Fp8Weight):
        return _fp8_linear(fn, x, weight, bias, False, config)
    _linear_checks(fn, x, weight, bias, 1)
    if backend(x) == "reference" or not _gemv_applies(x, weight, bias):
        return F.linear(x, weight, bias)
    return _gemv(x, weight, bias, False, config)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, config=None) -> torch.Tensor:
    """``linear(silu_and_mul(x), weight)`` for a gate|up activation ``x [M, 2K]``; at M = 1 the
    activation is formed inside the GEMV (one launch instead of two)."""
    fn = "silu_mul_linear"
    if isinstance(weight, Fp8Weight):
        return _fp8_linear(fn, x, weight, None, True, config)
    _linear_checks(fn, x, weight, None, 2)
    if backend(x) == "reference":
        return _ref.silu_mul_linear_reference(x, weight)
    if not _gemv_applies(x, weight, None):
        return F.linear(silu_and_mul(x), weight)
    return _gemv(x, weight, None, True, config)


def _fp8_linear(fn: str, x, w: Fp8Weight, bias, silu_mul: bool, config) -> torch.Tensor:
    """An e4m3 weight: the upcasting W8A8 reference on the CPU; on a device at M = 1 the shape's
    one-row kernel (`one_row_path`: the swapped-operand W8A8 product on the tensor cores, or the
    GEMV W8A16 with conversions or integer widening; ``KVMESH_FP8_GEMV_W8A8=1`` quantizes the
    GEMV's row), per-token quantization and ``torch._scaled_mm`` otherwise (or the swapped
    product up to ``SWAPAB_MAX_ROWS`` rows). ``config`` is the chosen kernel's."""
    check_fp8_linear(fn, x, w, bias, 2 if silu_mul else 1)
    if backend(x) == "reference":
        return _ref.fp8_linear_reference(
            _ref.silu_and_mul_reference(x) if silu_mul else x, w.weight, w.scale, bias, w.input_scale
        )
    N, K = w.shape
    if fp8_gemv_applies(x, bias):
        path = one_row_path(N, K)
        if path == "swapab":
            return fp8_swapab(x, w, bias, silu_mul, config)
        if path == "swapab_q":
            xq, xs = fp8_quantize_rows(x, w.input_scale, silu_mul)
            return fp8_swapab(xq, w, bias, False, config, x_scale=xs, out_dtype=x.dtype)
        cfg = config or fp8_gemv_config(N, K, x.device)
        if not gemv_w8a8():
            return _gemv(x, w.weight, bias, silu_mul, cfg, w_scale=w.scale, w_bits=path == "bits")
        xq, xs = fp8_quantize_rows(x, w.input_scale, silu_mul)
        return _gemv(
            xq, w.weight, bias, False, cfg, w_scale=w.scale, x_scale=xs, out_dtype=x.dtype, w_bits=path == "bits"
        )
    if 1 < x.shape[0] <= _fp8.SWAPAB_MAX_ROWS and (bias is None or bias.is_contiguous()):
        return fp8_swapab(x, w, bias, silu_mul, config)
    return fp8_matmul(x, w, bias, silu_mul)
