"""Qwen3 dense: the Llama skeleton with a per-head RMSNorm of q and k before RoPE (weights of size
head_dim), no q/k/v bias, and head_dim from the config (it may differ from hidden / heads)."""

from __future__ import annotations

from kvmesh.engine.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    MODEL_TYPES = ("qwen3",)
    QK_NORM = True
