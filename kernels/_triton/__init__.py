"""Triton kernel bodies of `kvmesh.kernels`, launched only by its wrappers (which check the
arguments and choose the launch configuration). One module per family; the wrappers reach every
kernel through this package."""

from .attention import paged_attention_kernel, paged_decode_tma_kernel, reduce_segments_kernel
from .cache import advance_decode_kernel, block_copy_kernel, rope_write_kv_kernel, write_kv_kernel
from .elementwise import rms_norm_kernel, rope_kernel, silu_and_mul_kernel
from .fp8 import fp8_gemm_kernel, fp8_quant_rows_kernel, fp8_swapab_kernel
from .gemv import gemv_kernel
from .lora import lora_expand_kernel, lora_shrink_kernel
from .moe import (
    fused_moe_kernel,
    moe_align_kernel,
    moe_gemv_down_kernel,
    moe_gemv_gate_up_kernel,
    moe_routing_kernel,
)
from .sampling import (
    race_argmax_kernel,
    race_noise_kernel,
    softmax_stats_kernel,
    softmax_write_kernel,
    top_p_hist_kernel,
    top_p_select_kernel,
)

__all__ = [
    "advance_decode_kernel",
    "block_copy_kernel",
    "fused_moe_kernel",
    "moe_align_kernel",
    "moe_gemv_down_kernel",
    "moe_gemv_gate_up_kernel",
    "moe_routing_kernel",
    "fp8_gemm_kernel",
    "fp8_quant_rows_kernel",
    "fp8_swapab_kernel",
    "gemv_kernel",
    "lora_expand_kernel",
    "lora_shrink_kernel",
    "paged_attention_kernel",
    "paged_decode_tma_kernel",
    "race_argmax_kernel",
    "race_noise_kernel",
    "reduce_segments_kernel",
    "rms_norm_kernel",
    "rope_kernel",
    "rope_write_kv_kernel",
    "silu_and_mul_kernel",
    "softmax_stats_kernel",
    "softmax_write_kernel",
    "top_p_hist_kernel",
    "top_p_select_kernel",
    "write_kv_kernel",
]
