"""FP8 (e4m3) projections: a weight quantized per output channel (`Fp8Weight`), which
`kvmesh.kernels.linear` and `silu_mul_linear` take in place of a float tensor.

W8A8 (the general path): the activation is quantized per token by `fp8_quant_rows_kernel` (its
largest magnitude maps to 448), then ``torch._scaled_mm`` multiplies on the tensor cores with the
per-row and per-column scales applied in its epilogue. At one row (decode at batch 1, bound by
streaming the weights) the one-row GEMV reads the e4m3 weight instead, half the bytes of bf16,
with the activation kept in its own dtype (W8A16): quantizing it would cost a launch and add error
without reading a byte less. `KernelChoices` ``fp8_gemv_w8a8`` quantizes it anyway (for
measurements); its other FP8 fields force a one-row kernel, a split-K or the Triton GEMM. On the CPU
everything runs the upcasting W8A8 reference (`fp8_linear_reference`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.common.kernel_choices import DEFAULT_KERNEL_CHOICES, KernelChoices

from . import _dispatch
from . import reference as _ref
from ._checks import FLOATS, check_dim, check_dtype, fail
from ._dispatch import backend, num_sms, p2, pdl
from .gemv import RowNorm, gemv_config
from .reference import FP8, FP8_MAX, FP8_MIN_SCALE


@dataclass(frozen=True)
class Fp8Weight:
    """A projection weight in e4m3 with one float32 scale per output channel: row ``n`` of the
    real weight is ``weight[n] * scale[n]``. ``input_scale`` is a checkpoint's static per-tensor
    activation scale (None: activations are scaled per token at run time)."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn, rows contiguous
    scale: torch.Tensor  # [N] float32
    input_scale: torch.Tensor | None = None  # [] or [1] float32

    def __post_init__(self) -> None:
        fn = "Fp8Weight"
        check_dim(fn, "weight", self.weight, 2)
        check_dtype(fn, "weight", self.weight, (FP8,))
        check_dim(fn, "scale", self.scale, 1)
        check_dtype(fn, "scale", self.scale, (torch.float32,))
        if self.scale.shape[0] != self.weight.shape[0]:
            fail(
                fn, f"scale {tuple(self.scale.shape)} must have one entry per row of weight {tuple(self.weight.shape)}"
            )
        if self.weight.shape[1] and self.weight.stride(1) != 1:
            fail(fn, "weight rows must be contiguous")
        if self.input_scale is not None and self.input_scale.numel() != 1:
            fail(fn, f"input_scale must be one value, got shape {tuple(self.input_scale.shape)}")
        for name, t in (("scale", self.scale), ("input_scale", self.input_scale)):
            if t is not None and t.device != self.weight.device:
                fail(fn, f"{name} is on {t.device} but weight is on {self.weight.device}")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale[:, None]).to(dtype)


def quantize_weight(w: torch.Tensor, input_scale: torch.Tensor | None = None) -> Fp8Weight:
    """``w [N, K]`` (any float dtype) to e4m3 with per-output-channel scales: each row's largest
    magnitude maps to 448, rounding to nearest even. Row by row independent, so quantizing the
    q, k and v projections apart and concatenating equals quantizing the fused qkv weight."""
    check_dim("quantize_weight", "w", w, 2)
    check_dtype("quantize_weight", "w", w, FLOATS)
    wf = w.float()
    scale = _ref.fp8_amax_scale(wf.abs().amax(-1))
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q.contiguous(), scale.contiguous(), input_scale)


def fp8_quantize_rows(
    x: torch.Tensor,
    static_scale: torch.Tensor | None = None,
    silu_mul: bool = False,
    norm: RowNorm | None = None,
    *,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantization of ``x [M, K]``: ``(q [M, K], scale [M] float32)``; one
    program per row (see `fp8_quantize_rows_reference` for the rule). With ``silu_mul`` ``x`` is a
    gate|up ``[M, 2K]`` and ``silu_and_mul(x)`` is what gets quantized, formed in the same pass.
    With ``norm`` (rows up to `ONE_PASS_MAX` wide, contiguous, not with ``silu_mul``; `norm_fuses`)
    the RMSNorm of ``x`` is what gets quantized, and the residual sum goes to ``norm.residual_out``."""
    fn = "fp8_quantize_rows"
    check_dim(fn, "x", x, 2)
    check_dtype(fn, "x", x, FLOATS)
    if silu_mul and x.shape[1] % 2:
        fail(fn, f"a gate|up row must have an even width, got {x.shape[1]}")
    if norm is not None and (silu_mul or not norm_fuses(x, norm)):
        fail(fn, "a norm is formed only for contiguous rows up to ONE_PASS_MAX wide, without silu_mul")
    if backend(x) == "reference":
        if norm is not None:
            x = _ref_norm(x, norm)
        return _ref.fp8_quantize_rows_reference(_ref.silu_and_mul_reference(x) if silu_mul else x, static_scale)
    M, K = x.shape[0], x.shape[1] // (2 if silu_mul else 1)
    if x.stride(1) != 1 and K > 1:
        x = x.contiguous()
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    if K == 0:
        return q, s.fill_(FP8_MIN_SCALE) if static_scale is None else s.copy_(static_scale.float().expand(M))
    nk = {}
    if norm is not None:
        nk = dict(
            r_ptr=norm.residual if norm.residual is not None else x,
            nw_ptr=norm.weight,
            ro_ptr=norm.residual_out if norm.residual_out is not None else x,
            eps=float(norm.eps),
            NORM=True,
            HAS_RES=norm.residual is not None,
        )
    _dispatch.kernels_for(x).fp8_quant_rows_kernel[(M,)](
        x,
        q,
        s,
        static_scale if static_scale is not None else s,
        M,
        K,
        x.stride(0),
        FP8_MAX=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
        STATIC=static_scale is not None,
        SILU_MUL=silu_mul,
        ONE_PASS=p2(K) <= ONE_PASS_MAX,
        BLOCK_K=p2(K) if p2(K) <= ONE_PASS_MAX else 2048,
        num_warps=4 if p2(K) <= 4096 else (8 if p2(K) <= 8192 else 16),
        **nk,
        **pdl(x, M, choices.pdl),
    )
    return q, s


def norm_fuses(x: torch.Tensor, norm: RowNorm) -> bool:
    """Whether `fp8_quantize_rows` forms ``norm`` of ``x`` itself: contiguous rows of one pass, the
    norm's weight and residual in x's dtype and shape."""
    r = norm.residual
    return (
        x.dim() == 2
        and x.is_contiguous()
        and p2(x.shape[1]) <= ONE_PASS_MAX
        and norm.weight.dtype == x.dtype
        and norm.weight.is_contiguous()
        and norm.weight.shape == (x.shape[1],)
        and (r is None or (r.shape == x.shape and r.dtype == x.dtype and r.is_contiguous()))
        and (r is None) == (norm.residual_out is None)
    )


def _ref_norm(x: torch.Tensor, norm: RowNorm) -> torch.Tensor:
    """The reference of a `RowNorm`: `rms_norm_reference`, its residual sum written out."""
    if norm.residual is None:
        out = _ref.rms_norm_reference(x, norm.weight, norm.eps)
        assert isinstance(out, torch.Tensor)
        return out
    y, ro = _ref.rms_norm_reference(x, norm.weight, norm.eps, norm.residual)
    assert norm.residual_out is not None
    norm.residual_out.copy_(ro)
    return y


# Rows up to this width are quantized from registers in one pass (a Llama-3-70B down projection's
# 28,672 columns are two passes).
ONE_PASS_MAX = 16384


def fp8_gemv_config(N: int, K: int, device: torch.device) -> tuple[int, int, int, int]:
    """The bf16 GEMV's configuration (`gemv_config`). Measured on the H200 at the Llama-3-8B shapes
    (bench/gpu_fp8.py): chunks twice as wide (the same bytes per program as bf16's) were 8-15%
    slower on qkv, o and gate_up and equal on down: the loop is bound by widening e4m3 to fp32, not
    by bytes in flight."""
    return gemv_config(N, K, device)


# The one-row FP8 projection (decode at batch 1), per weight shape [N, K]:
#   "convert":  `gemv_kernel` W8A16, e4m3 widened to fp32 by conversion instructions
#   "bits":     `gemv_kernel` W8A16, e4m3 widened by integer ops (W_BITS)
#   "swapab":   `fp8_swapab_kernel` W8A8 on the tensor cores, the row quantized inside the kernel
#   "swapab_q": the row quantized by `fp8_quant_rows_kernel` first, then `fp8_swapab_kernel`
# ONE_ROW_PATHS holds the H200 winners at the Llama-3-8B shapes (bench/gpu_fp8.py, its one-row
# table): swapab_q on qkv (11.1 against 11.8 us) and gate_up (33.6
# against 49.7 us), the conversion GEMV on o (7.6 against 9.7) and down (22.4 against 37.3); the
# others lost everywhere. Other shapes take DEFAULT_ONE_ROW_PATH; `KernelChoices.fp8_one_row_kernel`
# forces one (the names: kvmesh.common.kernel_choices.FP8_ONE_ROW_KERNELS).
ONE_ROW_PATHS: dict[tuple[int, int], str] = {(6144, 4096): "swapab_q", (28672, 4096): "swapab_q"}
DEFAULT_ONE_ROW_PATH = "convert"
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of `fp8_swapab` per [N, K]: the sweep's winners on the H200
SWAPAB_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (6144, 4096): (64, 512, 4, 3),
    (4096, 4096): (64, 512, 4, 3),
    (28672, 4096): (128, 256, 8, 3),
    (4096, 14336): (128, 256, 8, 3),
}
# programs per `fp8_swapab` tile (split-K) per [N, K], measured winners only (bench/gpu_fp8.py
# sweeps them; the split-K kernel equals the W8A8 product in the Triton interpreter); others: 1
SWAPAB_SPLIT_K: dict[tuple[int, int], int] = {}
# `fp8_swapab` also takes 2..SWAPAB_MAX_ROWS rows in place of quantization + ``torch._scaled_mm``:
# 1, as at 16 rows it was slower at every 8B shape (bench/gpu_fp8.py)
SWAPAB_MAX_ROWS = 1


def one_row_path(N: int, K: int, choices: KernelChoices = DEFAULT_KERNEL_CHOICES) -> str:
    """Which one-row FP8 kernel an ``N x K`` weight takes: ``choices.fp8_one_row_kernel`` where
    set, else the measured table."""
    if choices.fp8_one_row_kernel is not None:
        return choices.fp8_one_row_kernel
    return ONE_ROW_PATHS.get((N, K), DEFAULT_ONE_ROW_PATH)


def fp8_swapab_config(N: int, K: int, device: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)``: the tuned entry, else what won the H200 sweep
    (128-row tiles, 8 warps, for outputs that still give every SM a few programs; 64 x 512 else)."""
    if (N, K) in SWAPAB_CONFIGS:
        return SWAPAB_CONFIGS[(N, K)]
    if N >= 128 * num_sms(device):
        return 128, min(256, max(32, p2(K))), 8, 3
    return 64, min(512, max(32, p2(K))), 4, 3


def fp8_swapab(
    x: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None,
    silu_mul: bool = False,
    config: tuple[int, int, int, int] | None = None,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    split_k: int | None = None,
    *,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
) -> torch.Tensor:
    """W8A8 for at most 16 rows with swapped operands (`fp8_swapab_kernel`): ``x`` float (quantized
    per token inside the kernel, of ``silu_and_mul(x)`` with ``silu_mul``), or already e4m3 with its
    per-token ``x_scale``; output ``out_dtype`` (default: a float ``x``'s dtype, else bf16).
    ``split_k``: programs per output tile (default `swapab_split_k` of ``choices``)."""
    fn = "fp8_swapab"
    check_dim(fn, "x", x, 2)
    quant = x.dtype != FP8
    if not quant and (x_scale is None or silu_mul):
        fail(fn, "an e4m3 x needs its x_scale (and cannot take silu_mul)")
    M = x.shape[0]
    N, K = w.shape
    if M > 16:
        fail(fn, f"takes at most 16 rows, got {M}")
    out_dtype = out_dtype or (x.dtype if quant else torch.bfloat16)
    if x.shape[1] != K * (2 if silu_mul else 1):
        fail(fn, f"x {tuple(x.shape)} does not match weight {tuple(w.shape)}")
    if quant and w.input_scale is not None:  # a static activation scale: the quantization kernel applies it
        x, x_scale = fp8_quantize_rows(x, w.input_scale, silu_mul, choices=choices)
        return fp8_swapab(x, w, bias, False, config, x_scale, out_dtype, split_k, choices=choices)
    if backend(x) == "reference":
        if quant:
            x, x_scale = _ref.fp8_quantize_rows_reference(_ref.silu_and_mul_reference(x) if silu_mul else x)
        assert x_scale is not None
        return _ref.fp8_scaled_mm_reference(x, x_scale, w.weight, w.scale, bias, out_dtype)
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(M, N))
    if x.stride(1) != 1:
        x = x.contiguous()
    bn, bk, warps, stages = config or fp8_swapab_config(N, K, x.device)
    split = swapab_split_k(N, K, choices) if split_k is None else split_k
    part = lock = None
    if split > 1:
        part, lock = _split_buffers(x.device, split * 16 * N, -(-N // bn))
    _dispatch.kernels_for(x).fp8_swapab_kernel[(-(-N // bn) * split,)](
        x,
        x_scale if x_scale is not None else y,
        w.weight,
        w.scale,
        bias if bias is not None else y,
        y,
        M,
        N,
        K,
        x.stride(0),
        HAS_BIAS=bias is not None,
        QUANT_X=quant,
        SILU_MUL=silu_mul,
        FP8_MAX=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
        BLOCK_M=16,
        BLOCK_N=bn,
        BLOCK_K=bk,
        ONE_ROW=quant and M == 1,
        num_warps=warps,
        num_stages=stages,
        SPLIT_K=split,
        part_ptr=part,
        lock_ptr=lock,
        **pdl(x, M, choices.pdl),
    )
    return y


def swapab_split_k(N: int, K: int, choices: KernelChoices = DEFAULT_KERNEL_CHOICES) -> int:
    """How many programs share one `fp8_swapab_kernel` tile: ``choices.fp8_split_k`` where set (for
    measurements), else the measured entry (`SWAPAB_SPLIT_K`), else 1."""
    if choices.fp8_split_k is not None:
        return choices.fp8_split_k
    return SWAPAB_SPLIT_K.get((N, K), 1)


_SPLIT_BUFFERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_buffers(device: torch.device, part_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K scratch of `fp8_swapab_kernel` on ``device``: fp32 partials and the per-tile locks
    (zero, and left zero by every launch). One pair per device, grown when a launch needs more: the
    projections run one after another on the engine's stream, so they can share it. The engine's
    warm-up runs every shape eagerly before graph capture, so growth never happens inside a graph."""
    part, lock = _SPLIT_BUFFERS.get(device, (None, None))
    if part is None or lock is None or part.numel() < part_elems or lock.numel() < tiles:
        n_part = max(part_elems, part.numel() if part is not None else 0)
        n_lock = max(tiles, lock.numel() if lock is not None else 0)
        part = torch.empty(n_part, dtype=torch.float32, device=device)
        lock = torch.zeros(n_lock, dtype=torch.int32, device=device)
        _SPLIT_BUFFERS[device] = (part, lock)
    return part, lock


def _scaled_mm_applies(x: torch.Tensor, w: Fp8Weight) -> bool:
    """``torch._scaled_mm`` with row-wise scales: CUDA, bf16 output, K and N multiples of 16."""
    N, K = w.shape
    return x.is_cuda and x.dtype == torch.bfloat16 and K % 16 == 0 and N % 16 == 0


def check_fp8_linear(fn: str, x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, k_mult: int) -> None:
    check_dim(fn, "x", x, 2)
    check_dtype(fn, "x", x, FLOATS)
    N, K = w.shape
    if x.shape[1] != K * k_mult:
        fail(fn, f"x {tuple(x.shape)} does not match weight {tuple(w.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        fail(fn, f"bias must be [{N}], got {tuple(bias.shape)}")
    for name, t in (("weight", w.weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            fail(fn, f"{name} is on {t.device} but x is on {x.device}")


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """The W8A8 GEMM in Triton (`fp8_gemm_kernel`) on rows already quantized (`fp8_quantize_rows`):
    ``(xq @ w.weight.T) * x_scale[:, None] * w.scale[None, :] (+ bias)``. ``config``:
    ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``; the default is a first guess, untuned."""
    fn = "fp8_gemm"
    check_dim(fn, "xq", xq, 2)
    check_dtype(fn, "xq", xq, (FP8,))
    M, K = xq.shape
    N = w.shape[0]
    if w.shape[1] != K:
        fail(fn, f"xq {tuple(xq.shape)} does not match weight {tuple(w.shape)}")
    if backend(xq) == "reference":
        return _ref.fp8_scaled_mm_reference(xq, x_scale, w.weight, w.scale, bias, out_dtype)
    y = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    if M == 0 or N == 0:
        return y
    bm, bn, bk, warps, stages = config or (16 if M <= 16 else 64, 128, 128, 4, 3)
    _dispatch.kernels_for(xq).fp8_gemm_kernel[(-(-M // bm), -(-N // bn))](
        xq.contiguous(),
        x_scale,
        w.weight,
        w.scale,
        bias if bias is not None else y,
        y,
        M,
        N,
        K,
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return y


def fp8_matmul(
    x: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None,
    silu_mul: bool = False,
    norm: RowNorm | None = None,
    *,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
) -> torch.Tensor:
    """W8A8 for any number of rows on a device: per-token quantization (of ``silu_and_mul(x)`` with
    ``silu_mul``, or of ``norm``'s RMSNorm of ``x``, fused), then the scaled GEMM
    (``torch._scaled_mm`` where it applies, else the upcasting reference on the quantized rows;
    `fp8_gemm` with ``choices.fp8_gemm`` "triton", for measurements until the Triton GEMM is tuned)."""
    xq, xs = fp8_quantize_rows(x, w.input_scale, silu_mul, norm, choices=choices)
    if choices.fp8_gemm == "triton":
        return fp8_gemm(xq, xs, w, bias, x.dtype)
    if _scaled_mm_applies(x, w):
        y = torch._scaled_mm(xq, w.weight.t(), scale_a=xs[:, None], scale_b=w.scale[None, :], out_dtype=x.dtype)
        return y if bias is None else y + bias
    return _ref.fp8_scaled_mm_reference(xq, xs, w.weight, w.scale, bias, x.dtype)


def fp8_gemv_applies(x: torch.Tensor, bias: torch.Tensor | None, choices: KernelChoices) -> bool:
    """Whether a row takes a one-row kernel (`one_row_path`): one contiguous row, with the GEMV
    kernel chosen (``choices.gemv_kernel``)."""
    return (
        x.shape[0] == 1
        and choices.gemv_kernel
        and x.is_contiguous()
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    )
