"""`KernelChoices`: which kernel variants an engine's layers launch, fixed when the engine is built.

The defaults are the measured best (docs/kernels.md, BENCHMARKS.md); the other values exist so
benchmarks can compare variants, each on an engine (or a kernel call) built with them. The engine
takes them from `EngineArgs` (engine/args.py) into `EngineConfig.kernels`, hands them to the model
at build, and every layer passes them to the kernels it calls (``choices=``); the kernels read no
switch of their own. A CUDA graph holds what its capture launched, so choices that could change
after the build would leave captured graphs disagreeing with eager steps.

Declared here, torch-free, because the engine's configuration (which the operator imports without
torch) holds them as well as `kvmesh.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

# The one-row FP8 projections (decode at batch 1; kvmesh/kernels/fp8.py describes each):
# the GEMV W8A16 widening e4m3 by conversions or by integer ops, the swapped-operand W8A8 product
# quantizing the row inside the kernel, or after a quantization launch.
FP8_ONE_ROW_KERNELS: tuple[str, ...] = ("convert", "bits", "swapab", "swapab_q")
# The W8A8 product of more rows: ``torch._scaled_mm``, or the Triton GEMM (untuned, for measurements).
FP8_GEMMS: tuple[str, ...] = ("scaled_mm", "triton")


@dataclass(frozen=True)
class KernelChoices:
    """Kernel variants; every default is what the engine runs unless a benchmark asks otherwise."""

    # The one-row GEMV kernel for single-row projections (decode at batch 1) instead of cuBLAS.
    gemv_kernel: bool = True
    # Decode attention through the TMA kernel (one page per load) where the heuristic picks it on
    # Hopper; off: the pointer kernel everywhere.
    tma_attention: bool = True
    # Programmatic dependent launch of one-token kernel calls on Hopper (each launch overlaps the
    # previous kernel's tail).
    pdl: bool = True
    # One-row FP8 kernel for every weight shape (one of FP8_ONE_ROW_KERNELS); None: the measured
    # table per shape (kernels/fp8.py ONE_ROW_PATHS).
    fp8_one_row_kernel: str | None = None
    # The one-row FP8 GEMV quantizes its input row too (W8A8 instead of W8A16).
    fp8_gemv_w8a8: bool = False
    # Programs per output tile of the swapped-operand FP8 product for every shape (split-K);
    # None: the measured table per shape (kernels/fp8.py SWAPAB_SPLIT_K).
    fp8_split_k: int | None = None
    # The W8A8 product of more than one row (one of FP8_GEMMS).
    fp8_gemm: str = "scaled_mm"
    # MoE routing and alignment by one Triton launch each instead of a dozen torch ops.
    moe_prep_kernels: bool = True
    # MoE layers of a few (token, slot) pairs (decode at batch 1 and 2) by two matrix-vector kernels
    # instead of alignment, the grouped GEMM and the sum over slots (four launches fewer per layer).
    moe_gemv: bool = True
    # Qwen3's per-head q_norm and k_norm inside the RoPE + KV-write launch (kernels.rope_write_kv)
    # instead of two RMSNorm launches before it. Off: the two launches, for comparison.
    fused_qk_norm: bool = True
    # The RMSNorm before a projection formed by the kernel that reads its input (a one-row GEMV whose row
    # is one chunk: q|k|v, the MoE router; an FP8 weight's input quantization) instead of a launch
    # before it. Off until measured on a GPU (bench/gpu_moe.py, bench/gpu_fp8.py --configs).
    fused_norm_gemv: bool = False
    # A decode round's next-step inputs (ids, positions, lengths, slots) advanced by one launch between
    # two steps instead of a dozen torch ops. Off until measured on a GPU.
    advance_kernel: bool = False
    # LoRA's shrink inside the base projection's GEMM (the slots' A stacked under its weight) and one
    # expand launch, instead of a shrink, the sum of its K splits and an expand per projection
    # (engine/lora/pool.py). Off: the separate kernels everywhere, for comparison.
    lora_stacked: bool = True

    def __post_init__(self) -> None:
        for name in (
            "gemv_kernel",
            "tma_attention",
            "pdl",
            "fp8_gemv_w8a8",
            "moe_prep_kernels",
            "moe_gemv",
            "fused_qk_norm",
            "fused_norm_gemv",
            "advance_kernel",
            "lora_stacked",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.fp8_one_row_kernel is not None and self.fp8_one_row_kernel not in FP8_ONE_ROW_KERNELS:
            raise ValueError(
                f"fp8_one_row_kernel must be one of {', '.join(FP8_ONE_ROW_KERNELS)} or unset, "
                f"got {self.fp8_one_row_kernel!r}"
            )
        if self.fp8_split_k is not None and (
            isinstance(self.fp8_split_k, bool) or not isinstance(self.fp8_split_k, int) or self.fp8_split_k < 1
        ):
            raise ValueError(f"fp8_split_k must be an int >= 1 or unset, got {self.fp8_split_k!r}")
        if self.fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"fp8_gemm must be one of {', '.join(FP8_GEMMS)}, got {self.fp8_gemm!r}")


DEFAULT_KERNEL_CHOICES = KernelChoices()
