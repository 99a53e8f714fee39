"""Llama-family decoders: Llama 2/3, SmolLM2, Mistral (the Llama layout) and Qwen2 (q/k/v bias,
read from the checkpoint). The skeleton in `kvmesh.engine.models.decoder` is all of it."""

from __future__ import annotations

from kvmesh.engine.models.decoder import AttentionMetadata, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    MODEL_TYPES = ("llama", "mistral", "qwen2")


__all__ = ["AttentionMetadata", "LlamaForCausalLM"]
