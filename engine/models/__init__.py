"""Model classes by architecture: every one is the decoder skeleton (`decoder.py`) plus what differs."""

from __future__ import annotations

from kvmesh.common.model_files import ModelConfig
from kvmesh.engine.models.decoder import AttentionMetadata, DecoderForCausalLM
from kvmesh.engine.models.llama import LlamaForCausalLM
from kvmesh.engine.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from kvmesh.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: tuple[type[DecoderForCausalLM], ...] = (
    LlamaForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    MixtralForCausalLM,
)
# HF ``model_type`` -> class (kvmesh.common.model_files.MODEL_TYPE_OF_HF maps HF class names to model types).
BY_MODEL_TYPE: dict[str, type[DecoderForCausalLM]] = {t: c for c in MODEL_CLASSES for t in c.MODEL_TYPES}


def model_class(cfg: ModelConfig) -> type[DecoderForCausalLM]:
    """The class that runs ``cfg.architecture`` (the loader already refused unknown ones)."""
    try:
        return BY_MODEL_TYPE[cfg.architecture]
    except KeyError:
        raise ValueError(f"no model class for architecture {cfg.architecture!r}") from None


__all__ = [
    "AttentionMetadata",
    "BY_MODEL_TYPE",
    "DecoderForCausalLM",
    "LlamaForCausalLM",
    "MODEL_CLASSES",
    "MixtralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "model_class",
]
