"""`EngineArgs`: every setting an engine is built from, declared once.

Each field carries its default, its command-line flag and help (kvmesh.common.fields) and, when an
InferenceService exposes it, its property under ``spec.engine`` in the CRD (`CrdProperty`). The
CLI (`add_cli_args`, `from_cli_args`), `EngineCore.from_model`, `LLM` and the operator's rendering
(kvmesh/operator/render.py) all read these fields; the checks on values stay in the config
dataclasses built by `create_engine_config` (engine/config.py).

This module imports no torch: the operator reads it too.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.common.fields import add_arguments, cli, scalar_type, values_from
from kvmesh.common.kernel_choices import FP8_GEMMS, FP8_ONE_ROW_KERNELS, KernelChoices
from kvmesh.common.kv_formats import EVENT_FORMATS, PREFIX_HASHES
from kvmesh.common.model_files import ModelConfig
from kvmesh.common.roles import ROLES, Role
from kvmesh.engine.config import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    LoraConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvmesh.engine.spec.config import SpeculativeConfig

CRD = "crd"
KERNELS = "kernels"  # the section of the kernel variants' flags (`KernelChoices`)


@dataclass(frozen=True)
class CrdProperty:
    """A setting's property in the InferenceService CRD: ``spec.engine.<name>``.

    ``default`` is the CRD's own (the operator's pods are sized for a GPU, so it may differ from the
    CLI's); ``unset`` is the CRD value that leaves the flag out so the engine chooses. The schema
    (kvmesh/operator/crd.py writes it into crds/) takes its type from the field, its enum from
    ``enum`` or else from the flag's choices plus ``unset``, and the bounds and description here."""

    name: str
    default: Any
    unset: Any = None
    enum: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    description: str | None = None


def _setting(default: Any, help: str | None = None, *, crd: CrdProperty | None = None, **cli_kw: Any):
    meta = cli(help, **cli_kw)
    if crd is not None:
        meta[CRD] = crd
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineArgs:
    """Defaults are the config dataclasses' own where the setting lands unchanged in one of them."""

    model: str | None = _setting(None, "HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    block_size: int = _setting(
        CacheConfig.block_size,
        crd=CrdProperty(
            "blockSize",
            16,
            enum=(8, 16, 32, 64, 128),
            description="Tokens per KV block; prefill and decode must agree for KV transfer.",
        ),
    )
    max_num_batched_tokens: int = _setting(
        SchedulerConfig.max_num_batched_tokens,
        crd=CrdProperty("maxNumBatchedTokens", 8192, minimum=16, maximum=1 << 20),
    )
    max_num_seqs: int = _setting(
        SchedulerConfig.max_num_seqs, crd=CrdProperty("maxNumSeqs", 128, minimum=1, maximum=4096)
    )
    max_model_len: int | None = _setting(None)  # None: the model's max_position_embeddings
    long_prefill_token_threshold: int = _setting(SchedulerConfig.long_prefill_token_threshold)
    num_scheduler_steps: int = _setting(
        SchedulerConfig.num_scheduler_steps,
        "decode steps run back to back on the device per scheduling round, for greedy and unseeded sampled "
        "requests (1: off); cuts host time per token, emits tokens in bursts of this size",
    )
    async_scheduling: bool | None = _setting(
        SchedulerConfig.async_scheduling,
        "queue the next decode step (or round of --num-scheduler-steps) on the device before reading the tokens "
        "of the one running, so host work overlaps the device (default: on for a GPU, off on the CPU)",
        action=argparse.BooleanOptionalAction,
    )
    enable_prefix_caching: bool = _setting(
        CacheConfig.enable_prefix_caching, flag="--no-enable-prefix-caching", action="store_false"
    )
    dtype: str | None = _setting(
        None, choices=["float32", "bfloat16", "float16"], crd=CrdProperty("dtype", "auto", unset="auto")
    )
    kv_cache_dtype: str | None = _setting(
        None,
        "KV cache element type: auto (the model's dtype) or fp8 (float8_e4m3fn: half the bytes, twice the "
        "blocks; static per-layer scales, the checkpoint's k_scale/v_scale or 1.0)",
        choices=list(KV_CACHE_DTYPES),
        crd=CrdProperty(
            "kvCacheDtype",
            "auto",
            unset="auto",
            enum=KV_CACHE_DTYPES,
            description="KV cache element type: auto (the model's dtype) or fp8 (float8_e4m3fn, twice the "
            "blocks per GB). KV blocks move only between pods that agree; others recompute.",
        ),
    )
    quantization: str | None = _setting(
        None,
        "fp8: the decoder's projection weights in e4m3 with per-channel scales, activations quantized per "
        "token (a float checkpoint is quantized at load; an FP8 checkpoint is read as FP8 without it)",
        choices=list(QUANTIZATIONS),
        crd=CrdProperty(
            "quantization",
            "none",
            unset="none",
            description="Weight quantization: fp8 (e4m3 projections, half the weight bytes; Hopper GPUs "
            "run it on FP8 tensor cores). FP8 checkpoints run as FP8 whatever this says.",
        ),
    )
    device: str | None = _setting(None, "cpu, cuda, cuda:1 (default: cuda if available)")
    gpu_memory_utilization: float = _setting(
        CacheConfig.gpu_memory_utilization,
        crd=CrdProperty(
            "gpuMemoryUtilization",
            0.9,
            minimum=0.05,
            maximum=0.99,
            description="GPU workers size their KV pool to this share of device memory.",
        ),
    )
    kv_cache_memory_gb: float = _setting(
        CacheConfig.kv_cache_memory_gb,
        "CPU KV pool budget when --num-kv-blocks is unset",
        crd=CrdProperty(
            "kvCacheMemoryGB",
            2.0,
            minimum=0.01,
            maximum=4096,
            description="CPU workers (gpus 0) size their KV pool to this many GB of host memory; "
            "count it in the pod's memory request.",
        ),
    )
    num_kv_blocks: int | None = _setting(CacheConfig.num_kv_blocks, "KV pool size in blocks (default: from memory)")
    kv_offload_gb: float = _setting(
        CacheConfig.kv_offload_gb,
        "GiB of host memory (per tensor-parallel rank) for a host-memory KV tier under the device pool: "
        "full cached blocks the device evicts are copied there and loaded back on a prefix hit (0: off)",
        crd=CrdProperty(
            "kvOffloadGb",
            0.0,
            minimum=0,
            maximum=4096,
            description="Host-memory KV tier per rank in GiB, 0 for none. Blocks evicted from the device "
            "pool are kept there and loaded back on a prefix hit. The operator adds it, times the pod's "
            "ranks, to the worker's memory request (and limit, if the role sets one).",
        ),
    )
    kv_offload_blocks: int = _setting(
        CacheConfig.kv_offload_blocks,
        "the host-memory KV tier in blocks (per rank) instead of --kv-offload-gb, as --num-kv-blocks sizes the "
        "device pool: e.g. 4x the device pool for a benchmark (0: --kv-offload-gb decides)",
    )
    kv_offload_disk_gb: float = _setting(
        CacheConfig.kv_offload_disk_gb,
        "GiB of local disk (per tensor-parallel rank) for a disk KV tier under the host tier: blocks the "
        "host tier evicts are written there and loaded back on a prefix hit (0: off; needs --kv-offload-gb)",
        crd=CrdProperty(
            "kvOffloadDiskGb",
            0.0,
            minimum=0,
            maximum=65536,
            description="Local-disk KV tier per rank in GiB under the host tier, 0 for none. The operator "
            "mounts an emptyDir of this size per rank (plus 64 MiB of slack each) for it and adds the same to "
            "the worker's ephemeral-storage request (and limit, if the role sets one); needs kvOffloadGb.",
        ),
    )
    kv_offload_disk_path: str = _setting(
        CacheConfig.kv_offload_disk_path,
        "folder of the disk KV tier's file (default: the system's temporary folder); the file is unlinked "
        "as soon as it is made, so nothing is left there when the engine stops",
    )
    prefix_hash: str = _setting(
        CacheConfig.prefix_hash,
        "how the prefix cache hashes blocks: kvmesh (model identity and cache_salt in the first block's "
        "keys) or vllm (vLLM 0.33's sha256_cbor hashes, so an llm-d or Dynamo indexer that hashes prompts "
        "the vLLM way matches this pod's KV events); kvmesh's router follows what the pods' events show",
        choices=list(PREFIX_HASHES),
        crd=CrdProperty(
            "prefixHash",
            CacheConfig.prefix_hash,
            description="Block hashes of the prefix cache and its KV events: kvmesh, or vllm (vLLM's "
            "sha256_cbor scheme, for an external llm-d or Dynamo router that hashes prompts itself).",
        ),
    )
    kv_events_format: str = _setting(
        CacheConfig.kv_events_format,
        "KV events on the wire: map (vLLM's named-field events, what current indexers read) or array "
        "(vLLM v0.10's positional arrays, for older consumers)",
        choices=list(EVENT_FORMATS),
        crd=CrdProperty(
            "kvEventsFormat",
            CacheConfig.kv_events_format,
            description="KV-event encoding: map (vLLM's current named fields) or array (vLLM v0.10's "
            "positional form). kvmesh's router reads both.",
        ),
    )
    seed: int = _setting(EngineConfig.seed)
    enable_lora: bool = _setting(
        LoraConfig.enabled,
        "serve LoRA adapters of the base model (PEFT folders; --lora-modules, or loaded at run time): a batch "
        "mixes rows of several adapters and of the base model",
        action="store_true",
    )
    lora_modules: tuple[str, ...] = _setting(
        (),
        "a LoRA adapter to serve from the start, as NAME=PATH (a PEFT folder: adapter_config.json + "
        "adapter_model.safetensors); repeatable; implies --enable-lora",
        action="append",
        metavar="NAME=PATH",
    )
    max_loras: int = _setting(
        LoraConfig.max_loras,
        "LoRA adapters resident on the device at once (slots); one step runs rows of at most this many, others "
        "wait, and an idle adapter is evicted (least recently used) for one that is needed",
        crd=CrdProperty(
            "maxLoras",
            LoraConfig.max_loras,
            minimum=1,
            maximum=256,
            description="LoRA adapters resident on a GPU at once (used when spec.loraAdapters is set).",
        ),
    )
    max_lora_rank: int = _setting(
        LoraConfig.max_lora_rank,
        "the largest LoRA rank served (the slots' size); adapters above it are refused",
        crd=CrdProperty(
            "maxLoraRank",
            LoraConfig.max_lora_rank,
            enum=(8, 16, 32, 64, 128, 256),
            description="The largest LoRA rank served; adapters of a larger rank are refused.",
        ),
    )
    speculative_config: str | None = _setting(
        None,
        'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (prompt lookup, no second model) or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (a smaller model of the '
        'same tokenizer; "embedded" for the embedded model); outputs keep the target\'s distribution',
        crd=CrdProperty(
            "speculativeConfig",
            "",
            unset="",
            description="Speculative decoding as vLLM's --speculative-config JSON (method ngram or draft_model, "
            "num_speculative_tokens, ...); empty for none. Outputs are those of the model alone.",
        ),
    )
    # Flags of the server commands (kvmesh serve/prefill/decode): the "server" section.
    role: Role = _setting(EngineConfig.role, choices=list(ROLES), section="server")
    max_waiting: int = _setting(
        SchedulerConfig.max_waiting,
        "bound on the engine's waiting queue; beyond it requests get 503 + Retry-After (0: unbounded)",
        section="server",
    )
    # The pod's shedding deadline (services/api/overload.py): read by the engine process, which owns the
    # queue and measures the rates; no engine config holds it.
    max_queue_wait_s: float = _setting(
        30.0,
        "refuse (503 + Retry-After from the estimate) a request the engine cannot start within this many "
        "seconds, estimated from the prefill backlog, free sequence slots and KV blocks and the measured "
        "token and finish rates (0: off, everything queues)",
        section="server",
        crd=CrdProperty(
            "maxQueueWaitS",
            30.0,
            minimum=0,
            description="Seconds a request may be expected to wait in a worker's queue; beyond it the worker "
            "answers 503 with a Retry-After computed from its queue (0: no bound, everything queues).",
        ),
    )
    tensor_parallel_size: int = _setting(
        ParallelConfig.tensor_parallel_size,
        "devices the model is split across, one rank process each (tensor parallelism: heads, MLP and "
        "vocabulary split; torch.distributed, NCCL on GPUs, gloo on the CPU)",
        crd=CrdProperty(
            "tensorParallelSize",
            1,
            minimum=1,
            maximum=64,
            description="Ranks the model is split across (tensor parallelism), all in one pod: a GPU worker "
            "gets one GPU per rank (a worker role's gpus defaults to this and must equal it), a CPU worker "
            "(gpus 0) runs this many CPU ranks. Must divide the model's attention heads.",
        ),
    )
    # A tensor-parallel group over several hosts (a LeaderWorkerSet: this server is the leader, the
    # other hosts run `kvmesh rank`, engine/parallel/node.py). Server flags: the "server" section.
    tp_nodes: int = _setting(
        ParallelConfig.tp_nodes,
        "hosts the tensor-parallel group spans, each running tensor_parallel_size / tp_nodes ranks (must "
        "divide --tensor-parallel-size): the server's host the first ones, each other host `kvmesh rank`",
        section="server",
        crd=CrdProperty(
            "tensorParallelNodes",
            1,
            minimum=1,
            maximum=64,
            description="Pods one worker replica spans (a LeaderWorkerSet group: the leader pod serves, the "
            "others run `kvmesh rank`), each with tensorParallelSize / tensorParallelNodes ranks; must divide "
            "tensorParallelSize. Needs LeaderWorkerSet (sigs.k8s.io/lws) in the cluster when above 1.",
        ),
    )
    tp_leader_address: str | None = _setting(
        ParallelConfig.tp_leader_address,
        "with --tp-nodes > 1: the leader's (the server's) address, which every host reaches; rank 0 listens there",
        section="server",
    )
    tp_port: int = _setting(
        ParallelConfig.tp_port,
        "with --tp-nodes > 1: the port rank 0 listens on, where every rank of the group meets",
        section="server",
    )
    rank_timeout_s: float = _setting(
        ParallelConfig.rank_timeout_s,
        "with --tensor-parallel-size > 1: how long rank 0 waits for every rank to load the model and join, "
        "and for a collective, before it fails the engine instead of hanging (raise it for very large models "
        "on slow storage)",
    )
    engine_id: str = _setting(
        EngineConfig.engine_id, "this engine's id in KV events and transfer params", section="server"
    )
    # Kernel variants (`KernelChoices`, fixed when the engine is built): the defaults are the measured
    # best; the others are for benchmarks that compare variants. The "kernels" section.
    gemv_kernel: bool = _setting(
        KernelChoices.gemv_kernel,
        "single-row projections (decode at batch 1) by kvmesh's one-row GEMV kernel; --no-gemv-kernel: cuBLAS",
        action=argparse.BooleanOptionalAction,
        section=KERNELS,
    )
    tma_attention: bool = _setting(
        KernelChoices.tma_attention,
        "decode attention through the TMA kernel where the launch heuristic picks it (Hopper); "
        "--no-tma-attention: the pointer kernel everywhere",
        action=argparse.BooleanOptionalAction,
        section=KERNELS,
    )
    pdl: bool = _setting(
        KernelChoices.pdl,
        "programmatic dependent launch of one-token kernel calls on Hopper (each launch overlaps the "
        "previous kernel's tail)",
        action=argparse.BooleanOptionalAction,
        section=KERNELS,
    )
    fp8_one_row_kernel: str | None = _setting(
        KernelChoices.fp8_one_row_kernel,
        "with --quantization fp8: this one-row kernel for every projection at batch 1 (default: the "
        "measured best per weight shape)",
        choices=list(FP8_ONE_ROW_KERNELS),
        section=KERNELS,
    )
    fp8_gemv_w8a8: bool = _setting(
        KernelChoices.fp8_gemv_w8a8,
        "with --quantization fp8: the one-row FP8 GEMV quantizes its input row too (W8A8, not W8A16)",
        action=argparse.BooleanOptionalAction,
        section=KERNELS,
    )
    fp8_split_k: int | None = _setting(
        KernelChoices.fp8_split_k,
        "with --quantization fp8: programs per output tile of the swapped-operand one-row product, for "
        "every shape (default: the measured value per weight shape)",
        section=KERNELS,
    )
    fp8_gemm: str = _setting(
        KernelChoices.fp8_gemm,
        "with --quantization fp8: the W8A8 product of more than one row (triton: kvmesh's untuned GEMM)",
        choices=list(FP8_GEMMS),
        section=KERNELS,
    )
    moe_prep_kernels: bool = _setting(
        KernelChoices.moe_prep_kernels,
        "MoE routing and alignment by one Triton launch each; --no-moe-prep-kernels: the torch ops",
        action=argparse.BooleanOptionalAction,
        section=KERNELS,
    )
    moe_gemv: bool = _setting(
        KernelChoices.moe_gemv,
        "MoE layers of up to 16 (token, expert) pairs (decode at batch 1 and 2 with top-8) by two "
        "matrix-vector kernels instead of alignment, the grouped GEMM and the sum over experts; "
        "--no-moe-gemv: the grouped GEMM at every batch",
        action=argparse.BooleanOptionalAction,
        section=KERNELS,
    )
    fused_qk_norm: bool = _setting(
        KernelChoices.fused_qk_norm,
        "Qwen3's q_norm and k_norm inside the RoPE + KV-write launch; --no-fused-qk-norm: two RMSNorm "
        "launches before it",
        action=argparse.BooleanOptionalAction,
        section=KERNELS,
    )
    fused_norm_gemv: bool = _setting(
        KernelChoices.fused_norm_gemv,
        "the RMSNorm before q|k|v and before the MLP (or the MoE router) formed by the kernel reading "
        "that projection's input (the one-row GEMV, or an FP8 weight's input quantization) instead of "
        "a launch of its own; off until measured on a GPU",
        action=argparse.BooleanOptionalAction,
        section=KERNELS,
    )
    advance_kernel: bool = _setting(
        KernelChoices.advance_kernel,
        "a decode round's next-step inputs advanced by one Triton launch between steps instead of a dozen "
        "torch ops; off until measured on a GPU",
        action=argparse.BooleanOptionalAction,
        section=KERNELS,
    )
    lora_stacked: bool = _setting(
        KernelChoices.lora_stacked,
        "with --enable-lora: the adapters' shrink inside the base projection's GEMM (their A stacked under "
        "its weight) and one expand launch; --no-lora-stacked: a shrink, a sum and an expand per projection",
        action=argparse.BooleanOptionalAction,
        section=KERNELS,
    )

    # ---- command line -------------------------------------------------------
    @classmethod
    def add_cli_args(cls, container: argparse._ActionsContainer, section: str = "") -> None:
        """The flags of one section: the engine's own (``""``: an "engine" group of ``container``, and
        the kernel variants' group after it) or ``"server"`` (added to ``container`` as it is)."""
        if section == "":
            add_arguments(container.add_argument_group("engine"), cls, section)
            kernels = container.add_argument_group(
                "kernel variants",
                "expert settings for benchmarks that compare variants; the defaults are the measured best",
            )
            add_arguments(kernels, cls, KERNELS)
            return
        add_arguments(container, cls, section)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**values_from(ns, cls))

    # ---- CRD (kvmesh/operator) ----------------------------------------------
    @classmethod
    def crd_fields(cls) -> Iterator[dataclasses.Field]:
        """Fields an InferenceService sets (``spec.engine``), in the order the operator passes them."""
        return (f for f in dataclasses.fields(cls) if CRD in f.metadata)

    @classmethod
    def from_crd(cls, spec_engine: Mapping[str, Any]) -> EngineArgs:
        """The settings of an InferenceService's ``spec.engine``, its CRD defaults filling the gaps."""
        kw: dict[str, Any] = {}
        for f in cls.crd_fields():
            p: CrdProperty = f.metadata[CRD]
            raw = spec_engine.get(p.name, p.default)
            kw[f.name] = None if raw == p.unset else scalar_type(cls, f)(raw)
        return cls(**kw)

    def to_crd(self) -> dict[str, Any]:
        """``spec.engine`` as the CRD spells it (the inverse of `from_crd` on its fields)."""
        out: dict[str, Any] = {}
        for f in self.crd_fields():
            p: CrdProperty = f.metadata[CRD]
            value = getattr(self, f.name)
            out[p.name] = p.unset if value is None else value
        return out

    # ---- the engine's configuration -----------------------------------------
    def create_engine_config(self, model: ModelConfig, model_path: str) -> EngineConfig:
        """The configs the engine runs with, for a loaded model; device and dtype left unset are
        chosen here (cuda when available; bfloat16 on a GPU, float32 on the CPU)."""
        device = self.device
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = self.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        max_len = min(self.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
        return self._pick(
            EngineConfig,
            model_path=model_path,
            model=model,
            dtype=dtype,
            device=device,
            quantization=self.quantization or model.quantization,
            cache=self._pick(CacheConfig, kv_cache_dtype=self.kv_cache_dtype or "auto"),
            scheduler=self._pick(SchedulerConfig, max_model_len=max_len),
            kernels=self._pick(KernelChoices),
            speculative=SpeculativeConfig.parse(self.speculative_config),
            lora=LoraConfig(
                enabled=self.enable_lora or bool(self.lora_modules),
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
                modules=tuple(LoraConfig.parse_module(m) for m in self.lora_modules),
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                tp_nodes=self.tp_nodes,
                tp_leader_address=self.tp_leader_address,
                tp_port=self.tp_port,
                rank_timeout_s=self.rank_timeout_s,
            ),
        )

    def _pick(self, cls: type, **given: Any) -> Any:
        """``cls`` built from the fields of the same name, ``given`` taking precedence."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(cls) if f.name not in given}
        return cls(**own, **given)
