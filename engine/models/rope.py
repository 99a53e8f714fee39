"""Rotary position tables: default, linear and Llama-3 frequency scaling, computed as HF does (float32)."""

from __future__ import annotations

import math

import torch

from kvmesh.common.model_files import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq, position_scale)``; positions are divided by ``position_scale``."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling_dict
    if not scaling:
        return inv, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv, float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def cos_sin_cache(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """``[max_positions, head_dim]``: cos of each frequency in the first half, sin in the second."""
    inv, scale = inv_frequencies(cfg)
    pos = torch.arange(max_positions, dtype=torch.int64).float() / scale
    freqs = pos[:, None] * inv[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
