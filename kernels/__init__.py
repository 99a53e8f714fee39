"""GPU kernels of kvmesh (Triton) with pure-torch references.

Every public function checks its arguments and dispatches per call: compiled Triton on CUDA
tensors, the Triton interpreter on CPU tensors when ``TRITON_INTERPRET=1``, else the torch
reference in `kvmesh.kernels.reference` (see `kvmesh.kernels._dispatch`). Wrappers live in one
module per family (attention, kv_cache, elementwise, matmul, moe, sampling), kernel bodies in
`kvmesh.kernels._triton`. Which variant a call launches where there are several (the GEMV kernel
or cuBLAS, TMA attention, programmatic dependent launch, the FP8 paths) is the caller's
`KernelChoices`, passed as ``choices=`` (default: the measured best); the engine fixes them when
it builds its model. See docs/kernels.md for the KV layout, tolerances and measurements.
"""

from kvmesh.common.kernel_choices import DEFAULT_KERNEL_CHOICES, KernelChoices

from ._dispatch import backend
from .attention import attention_config, paged_attention
from .elementwise import rms_norm, rope, silu_and_mul
from .fp8 import Fp8Weight, fp8_quantize_rows, quantize_weight
from .gemv import gemv_config
from .kv_cache import advance_decode_inputs, copy_blocks, gather_blocks, rope_write_kv, write_kv
from .lora import lora_expand, lora_shrink
from .matmul import linear, rms_norm_linear, silu_mul_linear
from .moe import fused_moe, moe_config, moe_routing
from .reference import (
    advance_decode_inputs_reference,
    copy_blocks_reference,
    dequantize_kv_reference,
    fp8_gemv_reference,
    fp8_linear_reference,
    fp8_quantize_rows_reference,
    fused_moe_reference,
    gather_blocks_reference,
    linear_reference,
    lora_expand_reference,
    lora_shrink_reference,
    moe_routing_reference,
    paged_attention_reference,
    quantize_kv_reference,
    race_argmax_reference,
    race_noise_reference,
    rms_norm_reference,
    rope_reference,
    rope_write_kv_reference,
    silu_and_mul_reference,
    silu_mul_linear_reference,
    softmax_temperature_reference,
    top_p_threshold_reference,
    write_kv_reference,
)
from .sampling import race_argmax, race_noise, softmax_temperature, top_p_threshold

__all__ = [
    "DEFAULT_KERNEL_CHOICES",
    "KernelChoices",
    "Fp8Weight",
    "advance_decode_inputs",
    "advance_decode_inputs_reference",
    "fp8_gemv_reference",
    "fp8_linear_reference",
    "fp8_quantize_rows",
    "fp8_quantize_rows_reference",
    "quantize_weight",
    "attention_config",
    "backend",
    "copy_blocks",
    "fused_moe",
    "gather_blocks",
    "gemv_config",
    "linear",
    "lora_expand",
    "lora_shrink",
    "moe_config",
    "moe_routing",
    "paged_attention",
    "race_argmax",
    "race_noise",
    "softmax_temperature",
    "rms_norm",
    "rope",
    "rope_write_kv",
    "silu_and_mul",
    "rms_norm_linear",
    "silu_mul_linear",
    "top_p_threshold",
    "write_kv",
    "copy_blocks_reference",
    "dequantize_kv_reference",
    "fused_moe_reference",
    "gather_blocks_reference",
    "linear_reference",
    "lora_expand_reference",
    "lora_shrink_reference",
    "moe_routing_reference",
    "paged_attention_reference",
    "quantize_kv_reference",
    "race_argmax_reference",
    "race_noise_reference",
    "softmax_temperature_reference",
    "rms_norm_reference",
    "rope_reference",
    "rope_write_kv_reference",
    "silu_and_mul_reference",
    "silu_mul_linear_reference",
    "top_p_threshold_reference",
    "write_kv_reference",
]
