"""GPU kernels of kvmesh (Triton) with pure-torch references.

Every public function checks its arguments and dispatches per call: compiled
Triton on CUDA tensors, the Triton interpreter on CPU tensors when
``TRITON_INTERPRET=1``, else the torch reference in `kvmesh.kernels.reference`.
See docs/kernels.md for the KV layout, tolerances and measurements.
"""
from .ops import (
    attention_config,
    backend,
    copy_blocks,
    gather_blocks,
    gemv_config,
    gemv_enabled,
    linear,
    paged_attention,
    race_argmax,
    rms_norm,
    rope,
    rope_write_kv,
    scatter_blocks,
    silu_and_mul,
    silu_mul_linear,
    top_p_threshold,
    write_kv,
)
from .reference import (
    copy_blocks_reference,
    gather_blocks_reference,
    linear_reference,
    paged_attention_reference,
    race_argmax_reference,
    rms_norm_reference,
    rope_reference,
    rope_write_kv_reference,
    scatter_blocks_reference,
    silu_and_mul_reference,
    silu_mul_linear_reference,
    top_p_threshold_reference,
    write_kv_reference,
)

__all__ = [
    "attention_config",
    "backend",
    "copy_blocks",
    "gather_blocks",
    "gemv_config",
    "gemv_enabled",
    "linear",
    "paged_attention",
    "race_argmax",
    "rms_norm",
    "rope",
    "rope_write_kv",
    "scatter_blocks",
    "silu_and_mul",
    "silu_mul_linear",
    "top_p_threshold",
    "write_kv",
    "copy_blocks_reference",
    "gather_blocks_reference",
    "linear_reference",
    "paged_attention_reference",
    "race_argmax_reference",
    "rms_norm_reference",
    "rope_reference",
    "rope_write_kv_reference",
    "scatter_blocks_reference",
    "silu_and_mul_reference",
    "silu_mul_linear_reference",
    "top_p_threshold_reference",
    "write_kv_reference",
]
