"""Frozen configuration of one engine instance.

The same engine serves every role; `role` only changes what the connector hook
does with finished requests (prefill keeps blocks for a remote reader, decode
loads them), never the scheduler. The model's shape (`ModelConfig`) and the roles
are kvmesh.common's: the router reads them too, without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.common.kernel_choices import KernelChoices
from kvmesh.common.kv_formats import EVENT_FORMATS, KVMESH, MAP, PREFIX_HASHES
from kvmesh.common.model_files import ModelConfig
from kvmesh.common.roles import ROLES, Role
from kvmesh.engine.spec.config import DRAFT_MODEL, SpeculativeConfig

# "auto": the KV cache holds the model's dtype; "fp8": float8_e4m3fn with static per-layer scales
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8")
QUANTIZATIONS: tuple[str, ...] = ("fp8",)  # weight formats (engine/models/quantization.py)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size from kv_cache_memory_gb (CPU) or gpu_memory_utilization (GPU)
    enable_prefix_caching: bool = True
    kv_cache_memory_gb: float = 2.0
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES; fp8 halves the bytes per block (twice the blocks)
    # How the prefix cache hashes blocks (kvmesh.common.hashing: "kvmesh" or vLLM's "vllm") and how the
    # KV events are laid out on the wire (kvmesh.common.kv_events: vLLM's "map" form or v0.10's "array").
    prefix_hash: str = KVMESH
    kv_events_format: str = MAP
    # GiB of host memory per rank for the host-memory KV tier (engine/core/host_pool.py); 0: no tier
    kv_offload_gb: float = 0.0
    # the host tier in blocks instead (> 0: this many slots, whatever kv_offload_gb says): sized like
    # num_kv_blocks, for benchmarks that set the tier as a multiple of the device pool
    kv_offload_blocks: int = 0
    # GiB of local disk per rank for the disk KV tier under the host tier, and the folder of its file
    # (engine/runner/host_kv.py `DiskKV`; "": the system's temporary folder); 0: no disk tier
    kv_offload_disk_gb: float = 0.0
    kv_offload_disk_path: str = ""

    def __post_init__(self) -> None:
        if self.prefix_hash not in PREFIX_HASHES:
            raise ValueError(f"prefix_hash must be one of {PREFIX_HASHES}, got {self.prefix_hash!r}")
        if self.kv_events_format not in EVENT_FORMATS:
            raise ValueError(f"kv_events_format must be one of {EVENT_FORMATS}, got {self.kv_events_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_offload_gb < 0:
            raise ValueError(f"kv_offload_gb must be >= 0, got {self.kv_offload_gb}")
        if self.kv_offload_disk_gb < 0:
            raise ValueError(f"kv_offload_disk_gb must be >= 0, got {self.kv_offload_disk_gb}")
        if self.kv_offload_blocks < 0:
            raise ValueError(f"kv_offload_blocks must be >= 0, got {self.kv_offload_blocks}")
        if self.kv_offload_disk_gb > 0 and self.kv_offload_gb <= 0 and self.kv_offload_blocks <= 0:
            raise ValueError(
                "kv_offload_disk_gb needs kv_offload_gb > 0: the disk tier holds what the host tier evicts"
            )
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
    # request is a greedy decode (engine/core/decode_rounds.py); 1 turns this off.
    num_scheduler_steps: int = 1
    # Queue the next decode round behind the one on the device before reading its tokens, so the
    # host's output handling and scheduling overlap the device (engine/core/decode_rounds.py). None: on for a
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
class ParallelConfig:
    """How many devices the model is split across (engine/parallel/)."""

    tensor_parallel_size: int = 1
    # A collective or the ranks' rendezvous waiting longer than this fails the engine instead of
    # hanging it (a rank process that died, a host that never joined).
    rank_timeout_s: float = 300.0
    # Hosts the group spans (engine/parallel/rendezvous.py): each runs tensor_parallel_size / tp_nodes
    # ranks; this engine's host is the first, the others run `kvmesh rank`. All of them meet at
    # tcp://tp_leader_address:tp_port, where rank 0 listens.
    tp_nodes: int = 1
    tp_leader_address: str | None = None
    tp_port: int = 29500

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.rank_timeout_s <= 0:
            raise ValueError("rank_timeout_s must be > 0")
        if self.tp_nodes < 1 or self.tensor_parallel_size % self.tp_nodes:
            raise ValueError(
                f"tp_nodes must be >= 1 and divide tensor_parallel_size ({self.tensor_parallel_size}), "
                f"got {self.tp_nodes}"
            )
        if self.tp_nodes > 1 and not self.tp_leader_address:
            raise ValueError("tp_nodes > 1 needs tp_leader_address: the address every host reaches rank 0 at")
        if not 0 < self.tp_port < 65536:
            raise ValueError(f"tp_port must be a TCP port (1-65535), got {self.tp_port}")

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each host (one process and one device each)."""
        return self.tensor_parallel_size // self.tp_nodes


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA serving (engine/lora/): adapters resident on the device at once, their largest
    rank, and the adapters registered at start (name, PEFT folder)."""

    enabled: bool = False
    max_loras: int = 4  # device slots: distinct adapters a step may run (each with its A/B pool)
    max_lora_rank: int = 16  # the pool's rank; adapters of a larger rank are refused
    modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.modules and not self.enabled:
            raise ValueError("LoRA modules given with LoRA disabled (enable_lora)")
        names = [n for n, _ in self.modules]
        if any(not n or "@" in n for n in names):
            raise ValueError(f"LoRA adapter names must be non-empty and without '@': {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA adapter names must be unique: {names}")

    @staticmethod
    def parse_module(spec: str) -> tuple[str, str]:
        """``NAME=PATH`` (the ``--lora-modules`` form) as ``(name, path)``."""
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"a LoRA module is NAME=PATH (a PEFT adapter folder), got {spec!r}")
        return name.strip(), path.strip()


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    role: Role = "both"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    engine_id: str = "kvmesh-0"
    quantization: str | None = None  # projection weights: None (the model's dtype) or "fp8"
    # the kernel variants the model's layers launch, fixed for the engine's life (its CUDA graphs hold them)
    kernels: KernelChoices = field(default_factory=KernelChoices)
    speculative: SpeculativeConfig | None = None  # speculative decoding (engine/spec/); None: off

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
        tp = self.parallel.tensor_parallel_size
        if tp > 1:
            from kvmesh.engine.parallel.sharding import check_divisible

            check_divisible(self.model, tp)
            if self.speculative is not None and self.speculative.method == DRAFT_MODEL:
                raise ValueError(
                    "speculative method draft_model runs its draft on rank 0 only: not under "
                    "tensor_parallel_size > 1 yet (ngram works at any TP size)"
                )
            # Decode rounds run several steps on the device without the host, so they would need the
            # other ranks to run rounds of their own; under TP every step goes through the step plan.
            if self.scheduler.num_scheduler_steps > 1 or self.scheduler.async_scheduling:
                raise ValueError(
                    "tensor_parallel_size > 1 runs one step per round: num_scheduler_steps must be 1 and "
                    "async_scheduling off"
                )
