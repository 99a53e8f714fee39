"""The one-row GEMV kernel (`gemv_kernel`): its launch configuration and its launch, shared by the
float projections (kernels/matmul.py) and the FP8 ones (kernels/fp8.py: e4m3 weights, W8A16 or
W8A8). Decode at batch 1 is bound by streaming the weights, and one launch per projection (fused
with SiLU-and-multiply for the down projection) beats cuBLAS's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _dispatch
from ._dispatch import cdiv, num_sms, p2, pdl


@dataclass(frozen=True)
class RowNorm:
    """The RMSNorm a kernel forms its input rows with (`gemv_kernel`'s NORM, `fp8_quant_rows_kernel`'s):
    weight and eps, the residual added first (None: none), and where the residual sum and the
    normalised rows are written (None: not wanted; ``residual_out`` is needed exactly when
    ``residual`` is given; ``x_out`` only by the GEMV)."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None
    x_out: torch.Tensor | None = None


def norm_fits(K: int, config: tuple[int, int, int, int]) -> bool:
    """Whether a one-row GEMV of width ``K`` under ``config`` forms the RMSNorm of its row itself
    (`RowNorm`): the row must be one chunk, and each program must hold at least 4 output rows. Every
    program reads the row, its residual and the norm's weight from L2; at 2 rows a program (the wide
    outputs: lm_head, a dense gate|up) that is more L2 traffic than the weights it streams."""
    return K <= config[1] and config[0] >= 4


def gemv_config(N: int, K: int, device: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for an ``N x K`` one-row GEMV.

    Bound by streaming the weights, so what matters is bytes in flight per SM and
    enough programs to keep every SM busy to the end. From a graph-timed, L2-flushed
    sweep on the H200 (docs/kernels.md): wide outputs (qkv, gate_up, lm_head: at
    least ~40 rows per SM) do best with 2-row programs streaming 2,048-wide chunks
    with 8 warps (many programs, 8 KiB per iteration); a narrow output over a long
    K (down: 4096 x 14336) with 4 rows and 2,048-wide chunks; a narrow, short one
    (o: 4096 x 4096, and Qwen3-30B-A3B's 2048 x 4096) with 4 rows and 2,048-wide chunks over 8 warps:
    in a graph of calls on an H100 (`bench/gpu_moe.py`'s attention parts) 11.1 and 5.7 us, against
    12.3 and 7.9 us for the 512-wide chunks over 4 warps that the H200 sweep had picked."""
    sms = num_sms(device)
    if N >= 40 * sms:
        return 2, min(2048, p2(K)), 8, 1
    if K >= 8192:
        return 4, 2048, 4, 3
    return 4, min(2048, p2(K)), 8, 1


def gemv(
    x,
    weight,
    bias,
    silu_mul: bool,
    config=None,
    w_scale=None,
    x_scale=None,
    out_dtype=None,
    w_bits=False,
    norm: RowNorm | None = None,
    *,
    pdl_on: bool,
) -> torch.Tensor:
    """One-row GEMV; ``w_scale`` (per output channel) for an e4m3 weight, ``x_scale`` (one
    value) for an e4m3 input row (then ``out_dtype`` is the output's); ``w_bits``: widen the e4m3
    weight by integer ops (the kernel's W_BITS); ``norm``: the input is the RMSNorm of ``x`` (the
    kernel's NORM); ``pdl_on``: the caller's `KernelChoices.pdl`."""
    N, K = weight.shape
    y = torch.empty((1, N), dtype=out_dtype or x.dtype, device=x.device)
    if N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.view(1, N))
    bn, bk, warps, stages = config or gemv_config(N, K, x.device)
    bk = min(bk, p2(K))
    nk = {}
    if norm is not None:
        if not norm_fits(K, (bn, bk, warps, stages)):
            raise ValueError(f"gemv: a norm needs the row in one chunk and >= 4 rows a program, not {bn} x {bk}")
        nk = dict(
            r_ptr=norm.residual if norm.residual is not None else x,
            nw_ptr=norm.weight,
            ro_ptr=norm.residual_out if norm.residual_out is not None else y,
            xo_ptr=norm.x_out if norm.x_out is not None else y,
            eps=float(norm.eps),
            NORM=True,
            HAS_RES=norm.residual is not None,
            STORE_X=norm.x_out is not None,
        )
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
        **nk,
        **pdl(x, 1, pdl_on),
    )
    return y
