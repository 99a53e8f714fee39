"""How large the KV pool is: bytes per block, the memory budget, and (GPU) the reserve a step needs."""

from __future__ import annotations

import os
from typing import Any

import torch

from kvmesh.common.env import env
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.models.decoder import AttentionMetadata, DecoderForCausalLM
from kvmesh.engine.runner.graphs import graph_sizes, verify_graph_sizes
from kvmesh.engine.runner.inputs import cdiv

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def kv_cache_dtype(config: EngineConfig) -> torch.dtype:
    """The KV pool's element type: the model's dtype, or float8_e4m3fn for ``kv_cache_dtype="fp8"``."""
    return torch.float8_e4m3fn if config.cache.kv_cache_dtype == "fp8" else torch_dtype(config.dtype)


def kv_bytes_per_block(config: EngineConfig, kv_heads: int | None = None) -> int:
    """Bytes of one block (all layers, K and V): an FP8 pool fits twice the bf16 blocks in a budget.
    ``kv_heads``: the KV heads this pool holds (a tensor-parallel rank's share; default: all)."""
    m = config.model
    heads = m.num_kv_heads if kv_heads is None else kv_heads
    return m.num_layers * 2 * config.cache.block_size * heads * m.head_dim * kv_cache_dtype(config).itemsize


def num_blocks_for(
    config: EngineConfig,
    weight_bytes: int = 0,
    reserve_bytes: int = 0,
    kv_heads: int | None = None,
    extra_bytes_per_block: int = 0,
) -> int:
    """Pool size: explicit, else a memory budget (CPU) or a share of free device memory (GPU); the
    budget is per device, so a tensor-parallel rank (``kv_heads``: its share) fits more blocks in it.

    On a GPU, ``reserve_bytes`` is what the step still needs beyond what is allocated
    now (activation peak, graphs, logits); weights are already on the device, so the
    free memory reported by the driver has them subtracted."""
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    # extra_bytes_per_block: a second pool indexed by the same block ids (a draft model's KV, engine/spec/draft.py)
    per_block = kv_bytes_per_block(config, kv_heads) + extra_bytes_per_block
    if config.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(config.device))
        budget = int(total * config.cache.gpu_memory_utilization) - (total - free) - reserve_bytes - (1 << 30)
    else:
        budget = int(config.cache.kv_cache_memory_gb * (1 << 30))
    n = budget // per_block
    if n < 2:
        raise ValueError("not enough memory for the KV cache; lower the model size or raise the memory budget")
    return int(n)


def configure_cpu_threads(ranks: int = 1) -> None:
    """Honour KVMESH_CPU_THREADS: OpenMP with more threads than idle cores slows matmuls by 10-30x.
    Unset, ``ranks`` tensor-parallel processes on one CPU share its cores (each its own part)."""
    n = env().cpu_threads
    if n is None and ranks > 1:
        n = max(1, (os.cpu_count() or 1) // ranks)
    if n is not None:
        torch.set_num_threads(n)


def profile_reserve(
    model: DecoderForCausalLM, config: EngineConfig, max_model_len: int, dtype: torch.dtype, device: torch.device
) -> int:
    """Run the largest eager step once on a scratch cache; return the bytes a step needs on top
    of what is allocated now (activation peak, graph pool estimate, sampler logits). GPU only.
    The scratch cache has the pool's element type (FP8 or not), so the step runs the kernels
    the engine will."""
    cfg, sc = config.model, config.scheduler
    block_size = config.cache.block_size
    T = max(1, min(sc.max_num_batched_tokens, max_model_len))
    # rows of logits a step may keep: one per sequence, 1 + k for one verifying k drafts (engine/spec/)
    spec = config.speculative
    rows = sc.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
    nb = cdiv(T, block_size) + 1
    scratch = torch.zeros(
        (nb, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim), dtype=kv_cache_dtype(config), device=device
    )
    dev = device
    i32: dict[str, Any] = dict(dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T, **i32),
        block_tables=torch.arange(nb, **i32)[None],
        query_start_loc=torch.tensor([0, T], **i32),
        seq_lens=torch.tensor([T], **i32),
        max_query_len=T,
        max_seq_len=T,
    )
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    model(torch.zeros(T, **i32), torch.arange(T, **i32), scratch, meta, torch.arange(min(T, rows), **i32))
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del scratch, meta
    torch.cuda.empty_cache()
    # Graph outputs (bf16 + fp32 logits per captured size; two sets with LoRA, engine/runner/graphs.py)
    # and the sampler's copies.
    logits = 4 * rows * cfg.vocab_size * 4
    sets = 2 if model.lora is not None else 1
    graphs = 2 * sets * (sum(graph_sizes(sc.max_num_seqs)) * cfg.vocab_size * 6) + (256 << 20)
    # Verification graphs (speculative decoding): their one shared fp32 logits buffer, and in the graph pool
    # the largest one's bf16 + fp32 logits and activations (a share of the profiled step's, by tokens).
    k = spec.num_speculative_tokens if spec is not None else 0
    vsizes = verify_graph_sizes(sc.max_num_seqs, k, sc.max_num_batched_tokens)
    if vsizes:
        tv = vsizes[-1] * (1 + k)
        graphs += tv * cfg.vocab_size * (4 + 6) + peak * tv // T
    return peak + logits + graphs
