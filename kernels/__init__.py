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
    paged_attention,
    rms_norm,
    rope,
    scatter_blocks,
    silu_and_mul,
    write_kv,
)
from .reference import (
    copy_blocks_reference,
    gather_blocks_reference,
    paged_attention_reference,
    rms_norm_reference,
    rope_reference,
    scatter_blocks_reference,
    silu_and_mul_reference,
    write_kv_reference,
)

__all__ = [
    "attention_config",
    "backend",
    "copy_blocks",
    "gather_blocks",
    "paged_attention",
    "rms_norm",
    "rope",
    "scatter_blocks",
    "silu_and_mul",
    "write_kv",
    "copy_blocks_reference",
    "gather_blocks_reference",
    "paged_attention_reference",
    "rms_norm_reference",
    "rope_reference",
    "scatter_blocks_reference",
    "silu_and_mul_reference",
    "write_kv_reference",
]
