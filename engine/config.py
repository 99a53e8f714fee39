"""Frozen configuration of one engine instance.

The same engine serves every role; `role` only changes what the connector hook
does with finished requests (prefill keeps blocks for a remote reader, decode
loads them), never the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[str, ...] = ("both", "prefill", "decode")
QUANTIZATIONS: tuple[str, ...] = ("fp8",)  # weight formats (engine/quantization.py)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from HF config.json or GGUF metadata."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] | None = None  # frozen dict: (key, value) pairs
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: str | None = None  # the checkpoint's own weight format ("fp8": pre-quantized)

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def identity(self) -> str:
        """A string naming the weights' shape; folded into block hashes so caches never mix models."""
        return (
            f"{self.name}|{self.num_layers}x{self.hidden_size}|kv{self.num_kv_heads}x{self.head_dim}|v{self.vocab_size}"
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size from kv_cache_memory_gb (CPU) or gpu_memory_utilization (GPU)
    enable_prefix_caching: bool = True
    kv_cache_memory_gb: float = 2.0
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # 0: no per-request cap beyond the step budget
    max_waiting: int = 0  # 0: unbounded admission queue
    # Decode steps run back to back on the device per scheduling round when every scheduled
    # request is a greedy decode (engine/decode_rounds.py); 1 turns this off.
    num_scheduler_steps: int = 1
    # Queue the next decode round behind the one on the device before reading its tokens, so the
    # host's output handling and scheduling overlap the device (engine/decode_rounds.py). None: on for a
    # GPU, off on the CPU (whose forward runs on the host thread: nothing to overlap).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.num_scheduler_steps < 1:
            raise ValueError("num_scheduler_steps must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    role: Role = "both"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    engine_id: str = "kvmesh-0"
    quantization: str | None = None  # projection weights: None (the model's dtype) or "fp8"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or unset, got {self.quantization!r}")
        if self.model.quantization is not None and self.quantization != self.model.quantization:
            raise ValueError(
                f"the checkpoint is quantized ({self.model.quantization}); quantization {self.quantization!r} "
                "cannot run it"
            )
