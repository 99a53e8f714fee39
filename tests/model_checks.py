"""Model checks shared by test folders (tests/ is on the test runner's path, as for kernel_checks)."""

from __future__ import annotations

import torch

from kvmesh.engine.models.llama import AttentionMetadata, LlamaForCausalLM


def prefill_logits(model: LlamaForCausalLM, ids: list[int], bs: int = 16) -> torch.Tensor:
    """Logits at every position of one sequence prefilled into a fresh paged KV cache."""
    cfg, T = model.cfg, len(ids)
    nb = -(-T // bs)
    kv = torch.zeros(nb, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T),
        block_tables=torch.arange(nb, dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        seq_lens=torch.tensor([T], dtype=torch.int32),
    )
    return model.forward(torch.tensor(ids), torch.arange(T), kv, meta, None)
