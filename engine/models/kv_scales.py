"""Static dequantisation scales of an FP8 KV cache, one pair (K, V) per layer.

The cache stores ``key / k_scale`` (and ``value / v_scale``) as float8_e4m3fn and attention reads
``stored * scale``. As in vLLM's default, the scales are static: read from the checkpoint where it
carries them (FP8 checkpoints calibrated for their KV cache), else 1.0, which suits models whose
keys and values stay well inside e4m3's +-448 range (values beyond it are clamped). A scale is
per tensor (one number per layer for K, one for V) or, when the checkpoint stores one per KV head,
per head; the kernels take both as a float32 ``[Hkv]`` vector per layer.

Names read, per layer ``model.layers.{i}.``: ``self_attn.k_scale`` / ``self_attn.v_scale`` (vLLM's
``fp8`` layout), ``self_attn.k_proj.output_scale`` / ``self_attn.v_proj.output_scale``
(compressed-tensors), or one ``self_attn.kv_scale`` for both (older checkpoints).
"""

from __future__ import annotations

import hashlib

import torch

from kvmesh.common.model_files import ModelConfig

_NAMES = (
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    ("self_attn.kv_scale", "self_attn.kv_scale"),
)

KVScales = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_scale, v_scale), float32 [Hkv]


def _as_heads(t: torch.Tensor, name: str, num_kv_heads: int) -> torch.Tensor:
    t = t.detach().float().reshape(-1)
    if t.numel() == 1:
        t = t.expand(num_kv_heads)
    elif t.numel() != num_kv_heads:
        raise ValueError(f"{name} has {t.numel()} values; a KV scale is one per tensor or one per KV head")
    if not (torch.isfinite(t).all() and (t > 0).all()):
        raise ValueError(f"{name} must be positive and finite, got {t.tolist()}")
    return t.contiguous()


def kv_cache_scales(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, device: torch.device) -> KVScales:
    """The (k_scale, v_scale) of each layer, from the checkpoint or 1.0."""
    out: KVScales = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        pair = next(((p + k, p + v) for k, v in _NAMES if p + k in state_dict and p + v in state_dict), None)
        if pair is None:
            ks = vs = torch.ones(cfg.num_kv_heads)
        else:
            ks = _as_heads(state_dict[pair[0]], pair[0], cfg.num_kv_heads)
            vs = _as_heads(state_dict[pair[1]], pair[1], cfg.num_kv_heads)
        out.append((ks.to(device).contiguous(), vs.to(device).contiguous()))
    return out


def scales_fingerprint(scales: KVScales | None) -> str:
    """A short id of the scales (empty for an unscaled cache): two engines whose FP8 blocks would
    decode differently never take each other's blocks (engine/connectors/common.py)."""
    if not scales:
        return ""
    flat = torch.stack([torch.stack([k, v]) for k, v in scales]).cpu().numpy().tobytes()
    return hashlib.sha256(flat).hexdigest()[:8]
