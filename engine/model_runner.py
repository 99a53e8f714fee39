"""Turns a scheduler step into flat model inputs, runs the model, returns last-token logits.

It owns the KV tensor ``[num_blocks, num_layers, 2, block_size, Hkv, D]`` (block
first, so a block of all layers is one contiguous range for the connectors).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from kvmesh import kernels

from .config import EngineConfig
from .models.llama import AttentionMetadata, LlamaForCausalLM
from .scheduler import SchedulerOutput

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def kv_bytes_per_block(config: EngineConfig) -> int:
    m = config.model
    return m.num_layers * 2 * config.cache.block_size * m.num_kv_heads * m.head_dim * torch_dtype(config.dtype).itemsize


def num_blocks_for(config: EngineConfig, weight_bytes: int = 0) -> int:
    """Pool size: explicit, else a memory budget (CPU) or a share of free device memory (GPU)."""
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    per_block = kv_bytes_per_block(config)
    if config.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(config.device))
        budget = int(total * config.cache.gpu_memory_utilization) - (total - free) - (1 << 30)
    else:
        budget = int(config.cache.kv_cache_memory_gb * (1 << 30))
    n = budget // per_block
    if n < 2:
        raise ValueError("not enough memory for the KV cache; lower the model size or raise the memory budget")
    return int(n)


def configure_cpu_threads() -> None:
    """Honour KVMESH_CPU_THREADS: OpenMP with more threads than idle cores slows matmuls by 10-30x."""
    n = os.environ.get("KVMESH_CPU_THREADS")
    if n:
        torch.set_num_threads(max(1, int(n)))


class ModelRunner:
    def __init__(self, config: EngineConfig, state_dict: dict[str, torch.Tensor]) -> None:
        self.config = config
        if config.device == "cpu":
            configure_cpu_threads()
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.cache.block_size
        self.model = LlamaForCausalLM(config.model, state_dict, self.dtype, self.device,
                                      max_positions=max(config.scheduler.max_model_len, 1))
        self.num_blocks = num_blocks_for(config)
        m = config.model
        self.kv_cache = torch.zeros(
            (self.num_blocks, m.num_layers, 2, self.block_size, m.num_kv_heads, m.head_dim),
            dtype=self.dtype, device=self.device,
        )

    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns ``(logits, rows)``: ``logits[j]`` belongs to ``sched.scheduled[rows[j]]``."""
        if sched.block_copies:
            src = torch.tensor([s for s, _ in sched.block_copies], device=self.device)
            dst = torch.tensor([d for _, d in sched.block_copies], device=self.device)
            kernels.copy_blocks(self.kv_cache, src, dst)
        if not sched.scheduled:
            return torch.empty(0, self.config.model.vocab_size), []
        bs = self.block_size
        ids: list[int] = []
        pos_parts = []
        slot_parts = []
        qsl = [0]
        seq_lens = []
        tables = []
        rows = []
        for j, s in enumerate(sched.scheduled):
            r = s.request
            start = r.num_computed_tokens
            end = start + s.num_tokens
            ids.extend(r.all_token_ids[start:end])
            pos = np.arange(start, end, dtype=np.int64)
            block_ids = np.asarray(s.block_ids, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(block_ids[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + s.num_tokens)
            seq_lens.append(end)
            tables.append(block_ids)
            if s.completes_prompt:
                rows.append(j)
        max_blocks = max(len(t) for t in tables)
        bt = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            block_tables=torch.from_numpy(bt).to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(s.num_tokens for s in sched.scheduled),
            max_seq_len=max(seq_lens),
        )
        logits_idx = torch.tensor([qsl[j + 1] - 1 for j in rows], dtype=torch.int64, device=dev)
        logits = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            self.kv_cache, meta, logits_idx,
        )
        return logits, rows
